"""The plan (F17): per layer keep, offload or recompute its saved activations, the cheapest
choices whose predicted peak (``predict_peak``) fits the budget; docs/memory.md has the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from phalanx.costs import LayerCost
from phalanx.errors import ConfigError

KEEP, OFFLOAD, RECOMPUTE = "keep", "offload", "recompute"


@dataclass
class Plan:
    """One choice per layer, with the predicted peak (bytes) and added time (seconds)."""

    choices: dict[str, str]
    predicted_peak: int
    predicted_overhead_s: float
    unmanaged_peak: int
    budget: int | None = None
    notes: list[str] = field(default_factory=list)
    smallest_peak: int = 0  # the least predicted peak any plan of these layers reaches
    prefetch_bytes: int | None = None  # read ahead per offloaded layer (None: all of it)

    def layers(self, choice: str) -> list[str]:
        return [name for name, c in self.choices.items() if c == choice]

    def describe(self) -> str:
        mib = 2**20
        head = (
            f"memory plan: predicted peak {self.predicted_peak / mib:.1f} MiB above the start "
            f"(unmanaged {self.unmanaged_peak / mib:.1f} MiB"
            + (f", budget {self.budget / mib:.1f} MiB" if self.budget else "")
            + f"), predicted overhead {1e3 * self.predicted_overhead_s:.1f} ms per step"
        )
        rows = [f"  {name}: {choice}" for name, choice in self.choices.items() if choice != KEEP]
        if self.prefetch_bytes is not None:
            rows.append(
                f"  prefetch: {self.prefetch_bytes / mib:.1f} MiB of a layer ahead of its "
                "backward (the rest is read when it starts)"
            )
        return "\n".join([head, *(rows or ["  every layer keeps its activations"])])


def offload_cost(
    layers: list[LayerCost],
    i: int,
    write_bytes_per_s: float,
    read_bytes_per_s: float,
    prefetch_bytes: int | None = None,
) -> float:
    """Seconds offloading layer i adds: what its write and read stick out of the next layer's
    forward and backward; beyond ``prefetch_bytes`` the read waits in full."""
    layer = layers[i]
    ahead = layer.saved_bytes if prefetch_bytes is None else min(layer.saved_bytes, prefetch_bytes)
    write = layer.saved_bytes / write_bytes_per_s
    read = ahead / read_bytes_per_s
    hide_write = layers[i + 1].forward_s if i + 1 < len(layers) else 0.0
    hide_read = layers[i + 1].backward_s if i + 1 < len(layers) else 0.0
    exposed = (layer.saved_bytes - ahead) / read_bytes_per_s
    return max(0.0, write - hide_write) + max(0.0, read - hide_read) + exposed


def predict_peak(
    layers: list[LayerCost],
    choices: dict[str, str],
    fixed_bytes: int,
    offload_overhead_bytes: int = 0,
    prefetch_bytes: int | None = None,
) -> int:
    """Fixed bytes + the tier's buffers when anything is offloaded + the larger of the
    activations at the end of forward and, at each layer's backward, those before it, its own
    all back, the prefetched read of the one before and its measured backward work."""
    offloads = any(choices.get(layer.name) == OFFLOAD for layer in layers)
    overhead = offload_overhead_bytes if offloads else 0
    resident = [_resident([layer], choices) for layer in layers]
    highest = sum(resident)  # the end of forward
    before = 0
    for i, layer in enumerate(layers):
        ahead = 0
        if i and choices.get(layers[i - 1].name) == OFFLOAD:
            saved = layers[i - 1].saved_bytes
            ahead = saved if prefetch_bytes is None else min(saved, prefetch_bytes)
        # measured: its output's gradient (there when it starts) and what its backward adds
        work = layer.output_bytes + layer.backward_work_bytes if layer.backward_work_bytes else 0
        highest = max(highest, before + layer.saved_bytes + ahead + work)
        before += resident[i]
    return fixed_bytes + overhead + highest


def _resident(layers: list[LayerCost], choices: dict[str, str]) -> int:
    """Saved bytes that stay on the device through forward (kept, or recompute's inputs)."""
    resident = 0
    for layer in layers:
        choice = choices.get(layer.name, KEEP)
        if choice == KEEP:
            resident += layer.saved_bytes
        elif choice == RECOMPUTE:
            resident += min(layer.input_bytes, layer.saved_bytes)
    return resident


def make_plan(
    layers: list[LayerCost],
    fixed_bytes: int,
    budget_bytes: int | None,
    *,
    write_bytes_per_s: float,
    read_bytes_per_s: float,
    offload: list[str] | None = None,
    recompute: list[str] | None = None,
    offload_overhead_bytes: int = 0,
    margin: float = 0.0,
) -> Plan:
    """The cheapest plan fitting ``budget_bytes`` less ``margin`` (None: only the named choices);
    ``offload``/``recompute``: layers that must take that choice."""
    fit_bytes = None if budget_bytes is None else int(budget_bytes * (1 - margin))
    names = [layer.name for layer in layers]
    choices = {name: KEEP for name in names}
    for choice, given in ((OFFLOAD, offload), (RECOMPUTE, recompute)):
        for name in given or []:
            if name not in names:
                raise ConfigError(
                    f"memory.{choice}: unknown layer {name!r}; layers: {', '.join(names)}"
                )
            choices[name] = choice

    def peaks(prefetch: int | None) -> Callable[[dict[str, str]], int]:
        return lambda plan: predict_peak(
            layers, plan, fixed_bytes, offload_overhead_bytes, prefetch
        )

    def costs_of(prefetch: int | None) -> Costs:
        costs = {
            (layer.name, OFFLOAD): offload_cost(
                layers, i, write_bytes_per_s, read_bytes_per_s, prefetch
            )
            for i, layer in enumerate(layers)
        }
        costs.update({(layer.name, RECOMPUTE): layer.forward_s for layer in layers})
        return costs

    unmanaged = peaks(None)({})
    floor = min([unmanaged, *(peaks(0)(plan) for plan in _floor_plans(layers, {}))])
    # Whole-layer prefetch first; only when no plan fits, a layer read ahead in part.
    best: tuple[float, dict[str, str], int | None] | None = None
    for prefetch in _prefetch_caps(layers, fit_bytes):
        peak_of, costs = peaks(prefetch), costs_of(prefetch)
        plan = choices
        if fit_bytes is not None:
            plan = _Fit(layers, costs, peak_of, fit_bytes).cheapest(choices)
        if fit_bytes is None or peak_of(plan) <= fit_bytes:
            if best is None or _total(costs, plan) < best[0]:
                best = (_total(costs, plan), plan, prefetch)
            if prefetch is None:
                break
    if best is None:
        assert budget_bytes is not None  # without a budget, the first (None) prefetch fits
        raise ConfigError(
            f"memory.budget_mb: {budget_bytes / 2**20:.1f} MiB cannot be met: the smallest "
            f"predicted peak is {floor / 2**20:.1f} MiB above the start (gradients, optimizer "
            f"state, backward's transient gradients and kernels' workspaces alone take "
            f"{fixed_bytes / 2**20:.1f} MiB"
            + (f"; plans fit {100 * (1 - margin):.0f}% of the budget)" if margin else ")")
        )
    overhead, choices, prefetch = best
    if not any(c == OFFLOAD for c in choices.values()):
        prefetch = None
    peak = peaks(prefetch)(choices)
    return Plan(
        choices, peak, overhead, unmanaged, budget_bytes, smallest_peak=floor,
        prefetch_bytes=prefetch,
    )  # fmt: skip


def _prefetch_caps(layers: list[LayerCost], budget_bytes: int | None) -> list[int | None]:
    """Read-ahead sizes to try: the whole layer, then 3/4, 1/2, 1/4 and none of the largest
    layer's saved bytes (only with a budget)."""
    largest = max((layer.saved_bytes for layer in layers), default=0)
    if budget_bytes is None or largest == 0:
        return [None]
    return [None, *(largest * k // 4 for k in (3, 2, 1, 0))]


Costs = dict[tuple[str, str], float]


def _total(costs: Costs, plan: dict[str, str]) -> float:
    return sum(costs[(name, c)] for name, c in plan.items() if c != KEEP)


@dataclass
class _Fit:
    """The search for the cheapest choices under ``budget_bytes``, for one prefetch size."""

    layers: list[LayerCost]
    costs: Costs
    peak_of: Callable[[dict[str, str]], int]
    budget_bytes: int

    def cheapest(self, given: dict[str, str]) -> dict[str, str]:
        """For every cap on an offloaded layer's size (the transfer window grows with the
        largest), fill greedily; the cheapest that fits, or ``given`` (the caller reports it)."""
        best: tuple[float, dict[str, str]] | None = None
        caps = sorted({0, *(layer.saved_bytes for layer in self.layers)})
        candidates = [self.fill(dict(given), cap) for cap in caps]
        for choices in [*candidates, *_floor_plans(self.layers, given)]:
            if self.peak_of(choices) > self.budget_bytes:
                continue
            self.keep_what_fits(choices, given)
            if best is None or _total(self.costs, choices) < best[0]:
                best = (_total(self.costs, choices), choices)
        return given if best is None else best[1]

    def keep_what_fits(self, choices: dict[str, str], given: dict[str, str]) -> None:
        """Back to keep, costliest first, every changed layer the plan fits without: the greedy
        fill frees bytes not always at the peak (the last layer's are back first anyway)."""
        changed = [n for n, c in choices.items() if c != KEEP and given.get(n, KEEP) == KEEP]
        for name in sorted(changed, key=lambda n: self.costs[(n, choices[n])], reverse=True):
            choice = choices[name]
            choices[name] = KEEP
            if self.peak_of(choices) > self.budget_bytes:
                choices[name] = choice

    def fill(self, choices: dict[str, str], cap: int) -> dict[str, str]:
        """Greedy: while over the budget, change the kept layer that frees the most resident
        bytes per predicted second; layers saving more than ``cap`` are not offloaded."""
        while self.peak_of(choices) > self.budget_bytes:
            before = _resident(self.layers, choices)
            best: tuple[float, str, str] | None = None
            for layer in self.layers:
                if choices[layer.name] != KEEP:
                    continue
                options = (OFFLOAD, RECOMPUTE) if layer.saved_bytes <= cap else (RECOMPUTE,)
                for option in options:
                    saved = before - _resident(self.layers, {**choices, layer.name: option})
                    value = saved / (self.costs[(layer.name, option)] + 1e-9)
                    if saved > 0 and (best is None or value > best[0]):
                        best = (value, layer.name, option)
            if best is None:
                break
            choices[best[1]] = best[2]
        return choices


def _floor_plans(layers: list[LayerCost], given: dict[str, str]) -> list[dict[str, str]]:
    """The plans with the smallest peaks: every layer not given by name offloaded, or each on
    its smaller resident choice (recompute where its input is smaller than what it saves)."""
    free = [layer for layer in layers if given.get(layer.name, KEEP) == KEEP]
    offload_all = {**given, **{layer.name: OFFLOAD for layer in free}}
    smaller = {x.name: RECOMPUTE if x.input_bytes < x.saved_bytes else OFFLOAD for x in free}
    return [offload_all, {**given, **smaller}]
