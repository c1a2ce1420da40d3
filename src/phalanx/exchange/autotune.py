"""The second half of ``bucket_mb = "auto"``: the model proposes, measurement decides.
Phase 1: visit the candidates round-robin, ``visits`` times: rebuild, one untimed step, time.
Phase 2: the slowest rank's median step time per candidate decides, identically everywhere.
"""

from __future__ import annotations

import statistics
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
    """Steps through the candidates; the same on every rank."""

    def __init__(
        self, candidates: list[tuple[int, int]], steps_per_visit: int = 3, visits: int = 3
    ) -> None:
        assert candidates, "at least one candidate"
        self.trials = [Trial(b, f) for b, f in candidates]
        self.steps_per_visit = steps_per_visit
        visits = visits if len(self.trials) > 1 else 1  # one layout: nothing to compare
        self.schedule = [i for _ in range(visits) for i in range(len(self.trials))]
        self.position = 0
        self._untimed = 1  # the first step of a visit is not timed (fresh buffers)
        self._timed = 0

    @property
    def current(self) -> Trial:
        return self.trials[self.schedule[self.position]]

    def record(self, step_s: float) -> bool:
        """Time one step of the current layout; True when this visit has enough steps."""
        if self._untimed:
            self._untimed -= 1
            return False
        self.current.times_s.append(step_s)
        self._timed += 1
        return self._timed >= self.steps_per_visit

    def advance(self) -> Trial | None:
        """The next candidate to visit, or None when every visit was made."""
        self.position += 1
        self._untimed, self._timed = 1, 0
        return self.current if self.position < len(self.schedule) else None

    def decide(self, group: dist.ProcessGroup, device: torch.device) -> Trial:
        """The fastest candidate by the slowest rank's median step time (collective)."""
        medians = torch.tensor(
            [statistics.median(t.times_s) for t in self.trials], dtype=torch.float64
        ).to(device)
        dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)
        for trial, median in zip(self.trials, medians.tolist()):
            trial.times_s = [median]  # keep the agreed number
        return min(self.trials, key=lambda t: t.times_s[0])

    def describe(self, chosen: Trial) -> str:
        parts = ", ".join(
            f"{t.bucket_bytes / 2**20:.2f} MiB: {t.times_s[0] * 1e3:.2f} ms" for t in self.trials
        )
        return f"measured step times ({parts}); kept {chosen.bucket_bytes / 2**20:.2f} MiB"
