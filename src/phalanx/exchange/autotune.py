"""The second half of ``bucket_mb = "auto"``: the cost model proposes, measurement decides.

On CPU ranks the model's assumption that overlapped communication is free does not hold (the
backend's threads share the cores with backward), so a layout the model prefers can be slower
in practice. The Engine therefore runs each candidate layout for a few steps and keeps the
fastest.

Phases:
  Phase 1: for each candidate (the model's choice, the 25 MiB default, one bucket for the whole
    model), rebuild the buckets and time ``steps`` steps; the first step after a rebuild is
    not timed (fresh buffers).
  Phase 2: every rank contributes its mean step time per candidate; the maximum over ranks
    (the step is as slow as its slowest rank) decides, identically everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Trial:
    """One candidate layout: bucket sizes in bytes and the step times measured with it."""

    bucket_bytes: int
    first_bucket_bytes: int
    times_s: list[float] = field(default_factory=list)


class LayoutTrials:
    """Steps through the candidates (see the module docstring); the same on every rank."""

    def __init__(self, candidates: list[tuple[int, int]], steps: int = 8) -> None:
        assert candidates, "at least one candidate"
        self.trials = [Trial(b, f) for b, f in candidates]
        self.steps = steps
        self.index = 0
        self._untimed = 1  # the first step of a layout is not timed

    @property
    def current(self) -> Trial:
        return self.trials[self.index]

    def record(self, step_s: float) -> bool:
        """Time one step of the current layout; True when it has enough steps."""
        if self._untimed:
            self._untimed -= 1
            return False
        self.current.times_s.append(step_s)
        return len(self.current.times_s) >= self.steps

    def advance(self) -> Trial | None:
        """The next candidate to try, or None when every one was measured."""
        self.index += 1
        self._untimed = 1
        return self.trials[self.index] if self.index < len(self.trials) else None

    def decide(self, group: dist.ProcessGroup, device: torch.device) -> Trial:
        """The fastest candidate by the slowest rank's mean step time (collective)."""
        means = torch.tensor(
            [sum(t.times_s) / max(1, len(t.times_s)) for t in self.trials], dtype=torch.float64
        ).to(device)
        dist.all_reduce(means, op=dist.ReduceOp.MAX, group=group)
        for trial, mean in zip(self.trials, means.tolist()):
            trial.times_s = [mean]  # keep the agreed number
        return min(self.trials, key=lambda t: t.times_s[0])

    def describe(self, chosen: Trial) -> str:
        parts = ", ".join(
            f"{t.bucket_bytes / 2**20:.2f} MiB: {t.times_s[0] * 1e3:.2f} ms" for t in self.trials
        )
        return f"measured step times ({parts}); kept {chosen.bucket_bytes / 2**20:.2f} MiB"
