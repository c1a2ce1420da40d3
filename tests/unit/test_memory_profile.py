"""``phalanx profile`` (F16): per-layer saved bytes against hand counts, exact optimizer state,
saved-tensor lifetimes, the timeline's peak, JSON, and the command itself."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from phalanx.cli import main
from phalanx.errors import ConfigError, DataError, PhalanxError
from phalanx.losses import loss_fn
from phalanx.memory.profile import MemoryProfile, profile_model, spread_line

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "configs" / "digits_cnn.toml")
F32 = 4
ADAM = functools.partial(torch.optim.Adam, lr=1e-3)


@pytest.fixture(autouse=True)
def keep_threads():
    """The command sets the intra-op threads as a worker would; give the others theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def batches(shape: tuple[int, ...], classes: int, steps: int = 2) -> list:
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(shape, generator=gen), torch.randint(0, classes, (shape[0],), generator=gen))
        for _ in range(steps)
    ]


def mlp_profile(steps: int = 2) -> tuple[list[nn.Module], MemoryProfile]:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)]
    return layers, profile_model(layers, loss_fn, ADAM, batches((4, 6), 3, steps), "cpu")


def test_saved_bytes_of_an_mlp_are_what_each_layer_saves_by_hand() -> None:
    _, profile = mlp_profile()
    first, relu, last = profile.layers
    assert first.saved_bytes == 4 * 6 * F32  # Linear keeps its input (the batch), not W
    assert relu.saved_bytes == 4 * 5 * F32  # ReLU keeps its output
    assert last.saved_bytes == 4 * 5 * F32  # ... which the next Linear keeps as its input
    assert [x.output_bytes for x in profile.layers] == [80, 80, 4 * 3 * F32]
    assert [x.type for x in profile.layers] == ["Linear", "ReLU", "Linear"]
    assert [x.name for x in profile.layers] == ["0", "1", "2"]
    # The shared ReLU output is one storage with two users (its reference count).
    shared = [s for s in profile.saved if s.layer == 1]
    assert len(shared) == 1 and shared[0].users == [1, 2] and shared[0].refs == 2
    layer_storages = sum(s.nbytes for s in profile.saved if s.layer is not None)
    assert layer_storages == 96 + 80  # counted once, not once per layer
    assert profile.loss_saved_bytes > 0  # cross entropy keeps its log-probabilities


def test_parameter_gradient_and_adam_state_bytes_are_exact() -> None:
    layers, profile = mlp_profile()
    for layer, measured in zip(layers, profile.layers):
        params = list(layer.parameters())
        nbytes = sum(p.numel() * F32 for p in params)
        assert measured.param_bytes == measured.grad_bytes == nbytes
        # Adam: exp_avg and exp_avg_sq per parameter, plus its step (a float32 scalar).
        assert measured.optimizer_bytes == 2 * nbytes + F32 * len(params)
    assert profile.param_bytes == (30 + 5 + 15 + 3) * F32


def test_saved_tensors_live_from_their_forward_to_their_backward_in_reverse_order() -> None:
    _, profile = mlp_profile()
    timeline = profile.timeline
    mine = [s for s in profile.saved if s.layer is not None]
    for saved in mine:
        assert (timeline[saved.created].phase, timeline[saved.created].layer) == (
            "forward",
            saved.layer,
        )
        assert saved.released is not None and saved.released_s is not None
        released = timeline[saved.released]
        assert (released.phase, released.layer) == ("backward", saved.layer)
        assert saved.created_s < saved.released_s
    created = [s.created for s in mine]
    released = [s.released for s in mine]
    assert created == sorted(created) and released == sorted(released, reverse=True)
    assert [s.layer for s in mine] == [0, 1]  # forward order
    for k, event in enumerate(timeline):  # activations: exactly the storages alive then
        alive = [s.nbytes for s in profile.saved if s.created <= k < (s.released or k + 1)]
        assert event.activations == sum(alive)


def test_timeline_covers_one_step_and_its_peak_holds_the_model_state() -> None:
    _, profile = mlp_profile()
    steps = [(e.phase, e.layer) for e in profile.timeline]
    assert steps == [
        ("start", None), ("forward", 0), ("forward", 1), ("forward", 2), ("forward", None),
        ("backward", None), ("backward", 2), ("backward", 1), ("backward", 0),
        ("optimizer", None),
    ]  # fmt: skip
    start, end = profile.timeline[0], profile.timeline[-1]
    assert start.gradients == 0 and start.activations == 0
    optimizer = sum(x.optimizer_bytes for x in profile.layers)
    assert start.optimizer == end.optimizer == optimizer  # the last step: steady state
    assert end.activations == 0 and end.gradients == profile.param_bytes
    peak = profile.peak
    assert peak.total == max(e.total for e in profile.timeline)
    assert peak.total >= profile.param_bytes + optimizer
    assert peak.phase in ("forward", "backward")
    assert profile.describe_event(profile.timeline[1]) == "forward of layer 0 (Linear)"


def test_times_are_positive_medians_after_the_warm_up() -> None:
    _, profile = mlp_profile(steps=3)
    assert (profile.steps, profile.warmup) == (3, 1)
    assert all(x.forward_s > 0 and x.backward_s > 0 for x in profile.layers)
    assert profile.loss_forward_s > 0 and profile.optimizer_s > 0


def test_a_cnn_counts_pooling_indices_and_excludes_weights() -> None:
    torch.manual_seed(0)
    layers = [nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
              nn.Linear(8, 3)]  # fmt: skip
    profile = profile_model(layers, loss_fn, ADAM, batches((4, 1, 4, 4), 3), "cpu")
    conv, relu, pool, flat, linear = profile.layers
    assert conv.saved_bytes == 4 * 1 * 4 * 4 * F32  # its input; the weight is a parameter
    assert relu.saved_bytes == 4 * 2 * 4 * 4 * F32
    assert pool.saved_bytes == 4 * 2 * 4 * 4 * F32 + 4 * 2 * 2 * 2 * 8  # input + int64 indices
    assert flat.saved_bytes == 0 and flat.output_bytes == 4 * 8 * F32
    assert linear.saved_bytes == 4 * 8 * F32  # the pooled output (Flatten's view of it)
    assert conv.optimizer_bytes == 2 * (18 + 2) * F32 + 2 * F32


def test_frozen_front_layers_have_no_backward() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)]
    layers[0].requires_grad_(False)
    profile = profile_model(layers, loss_fn, ADAM, batches((4, 6), 3), "cpu")
    first, relu, last = profile.layers
    assert first.grad_bytes == first.optimizer_bytes == 0 and first.saved_bytes == 0
    assert first.backward_s == relu.backward_s == 0.0 and last.backward_s > 0
    assert [e.layer for e in profile.timeline if e.phase == "backward"] == [None, 2]


def test_profile_round_trips_through_json(tmp_path: Path) -> None:
    _, profile = mlp_profile()
    path = tmp_path / "profile.json"
    profile.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == 1 and data["peak"]["bytes"] == profile.peak.total
    assert MemoryProfile.load(path) == profile
    costs = profile.layer_costs()  # the pipeline split's input
    assert [c.param_bytes for c in costs] == [x.param_bytes for x in profile.layers]
    assert costs[0].seconds == profile.layers[0].forward_s + profile.layers[0].backward_s
    (tmp_path / "bad.json").write_text('{"format": 1}')
    with pytest.raises(DataError, match="bad.json: memory profile: malformed"):
        MemoryProfile.load(tmp_path / "bad.json")


def test_without_a_loss_or_an_optimizer_the_layers_are_left_as_they_were() -> None:
    """The pipeline split's use (parallel/split.py): inputs only, backward from a gradient of
    ones, no optimizer step; the weights unchanged and no gradient left behind."""
    torch.manual_seed(0)
    layers = [nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)]
    before = [p.detach().clone() for layer in layers for p in layer.parameters()]
    inputs = [(torch.randn(4, 6), None)] * 3
    profile = profile_model(layers, None, None, inputs, "cpu", measure_peak=False)
    after = [p for layer in layers for p in layer.parameters()]
    assert all(torch.equal(a, b) and a.grad is None for a, b in zip(after, before))
    assert profile.measured_peak_bytes is None and profile.optimizer_s == 0.0
    assert "optimizer" not in [e.phase for e in profile.timeline]
    assert all(x.backward_s > 0 for x in profile.layers)
    costs = profile.layer_costs(input_bytes=4 * 6 * F32)
    assert [c.input_bytes for c in costs] == [4 * 6 * F32, 80, 80]
    assert [c.grad_bytes for c in costs] == [(35 * F32,), (), (18 * F32,)]
    with pytest.raises(ConfigError, match=r"needs \(inputs, targets\) batches"):
        profile_model(layers, loss_fn, None, inputs, "cpu")


def test_a_layer_that_fails_on_its_input_is_named() -> None:
    layers = [nn.Linear(6, 5), nn.Linear(4, 3)]
    with pytest.raises(PhalanxError, match=r"layer 1 \(Linear\) failed on input \(4, 5\)"):
        profile_model(layers, loss_fn, ADAM, batches((4, 6), 3, steps=1), "cpu")
    with pytest.raises(PhalanxError, match=r"the loss failed on output \(4, 5\) and target"):
        profile_model(layers[:1], loss_fn, ADAM, batches((4, 6), 9, steps=1), "cpu")


# -- the command ---------------------------------------------------------------------------------
def run_main(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code


def test_command_prints_the_table_and_writes_json_and_png(tmp_path: Path, capsys) -> None:
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    argv = ["profile", EXAMPLE, "--steps", "2", "--json", str(tmp_path / "p.json")]
    if has_matplotlib:
        argv += ["--plot", str(tmp_path / "memory.png")]
    assert run_main(argv) == 0
    out = capsys.readouterr().out
    assert "fwd ms" in out and "saved MiB" in out and "optim MiB" in out
    assert "6      Linear" in out and "\npeak " in out and "MiB after " in out
    profile = MemoryProfile.load(tmp_path / "p.json")
    assert len(profile.layers) == 10 and profile.steps == 2 and profile.batch_size == 32
    assert profile.layers[4].type == "MaxPool2d"
    assert profile.layers[0].saved_bytes == 32 * 1 * 8 * 8 * F32  # one batch, not the data set
    if has_matplotlib:
        png = (tmp_path / "memory.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["profile", EXAMPLE, "--set", "optimizer.lr=-1"], "optimizer.lr: must be finite"),
        (["profile", EXAMPLE, "--steps", "0"], "--steps: must be >= 1"),
        (["profile", "missing.toml"], "missing.toml"),
        (["profile", EXAMPLE, "--set", "model.layers=[{type='linear', in_features=3, "
                                        "out_features=2}]"], "layer 0 (Linear) failed on input"),
    ],
)  # fmt: skip
def test_command_errors_are_one_line_with_exit_2(argv: list[str], fragment: str, capsys) -> None:
    assert run_main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("phalanx: error: ") and fragment in lines[0]
    assert "Traceback" not in err


@pytest.mark.slow  # spawns processes or trains for real: not in make test-fast
def test_the_examples_in_docs_memory_md_run(capsys) -> None:
    """Every Python block of docs/memory.md, as a reader would paste it: the profile, a budget
    from Python, the optimizer in the tier."""
    text = (ROOT / "docs" / "memory.md").read_text()
    blocks = [part.split("```", 1)[0] for part in text.split("```python\n")[1:]]
    assert len(blocks) >= 3
    for code in blocks:
        exec(compile(code, "docs/memory.md", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert "\npeak " in out  # the profile's table
    assert "memory plan: predicted peak" in out and "MiB above the start" in out  # the budget


class _Scratch(nn.Module):
    """A layer whose forward allocates an 8 MiB temporary it frees before returning (as a
    kernel's workspace is): nothing autograd saves, so the accounting cannot see it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = torch.ones(2 * 2**20)  # 8 MiB of fp32
        return x + scratch.sum() * 0


def test_the_cpu_allocator_peak_sees_a_workspace_the_accounting_does_not() -> None:
    torch.manual_seed(0)
    plain = profile_model([nn.Linear(6, 5), nn.ReLU()], loss_fn, ADAM, batches((4, 6), 5), "cpu")
    layers = [nn.Linear(6, 5), _Scratch(), nn.ReLU()]
    profile = profile_model(layers, loss_fn, ADAM, batches((4, 6), 5), "cpu")
    assert plain.measured_peak_bytes is not None and profile.measured_peak_bytes is not None
    assert plain.measured_peak_bytes - plain.peak.total < 2**20  # a small MLP: little unseen
    unseen = profile.measured_peak_bytes - profile.peak.total
    assert abs(unseen - 8 * 2**20) < 2**16, unseen
    # a plan holds the unseen bytes in every peak
    from phalanx.memory.manager import MemoryConfig, MemoryManager

    sample = batches((4, 6), 5, steps=1)[0]
    manager = MemoryManager.build(
        layers, MemoryConfig(budget_mb=64), torch.device("cpu"), sample, loss_fn, ADAM
    )
    # (the plan's peaks are above the start, which holds the parameters)
    # (the plan measures the resident set, page-granular: within 1 MiB of the allocator's count)
    assert manager.plan.unmanaged_peak >= profile.measured_peak_bytes - profile.param_bytes - 2**20
    # measured as the budget is (the resident peak, less the accounted bytes): 8 MiB, +- pages
    found = re.search(r"beyond the saved tensors: ([0-9.]+) MiB", manager.describe())
    assert found is not None and 7.5 <= float(found.group(1)) <= 9.0, manager.describe()
    manager.close()


def test_under_a_running_profiler_the_allocator_peak_is_not_measured() -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        _, profile = mlp_profile()
    assert profile.measured_peak_bytes is None


def test_until_ends_the_profile_with_one_traced_step_after_it_says_so() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)]
    seen: list[int] = []

    def until(step_s: list[float]) -> bool:
        seen.append(len(step_s))
        return len(step_s) >= 3

    profile = profile_model(layers, loss_fn, ADAM, batches((4, 6), 3, 20), "cpu", until=until)
    # 1 warm-up, 3 timed, then the traced last step (under the allocator profiler: not timed)
    assert (profile.steps, profile.warmup, len(profile.step_s)) == (5, 1, 3)
    assert seen == [1, 2, 3]


def test_the_spread_is_the_iqr_over_the_median_and_a_wide_one_warns() -> None:
    _, profile = mlp_profile(steps=3)
    steady = replace(profile, step_s=[1.0, 1.0, 1.01, 0.99, 1.0, 1.0])
    assert steady.spread is not None and steady.spread < 0.05
    assert "warning" not in spread_line(steady) and "spread (IQR)" in spread_line(steady)
    wide = replace(profile, step_s=[1.0, 1.0, 1.5, 1.5, 0.7, 0.7])
    assert wide.spread is not None and wide.spread > 0.10
    assert "\nwarning: the steps' spread is" in spread_line(wide)
    assert replace(profile, step_s=[1.0, 2.0]).spread is None  # too few for quartiles
    assert "spread not known" in spread_line(replace(profile, step_s=[1.0]))
    assert MemoryProfile.from_dict(wide.to_dict()).step_s == wide.step_s


def test_the_auto_profile_stops_at_its_bounds_and_reads_the_run_s_pipeline(monkeypatch) -> None:
    from phalanx import build
    from phalanx.config import load_config

    monkeypatch.setattr(build, "MIN_TIMED", 4)
    monkeypatch.setattr(build, "SPREAD_TARGET", float("inf"))  # stable from the 4th on
    config = load_config(EXAMPLE, ["runtime.threads=1"])
    profile = build.profile_run(config)
    assert (profile.warmup, len(profile.step_s), profile.steps) == (build.AUTO_WARMUP, 4, 7)
    assert profile.input_wait_s > 0  # batches came through the input pipeline's next()
    assert torch.get_num_threads() == 1  # as phalanx.init sets a worker's
    monkeypatch.setattr(build, "MAX_TIMED", 3)
    monkeypatch.setattr(build, "SPREAD_TARGET", 0.0)  # never stable: the cap ends it
    assert len(build.profile_run(config).step_s) == 3
