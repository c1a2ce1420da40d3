"""The planner's ``fsdp``: all-gathers around each unit's compute, reduce-scatters after its
backward, prefetch, resharding, mixed precision, bytes per rank, and its options."""

from __future__ import annotations

import pytest

from phalanx.costs import LayerCost
from phalanx.errors import ConfigError
from phalanx.planner.cluster import ClusterConfig, LinkConfig
from phalanx.planner.exchanges import make_schedule
from phalanx.planner.plan import default_strategies, make_plan
from phalanx.planner.sim import ExchangeSetup, Simulator, StepResult
from phalanx.planner.step import StepProfile
from phalanx.planner.trace import chrome_trace, lane_totals

ALPHA = 50e-6
MIB = 2**20
UNIT = 4 * MIB  # each layer's float32 parameters (= its gradients)
LAYERS = 6


def one_node(beta: float = 1e9, devices: int = 16) -> ClusterConfig:
    intra = LinkConfig(alpha_s=ALPHA, beta_bytes_per_s=beta)
    return ClusterConfig(name="node", nodes=1, devices_per_node=devices, intra=intra)


def layers(
    forward_s: float, backward_s: float, sizes: list[int] | None = None, optimizer: float = 0.0
) -> StepProfile:
    """Layers in backward order, each with one gradient of its parameters' bytes."""
    sizes = sizes or [UNIT] * LAYERS
    return StepProfile(
        layers=[
            LayerCost(name=f"l{i}", forward_s=forward_s, backward_s=backward_s, grad_bytes=(n,))
            for i, n in enumerate(sizes)
        ],
        batch_size=8,
        optimizer_s_per_byte=optimizer,
    )


def fsdp(
    step: StepProfile, p: int, beta: float = 1e9, compress: str = "none", **options
) -> StepResult:
    setup = ExchangeSetup(strategy="fsdp", options=options, compress=compress)
    return Simulator(step, one_node(beta)).run(p, setup)


def ring_half(p: int, n: float, beta: float = 1e9) -> float:
    """A ring all-gather or reduce-scatter of n bytes: p-1 steps of n/p."""
    return (p - 1) * (ALPHA + n / p / beta)


@pytest.mark.parametrize("p", [2, 4, 7])
def test_long_layers_on_a_fast_link_expose_only_the_first_gathers_and_last_reduce(p):
    """Each unit's gather takes ~3 ms against 50-100 ms of compute: prefetch hides all but
    the first unit's gather in forward and in backward, and the last reduce-scatter."""
    result = fsdp(layers(0.05, 0.1), p)
    t = ring_half(p, UNIT)
    assert result.exposed_s == pytest.approx(3 * t, rel=1e-9)
    assert result.parameter_wait_s == pytest.approx(2 * t, rel=1e-9)
    assert result.exchange_wait_s == pytest.approx(t, rel=1e-9)
    assert result.exposed_s < 0.02 * result.step_s


def test_without_compute_every_gather_and_reduce_is_exposed():
    p = 4
    result = fsdp(layers(0.0, 0.0), p)
    assert result.step_s == pytest.approx(3 * LAYERS * ring_half(p, UNIT), rel=1e-9)


def test_exposure_grows_as_the_link_slows():
    step = layers(0.01, 0.02)
    exposed = [fsdp(step, 8, beta=beta).exposed_s for beta in (1e10, 1e9, 1e8, 1e7)]
    assert exposed == sorted(exposed) and exposed[-1] > 50 * exposed[0]
    # a link far slower than compute: the gathers and reduces run back to back
    slow = fsdp(step, 8, beta=1e7)
    assert slow.step_s == pytest.approx(3 * LAYERS * ring_half(8, UNIT, 1e7), rel=0.02)


def test_prefetch_hides_gathers():
    step, p = layers(0.05, 0.1), 4
    t = ring_half(p, UNIT)
    # no prefetch: nothing overlaps (in backward a unit's gather queues behind the previous
    # unit's reduce-scatter)
    assert fsdp(step, p, prefetch=0).exposed_s == pytest.approx(3 * LAYERS * t, rel=1e-9)
    assert fsdp(step, p, prefetch=1).exposed_s == pytest.approx(3 * t, rel=1e-9)
    # a large unit after two small ones: its gather takes longer than one unit's forward,
    # so starting it two units ahead hides more of it
    uneven = layers(0.01, 0.02, sizes=[MIB, 24 * MIB, MIB, MIB])
    one, two = (fsdp(uneven, p, prefetch=k).exposed_s for k in (1, 2))
    assert two < one


def test_no_resharding_drops_the_backward_gathers():
    step, p = layers(0.05, 0.1), 4
    t = ring_half(p, UNIT)
    kept = fsdp(step, p, reshard_after_forward=False)
    assert kept.exposed_s == pytest.approx(2 * t, rel=1e-9)  # first gather, last reduce
    assert kept.parameter_wait_s == pytest.approx(t, rel=1e-9)
    bare = layers(0.0, 0.0)
    assert fsdp(bare, p, reshard_after_forward=False).step_s == pytest.approx(
        2 * LAYERS * t, rel=1e-9
    )
    assert fsdp(layers(0.01, 0.02), p, beta=1e8, reshard_after_forward=False).step_s < (
        fsdp(layers(0.01, 0.02), p, beta=1e8).step_s
    )


def test_one_device_is_the_plain_step():
    step = layers(0.01, 0.02, optimizer=1e-9)
    result = fsdp(step, 1)
    plain = Simulator(step, one_node()).run(1, ExchangeSetup())
    assert result.step_s == pytest.approx(step.compute_s) == pytest.approx(plain.step_s)
    assert result.exposed_s == pytest.approx(0.0, abs=1e-12) and result.max_bytes_sent == 0.0


@pytest.mark.parametrize("p", [2, 4, 7, 16])
def test_bytes_per_rank_are_two_gathers_and_a_reduce(p):
    step = layers(0.01, 0.02)
    total = LAYERS * UNIT
    share = (p - 1) / p * total
    result = fsdp(step, p)
    assert result.max_bytes_sent == pytest.approx(3 * share, rel=1e-9)
    assert result.bytes_intra == pytest.approx(3 * p * share, rel=1e-9)  # every rank sends
    kept = fsdp(step, p, reshard_after_forward=False)
    assert kept.max_bytes_sent == pytest.approx(2 * share, rel=1e-9)


def test_mixed_precision_moves_16_bit_parameters_and_gradients():
    step, p = layers(0.0, 0.0), 4
    share = (p - 1) / p * LAYERS * UNIT
    bf16 = fsdp(step, p, param_dtype="bfloat16")  # reduce_dtype None: param_dtype's
    assert bf16.max_bytes_sent == pytest.approx(1.5 * share, rel=1e-9)
    exact_reduce = fsdp(step, p, param_dtype="bfloat16", reduce_dtype="float32")
    assert exact_reduce.max_bytes_sent == pytest.approx(2.0 * share, rel=1e-9)
    assert bf16.step_s < exact_reduce.step_s < fsdp(step, p).step_s


def test_optimizer_steps_one_shard():
    step = layers(0.01, 0.02, optimizer=1e-9)
    assert fsdp(step, 8).optimizer_s == pytest.approx(step.optimizer_s / 8)


def test_trace_lanes_sum_to_the_step():
    result = fsdp(layers(0.01, 0.02), 4, beta=1e8)
    names = {e.name for e in result.events}
    assert {"u0 all-gather", "u0 all-gather (backward)", "u0 reduce-scatter"} <= names
    slices = [
        {**e, "lane": e["cat"]}
        for e in chrome_trace(result.events)["traceEvents"]
        if e["ph"] == "X"
    ]
    totals = lane_totals(slices, rank=0, step=max(e.step for e in result.events))
    busy = totals["compute"] + totals["wait"] + totals["optimizer"] + totals["input"]
    assert busy == pytest.approx(result.step_s, rel=1e-6)
    assert totals["wait"] == pytest.approx(result.exposed_s, rel=1e-6)


def test_fp16_compression_is_refused_and_left_out_of_plans():
    with pytest.raises(ConfigError, match=r"^exchange\.compress: .*reduce_dtype"):
        fsdp(layers(0.01, 0.02), 2, compress="fp16")
    plan = make_plan(
        layers(0.01, 0.02),
        one_node(),
        [1, 4],
        [("fsdp", {}), ("allreduce", {})],
        thresholds=["25", "auto"],
        compressions=["none", "fp16"],
    )
    cells = [(r.devices, r.setup.strategy, r.setup.compress) for r in plan.rows]
    assert (4, "fsdp", "fp16") not in cells
    assert [c for c in cells if c[1] == "fsdp"] == [(1, "fsdp", "none"), (4, "fsdp", "none")]
    assert plan.not_applicable and plan.not_applicable[0].startswith("fsdp / fp16")
    assert "fsdp" in default_strategies()


def test_options_are_the_strategys_config():
    """The planner reads fsdp's options through the strategy's own Config (its keys, its
    one-line errors)."""
    schedule = make_schedule("fsdp", {"prefetch": 2, "reshard_after_forward": False})
    assert schedule.config.prefetch == 2 and not schedule.config.reshard_after_forward
    assert make_schedule("fsdp").config.prefetch == 1  # defaults
    units = make_schedule("fsdp", {"param_dtype": "bfloat16"}).unit_phases(2)
    assert units.gather[0].scale == 0.5 and units.reduce[0].scale == 0.5  # reduce: param_dtype's
    for options, key in [
        ({"prefetch": -1}, "prefetch"),
        ({"param_dtype": "int8"}, "param_dtype"),
        ({"bucket": 3}, "bucket"),
    ]:
        with pytest.raises(ConfigError, match=rf"^exchange\.options\.{key}: "):
            make_schedule("fsdp", options)
