"""No optional part of a run can fail it (issue 46; docs/reliability.md, "Optional steps"): the
prediction, the probes of a calibration, bucket_mb = "auto"'s link, the host cache's build,
TensorBoard, the trace and background checkpoints each fall back to a stated value with one
warning line and the run goes on; torch's own warnings during phalanx's set-up never come
before a one-line error. Every failure here is simulated (a probe, build or writer replaced by
one that raises), never by loading the machine."""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from phalanx.fileio import CACHE_ENV
from phalanx.planner import calibrate
from phalanx.planner.step import StepProfile
from tests.helpers.cli import assert_one_line_error, run_main
from tests.unit.test_planner_calibrate import LINK

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "digits_cnn.toml")
SHORT = ["--set", "train.steps=4", "--set", "train.progress=false"]
TOO_LATE = RuntimeError("the probe's processes started too late for every window")
MEASURE = calibrate.calibrate_machine  # the real one, before the fixture replaces it


def warned(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warning lines logged since the last call (on a terminal: stderr), each checked to be
    phalanx's one line."""
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    assert all(line.startswith("phalanx: warning: ") and "\n" not in line for line in lines)
    return lines


def run_warned(argv: list[str], capsys: Any, caplog: pytest.LogCaptureFixture) -> tuple[str, str]:
    """``phalanx ARGV`` run to exit 0 with one warning line, nothing on stderr (no traceback):
    (its stdout, the line)."""
    assert run_main(argv) == 0
    out, err = capsys.readouterr()
    assert not err.strip()
    (line,) = warned(caplog)
    return out, line


def fails(error: BaseException) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        raise error

    return run


def fake_calibration(slowdown: Any = lambda cores: (1.0, 1.3)) -> Any:
    return MEASURE(lambda: LINK, lambda: 2e-10, lambda: 5e-11, slowdown,
                                       lambda alpha: 1e-3, lambda: 6e-4)  # fmt: skip


@pytest.fixture
def this_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A calibration of fixed numbers on 4 cores (so that the slow-down is probed) cached in
    tmp_path, and a synthetic step profile: nothing measures this machine."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(calibrate, "host_cores", lambda: 4)
    monkeypatch.setattr(calibrate, "calibrate_machine", fake_calibration)
    step = StepProfile.synthesize(samples_per_s=4000, batch_size=32, layer_params=[1000, 5000])
    from phalanx.commands import auto_plan, plan

    for module in (auto_plan, plan):
        monkeypatch.setattr(module, "measure_step_profile", lambda *a, **k: step)


@pytest.fixture
def loaded_machine(this_machine: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compute slow-down probe cannot measure (its processes start too late)."""
    monkeypatch.setattr(calibrate, "measure_compute_slowdown", fails(TOO_LATE))


def test_a_probe_that_cannot_measure_is_a_stated_value_in_one_line(
    caplog: pytest.LogCaptureFixture,
    this_machine: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.setattr(calibrate, "measure_compute_slowdown", fails(TOO_LATE))
    cluster = MEASURE(lambda: LINK, lambda: 2e-10, lambda: 5e-11, fails(TOO_LATE),
                      fails(TimeoutError("120 s")), lambda: 6e-4)  # fmt: skip
    assert cluster.compute_slowdown == (1.0,) and cluster.collective_call_s == 0.0
    assert cluster.collective_call_cpu_s == 6e-4
    notes = [n for n in cluster.assumed if n != calibrate.INTER_NOTE]
    assert notes == [
        "compute_slowdown: not measured (RuntimeError: the probe's processes started too late "
        "for every window): 1.0 assumed; phalanx plan CONFIG --recalibrate measures again",
        "collective_call_s: not measured (TimeoutError: 120 s): 0 assumed; phalanx plan CONFIG "
        "--recalibrate measures again",
    ]
    assert warned(caplog) == [f"phalanx: warning: {n}" for n in notes]
    # the probe phalanx plan and --predict run beside the profile keeps the cached factor
    cached = fake_calibration()
    now = calibrate.slowdown_now(cached, say=print)
    assert now.compute_slowdown == cached.compute_slowdown == (1.0, 1.3)
    (line,) = warned(caplog)
    assert line.startswith("phalanx: warning: compute slow-down not probed now (RuntimeError: ")
    assert "the calibration's 1.30 at 2 ranks used instead; phalanx plan CONFIG probes" in line
    assert now.assumed[-1] == f"compute_slowdown: {line.removeprefix('phalanx: warning: ')}"


def test_plan_says_the_stated_slowdown_in_its_output_and_json(
    loaded_machine: None, tmp_path: Path, capsys: Any, caplog: pytest.LogCaptureFixture
) -> None:
    plan_json = tmp_path / "plan.json"
    argv = ["plan", CONFIG, "--strategies", "allreduce", "--compress", "none", "--thresholds",
            "25", "--devices", "1,2", "--json", str(plan_json)]  # fmt: skip
    out, line = run_warned(argv, capsys, caplog)
    note = line.removeprefix("phalanx: warning: ")
    assert f"assumed (not measured): compute_slowdown: {note}" in out
    assert f"compute_slowdown: {note}" in json.loads(plan_json.read_text())["cluster"]["assumed"]


def test_predict_survives_a_slowdown_probe_on_a_loaded_machine(
    loaded_machine: None, tmp_path: Path, capsys: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The failure of issue 46: the probe's RuntimeError killed ``phalanx train --predict``."""
    run_dir = tmp_path / "run"
    argv = ["train", CONFIG, "--predict", "--run-dir", str(run_dir), *SHORT]
    out, line = run_warned(argv, capsys, caplog)
    assert "compute slow-down not probed now" in line and "predict: " in out
    assert json.loads((run_dir / "summary.json").read_text())["predicted_step_s"] > 0


@pytest.mark.parametrize("flag", ["--predict", "--auto-plan"])
def test_a_prediction_that_cannot_be_made_leaves_the_run_as_configured(
    caplog: pytest.LogCaptureFixture,
    flag: str,
    this_machine: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys,
) -> None:
    monkeypatch.setattr(calibrate, "calibrate_machine", fails(OSError("link bench failed")))
    run_dir = tmp_path / "run"
    argv = ["train", CONFIG, flag, "--run-dir", str(run_dir), "--set",
            "exchange.strategy=tree", *SHORT]  # fmt: skip
    assert run_main(argv) == 0
    (line,) = warned(caplog)
    assert f"{flag}: no " in line and "(OSError: link bench failed)" in line
    assert "phalanx plan CONFIG shows" in line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "predicted_step_s" not in summary and not (run_dir / "prediction.json").exists()
    config = json.loads((run_dir / "config.json").read_text())
    assert config["exchange"]["strategy"] == "tree"  # the config's own setup


def test_auto_threshold_without_a_link_keeps_the_default_buckets(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    from phalanx.engine import auto_bucketing

    monkeypatch.setattr(auto_bucketing, "calibrate", fails(RuntimeError("Gloo timed out")))
    run_dir = tmp_path / "run"
    argv = ["train", CONFIG, "--run-dir", str(run_dir), "--set", 'exchange.bucket_mb="auto"',
            *SHORT]  # fmt: skip
    assert run_main(argv) == 0
    (line,) = warned(caplog)
    assert 'bucket_mb = "auto": the link not measured (RuntimeError: Gloo timed out)' in line
    assert "25 MiB buckets kept" in line and not (run_dir / "threshold.json").exists()


def test_the_host_cache_that_cannot_be_built_is_one_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from phalanx.memory import host_cache
    from phalanx.optional import torch_quiet

    with torch_quiet():  # as host_cache imports it: a CUDA build without a GPU logs a line
        import torch.utils.cpp_extension as cpp_extension

    no_ninja = fails(RuntimeError("Ninja is required to load C++ extensions"))
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", no_ninja)
    monkeypatch.setattr(host_cache, "_problem", host_cache._problem)  # put back after
    host_cache.library.cache_clear()
    try:
        problem = host_cache.install(1 << 40)
        assert host_cache.install(1 << 40) == problem  # built once: warned once
    finally:
        host_cache.library.cache_clear()
    (line,) = warned(caplog)
    assert line == f"phalanx: warning: {problem}"
    assert problem.startswith("host cache not built (RuntimeError: Ninja is required")
    assert "freed host memory goes back to the OS" in problem


def test_tensorboard_that_cannot_write_leaves_metrics_jsonl(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    from phalanx import metrics as viz

    class Broken:
        def add_scalar(self, *args: Any) -> None:
            raise OSError(28, "No space left on device")

    missing = fails(ModuleNotFoundError("No module named 'tensorboard'"))
    cases = [(missing, "No module named 'tensorboard'"), (lambda d: Broken(), "No space left")]
    for n, (writer, why) in enumerate(cases):
        monkeypatch.setattr(viz, "_summary_writer", writer)
        run_dir = tmp_path / f"run{n}"
        argv = ["train", CONFIG, "--run-dir", str(run_dir), "--set", "log.tensorboard=true"]
        assert run_main([*argv, *SHORT]) == 0
        (line,) = warned(caplog)  # once, not once a step
        assert line.startswith("phalanx: warning: TensorBoard scalars not written (")
        assert why in line
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 4


def test_a_trace_that_cannot_be_written_is_one_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    from phalanx.engine import tracing

    monkeypatch.setattr(tracing, "write_trace", fails(PermissionError(13, "Permission denied")))
    run_dir = tmp_path / "run"
    argv = ["train", CONFIG, "--run-dir", str(run_dir), "--trace", str(tmp_path / "trace")]
    out, line = run_warned([*argv, *SHORT], capsys, caplog)
    assert "trace not written to" in line and "Permission denied" in line
    assert "trace of steps" not in out and (run_dir / "summary.json").is_file()


def test_a_failed_background_checkpoint_falls_back_to_the_foreground(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    from phalanx import checkpoint

    started: list[int] = []

    def save_async(directory: Path, step: int, *args: Any, **kwargs: Any) -> Any:
        started.append(step)
        return checkpoint.PendingSave(fails(OSError(28, "No space left on device")))

    monkeypatch.setattr(checkpoint, "save_async", save_async)
    run_dir = tmp_path / "run"
    sets = ["checkpoint.every=1", "checkpoint.async_save=true", "checkpoint.keep=5"]
    argv = ["train", CONFIG, "--run-dir", str(run_dir), *[f"--set={s}" for s in sets], *SHORT]
    assert run_main(argv) == 0
    (line,) = warned(caplog)
    assert "a background checkpoint not written" in line and "No space left" in line
    assert started == [1]  # then in the foreground: steps 2, 3 and the last, 4
    assert checkpoint.latest_step(run_dir / "checkpoints") == 4


def test_torch_warnings_during_set_up_do_not_precede_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    """A CUDA build of torch on a CPU-only machine logs "No CUDA runtime is found" when the host
    cache's build imports cpp_extension; emulated here (that warning logged, and a warning
    from distributed init) with torch's logger printing to this test's stderr."""
    import torch.distributed as dist
    import torch.utils.cpp_extension as cpp_extension

    from phalanx.memory import host_cache
    from phalanx.runtime import context

    torch_log = logging.getLogger("torch.utils.cpp_extension")
    handler = logging.StreamHandler(sys.stderr)  # torch's own handler, as a user's stderr sees
    level = logging.getLogger("torch").level
    dist_log = logging.getLogger("torch.distributed.distributed_c10d")  # does not propagate
    printing = [logging.getLogger("torch"), dist_log]
    for logger in printing:
        logger.addHandler(handler)
    verify, init = cpp_extension.verify_ninja_availability, dist.init_process_group

    def verify_on_a_cuda_build() -> None:
        torch_log.warning("No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'")
        warnings.warn("a torch UserWarning", UserWarning, stacklevel=1)
        verify()

    def init_with_a_warning(*args: Any, **kwargs: Any) -> None:
        dist_log.warning("a set-up warning")
        init(*args, **kwargs)

    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", verify_on_a_cuda_build)
    monkeypatch.setattr(context.dist, "init_process_group", init_with_a_warning)
    monkeypatch.setattr(host_cache, "_problem", host_cache._problem)
    host_cache.library.cache_clear()  # built again (cached on disk: quick), through the patch
    try:
        config = tmp_path / "run.toml"
        config.write_text(Path(CONFIG).read_text())
        assert run_main(["train", str(config), "--set", "memory.budget_mb=1"]) == 2
    finally:
        for logger in printing:
            logger.removeHandler(handler)
        host_cache.library.cache_clear()
    assert_one_line_error(capsys.readouterr().err, "memory.budget_mb: 1.0 MiB cannot be met")
    assert logging.getLogger("torch").level == level  # as it was before the set-up
