"""The memory plan (F17): the predicted peak fits the budget at the least predicted time."""

from __future__ import annotations

import pytest

from phalanx.costs import LayerCost
from phalanx.errors import ConfigError
from phalanx.memory.plan import KEEP, OFFLOAD, RECOMPUTE, make_plan, predict_peak

MIB = 2**20


def layers() -> list[LayerCost]:
    # a cheap-to-recompute layer with big saved tensors, a costly one, and small ones
    return [
        LayerCost(
            name="0", saved_bytes=8 * MIB, input_bytes=1 * MIB, forward_s=0.001, backward_s=0.002
        ),
        LayerCost(
            name="1", saved_bytes=8 * MIB, input_bytes=8 * MIB, forward_s=0.050, backward_s=0.1
        ),
        LayerCost(
            name="2", saved_bytes=4 * MIB, input_bytes=8 * MIB, forward_s=0.040, backward_s=0.08
        ),
        LayerCost(
            name="3", saved_bytes=1 * MIB, input_bytes=4 * MIB, forward_s=0.001, backward_s=0.002
        ),
    ]


def plan(budget_mib: float | None, bandwidth: float = 1e9, **kw: object):
    return make_plan(
        layers(),
        fixed_bytes=2 * MIB,
        budget_bytes=None if budget_mib is None else int(budget_mib * MIB),
        write_bytes_per_s=bandwidth,
        read_bytes_per_s=bandwidth,
        **kw,
    )


def test_no_budget_keeps_everything() -> None:
    p = plan(None)
    assert set(p.choices.values()) == {KEEP}
    assert p.predicted_peak == p.unmanaged_peak == (2 + 8 + 8 + 4 + 1) * MIB
    assert p.predicted_overhead_s == 0


@pytest.mark.parametrize("budget", [20, 16, 15])
def test_the_plan_fits_the_budget(budget: float) -> None:
    p = plan(budget)
    assert p.predicted_peak <= budget * MIB
    assert p.predicted_peak == predict_peak(layers(), p.choices, 2 * MIB)
    assert "budget" in p.describe()


def test_cheapest_choice_first_and_the_floor_plan_when_tight() -> None:
    p = plan(16)  # recomputing layer 0 (1 ms) frees 7 MiB: enough, and cheapest
    assert p.choices == {"0": RECOMPUTE, "1": KEEP, "2": KEEP, "3": KEEP}
    assert p.predicted_overhead_s == pytest.approx(layers()[0].forward_s)
    # the floor plan fits (two offloaded layers are back at once); put back to keep, what it
    # need not change: layers 2 and 3, after the peak (layer 2's backward, layer 1 read ahead)
    tight = plan(15)
    assert tight.choices == {"0": RECOMPUTE, "1": OFFLOAD, "2": KEEP, "3": KEEP}
    assert tight.predicted_peak == (2 + 1 + 8 + 4) * MIB
    slow = plan(15, bandwidth=1e7)  # the same choices cost more over a slower link
    assert slow.predicted_overhead_s > tight.predicted_overhead_s
    assert tight.prefetch_bytes is None  # whole layers read ahead while that fits


def test_below_the_whole_layer_window_the_prefetch_is_cut() -> None:
    """12 MiB: in backward the layer computing and the whole offloaded layer before it do not
    fit beside the rest; reading only part of that layer ahead does, and its exposed read is
    paid."""
    p = plan(12)
    offloaded = [x.saved_bytes for x in layers() if p.choices[x.name] == OFFLOAD]
    assert offloaded and p.prefetch_bytes is not None and p.prefetch_bytes < max(offloaded)
    assert p.predicted_peak <= 12 * MIB
    assert p.predicted_peak == predict_peak(layers(), p.choices, 2 * MIB, 0, p.prefetch_bytes)
    assert p.predicted_overhead_s > 0  # the exposed part of the read is paid
    assert "prefetch:" in p.describe()


def test_layers_named_by_hand_and_errors() -> None:
    p = plan(None, offload=["2"], recompute=["0"])
    assert (p.choices["2"], p.choices["0"]) == (OFFLOAD, RECOMPUTE)
    with pytest.raises(ConfigError, match="memory.offload: unknown layer 'conv9'; layers: 0, 1"):
        plan(None, offload=["conv9"])
    with pytest.raises(
        ConfigError,
        match=r"memory.budget_mb: 9.0 MiB cannot be met: the smallest predicted peak is 10.0",
    ):
        plan(9)
