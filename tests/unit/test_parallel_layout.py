"""The [parallel] layout: stage keys, splits, schedules and transfer layers, without processes."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from phalanx.config import config_from_data
from phalanx.errors import ConfigError
from phalanx.parallel.layout import ParallelConfig
from phalanx.parallel.pipeline import describe_stages, pipelined_view, trace_boundaries
from phalanx.parallel.pipeline_schedules import schedule_kind
from phalanx.parallel.split import balanced_split, even_split, profile_layers
from phalanx.parallel.transfer import TransferLayer


def mlp_layers(stages: list[int | None]) -> list[dict]:
    sizes = [(64, 32), (32, 32), (32, 32), (32, 10)]
    layers: list[dict] = [{"type": "flatten"}]
    layers += [{"type": "linear", "in_features": a, "out_features": b} for a, b in sizes]
    for spec, stage in zip(layers, stages):
        if stage is not None:
            spec["stage"] = stage
    return layers


def run_config(stages: list[int | None], **parallel: object) -> object:
    return config_from_data(
        {"model": {"layers": mlp_layers(stages)}, "parallel": {"pipeline": 2, **parallel}}
    )


def test_stage_keys_are_read_in_order() -> None:
    config = run_config([0, 0, 1, 1, 1])
    assert config.stage_of_layers() == [0, 0, 1, 1, 1]
    assert run_config([None] * 5).stage_of_layers() is None  # split by [parallel]
    whole = config_from_data({"model": {"layers": mlp_layers([0, 0, 1, 1, 1])}})
    assert whole.stage_of_layers() is None  # pipeline = 1: the same config runs whole


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([0, 1, 0, 1, 1], "model.layers[2].stage: stage 0 after stage 1: stages must not decrease"),
        ([0, 0, 2, 2, 2], "model.layers[2].stage: stage 2 after stage 0: stage 1 is empty"),
        ([1, 1, 2, 2, 2], "model.layers[0].stage: the first stage is 0, got 1"),
        ([0, 0, 1, None, 1], "model.layers[3].stage: missing"),
        ([0, 0, 0, 0, 0], "the stage keys give 1 stages, the layout needs 2"),
        ([0, 0, 1, 2, 2], "the stage keys give 3 stages, the layout needs 2"),
    ],
)
def test_bad_stage_keys_name_the_layer(stages: list[int | None], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        run_config(stages)


def test_layout_errors_are_one_line() -> None:
    with pytest.raises(ConfigError, match="parallel.pipeline: 6 stages but the model has only 5"):
        config_from_data({"model": {"layers": mlp_layers([None] * 5)}, "parallel": {"pipeline": 6}})
    with pytest.raises(ConfigError, match="parallel.microbatches: data.batch_size 32 does not"):
        run_config([0, 0, 1, 1, 1], microbatches=5)
    with pytest.raises(ConfigError, match="parallel.schedule: got 'zb'"):
        run_config([0, 0, 1, 1, 1], schedule="zb")
    config = run_config([0, 0, 1, 1, 1])
    with pytest.raises(ConfigError, match="parallel.pipeline: 2 does not divide the world size 3"):
        config.check_world(3)
    with pytest.raises(ConfigError, match="parallel.data: data x pipeline = 3 x 2 = 6, but"):
        run_config([0, 0, 1, 1, 1], data=3).check_world(4)
    config.check_world(4)  # 2 replicas of 2 stages


def test_a_boundary_only_a_tensor_can_cross() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    layers = [nn.Linear(4, 4), Pair(), nn.Identity()]
    with pytest.raises(ConfigError, match=r"model.layers\[1\]: its output \(tuple\) cannot cross"):
        trace_boundaries(layers, [0, 0, 1], torch.zeros(2, 4))
    trace_boundaries(layers, [0, 1, 1], torch.zeros(2, 4))  # a tensor after layer 0: fine


def test_transfer_layers_show_where_activations_cross() -> None:
    layers = [nn.Flatten(), nn.Linear(64, 32), nn.Linear(32, 10)]
    boundaries = trace_boundaries(layers, [0, 0, 1], torch.zeros(8, 1, 8, 8))
    assert [(b.src, b.shape, b.dtype) for b in boundaries] == [
        (0, (8, 32), torch.float32),
        (1, (8, 10), torch.float32),  # the model's output
    ]
    printed = str(pipelined_view(layers, [0, 0, 1], boundaries))
    assert (
        "(transfer0): TransferLayer(stage 0 -> 1, 8x32, float32, 1024 bytes per micro-batch)"
        in printed
    )
    transfer = TransferLayer(0, 1, (8, 32), torch.bfloat16)
    x = torch.ones(8, 32, requires_grad=True)
    assert transfer(x) is x
    assert (transfer.nbytes, transfer.bytes_forward, transfer.bytes_backward) == (512, 1024, 1024)


def test_splits() -> None:
    assert even_split(7, 3) == [0, 0, 0, 1, 1, 2, 2]
    assert balanced_split([1, 1, 1, 1], 2) == [0, 0, 1, 1]
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1, 1]
    assert balanced_split([1, 1, 1, 9], 2) == [0, 0, 0, 1]
    assert balanced_split([3, 3, 3], 3) == [0, 1, 2]
    layers = [nn.Linear(16, 256), nn.Linear(256, 256), nn.Linear(256, 4)]
    costs = profile_layers(layers, torch.randn(32, 16))
    assert [c.param_bytes for c in costs] == [4 * (16 * 256 + 256), 4 * (256 * 256 + 256), 4 * 1028]
    assert [c.output_bytes for c in costs] == [32 * 256 * 4, 32 * 256 * 4, 32 * 4 * 4]
    assert all(c.seconds > 0 for c in costs)
    assert all(p.grad is None for layer in layers for p in layer.parameters())


def test_bubble_fraction_in_theory() -> None:
    assert schedule_kind("gpipe").bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert schedule_kind("1f1b").bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert schedule_kind("interleaved").bubble_fraction(4, 8, 2) == pytest.approx(1.5 / 9.5)
    assert ParallelConfig(pipeline=2, schedule="interleaved").num_stages == 4
    assert ParallelConfig(pipeline=3).num_microbatches == 6
    # The zero-bubble schedules' claims, with forward = input backward = weight backward.
    assert schedule_kind("interleaved_zb").bubble_fraction(4, 8, 2) == pytest.approx(0.5 / 8.5)
    assert schedule_kind("zbv").bubble_fraction(4, 8, 2) == 0.0
    assert schedule_kind("dualpipev").bubble_fraction(4, 8, 2) == 0.0


@pytest.fixture
def torch_2_13(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout checks below hold on any torch; the zero-bubble schedules are refused by
    version first on older ones (torch 2.11 on the GPU machine), so pretend 2.13 there."""
    from phalanx.parallel import pipeline_schedules as schedules

    monkeypatch.setattr(schedules, "_torch_version", lambda: "2.13.0")


def test_v_shaped_schedules_place_stages_r_and_2p_minus_1_minus_r(torch_2_13: None) -> None:
    for name in ("zbv", "dualpipev"):
        parallel = ParallelConfig(pipeline=3, schedule=name, microbatches=6)
        assert [parallel.rank_of_stage(s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    looped = ParallelConfig(pipeline=3, schedule="interleaved_zb", virtual_stages=2)
    assert [looped.rank_of_stage(s) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    # Stages 1 and 2 of a 2-rank V both run on rank 1: no transfer layer between them.
    layers = [nn.Linear(4, 4) for _ in range(4)]
    boundaries = trace_boundaries(layers, [0, 1, 2, 3], torch.zeros(2, 4))
    zbv = ParallelConfig(pipeline=2, schedule="zbv")
    printed = str(pipelined_view(layers, [0, 1, 2, 3], boundaries, zbv.rank_of_stage))
    assert "(transfer0)" in printed and "(transfer1)" not in printed and "(transfer2)" in printed
    lines = describe_stages([0, 1, 2, 3], boundaries, zbv.rank_of_stage).splitlines()
    assert lines[1].endswith("layers 1-1, then stage 2 on the same rank (no transfer)")
    assert lines[3] == "  stage 3 on pipeline rank 0: layers 3-3"


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (
            {"schedule": "zbv", "virtual_stages": 3},
            "parallel.virtual_stages: zbv runs exactly 2 stages per pipeline rank (v-shaped), "
            "got 3; set virtual_stages = 2",
        ),
        (
            {"schedule": "dualpipev", "microbatches": 2},
            "parallel.microbatches: dualpipev needs at least 2 x pipeline = 4 micro-batches, got 2",
        ),
        (
            {"schedule": "1f1b", "microbatches": 1},
            "parallel.microbatches: 1f1b needs at least 1 x pipeline = 2 micro-batches, got 1",
        ),
        (
            {"schedule": "interleaved_zb", "microbatches": 5},
            "parallel.microbatches: interleaved_zb runs rounds of about pipeline = 2 "
            "micro-batches and needs a multiple of 2 rounds, got 5; use a multiple of 2 or "
            "fewer than 4",
        ),
    ],
)
def test_schedule_constraints_are_one_line_errors(
    parallel: dict, message: str, torch_2_13: None
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message) + "$"):
        run_config([None] * 5, **parallel)


def test_a_schedule_this_torch_lacks_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, torch_2_13: None
) -> None:
    from phalanx.parallel import pipeline_schedules as schedules

    older = {k: v for k, v in schedules._torch_schedules().items() if k != "ScheduleDualPipeV"}
    monkeypatch.setattr(schedules, "_torch_schedules", lambda: older)
    with pytest.raises(ConfigError, match=r"parallel.schedule: 'dualpipev' needs torch.distri"
                       r"buted.pipelining.schedules.ScheduleDualPipeV, which torch \S+ lacks; "
                       r"upgrade torch or choose one of: 1f1b, gpipe, interleaved, "
                       r"interleaved_zb, looped_bfs, zbv$"):  # fmt: skip
        run_config([None] * 5, schedule="dualpipev", microbatches=4)
    run_config([None] * 5, schedule="dualpipev", microbatches=4, pipeline=1)  # no pipeline


def test_zero_bubble_schedules_on_an_older_torch_are_refused_by_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from phalanx.parallel import pipeline_schedules as schedules

    monkeypatch.setattr(schedules, "_torch_version", lambda: "2.11.0")
    for name in ("zbv", "dualpipev", "interleaved_zb"):
        with pytest.raises(ConfigError, match=rf"parallel.schedule: '{name}' needs torch >= "
                           r"2.13 here .* torch 2.11.0 is installed; upgrade torch or choose "
                           r"one of: 1f1b, gpipe, interleaved, looped_bfs$"):  # fmt: skip
            run_config([None] * 5, schedule=name, microbatches=4)


def test_gradients_written_past_the_hooks_reach_the_buckets() -> None:
    from phalanx.exchange.buckets import GradientBuckets

    layer = nn.Linear(3, 2)
    launched: list = []
    buckets = GradientBuckets(list(layer.parameters()), 1 << 20, launched.append)
    buckets.zero()
    buckets.arm(launch=False)
    layer.weight.grad = torch.ones_like(layer.weight)  # as torch's weight pass: no hook fires
    buckets.written([layer.weight])
    buckets.flush()
    (bucket,) = launched
    assert bucket.flags.tolist() == [0.0, 1.0]  # bias unused, weight used (backward order)
    assert layer.weight.grad.tolist() == [[1.0] * 3] * 2  # kept, not zeroed as unused
    assert layer.weight.grad.data_ptr() == bucket.views[1].data_ptr()
    # Where the hooks did fire in the same pass, a report must not count the gradient twice.
    buckets.arm(launch=False)
    layer(torch.ones(1, 3)).sum().backward()
    buckets.written(list(layer.parameters()))
    assert bucket.num_pending == 0 and sorted(buckets.ready_order) == [0, 1]
