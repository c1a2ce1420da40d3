"""`phalanx train` under faults: kill -9 at three points of a step, Ctrl-C, a scheduler's
SIGTERM, a restart after a worker dies, a corrupt newest checkpoint. Every run is bounded by a
timeout and must leave no process behind (each run's directory is on its workers' command
lines, so it finds them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.procs import ROOT, wait_gone

CONFIG = str(ROOT / "tests" / "multiproc" / "digits_no_dropout.toml")
TIMEOUT_S = 20  # runtime.timeout_s of these runs: survivors must stop well within it
STEPS = 12
BASE = ["--nproc", "2", "--set", f"train.steps={STEPS}", "--set", "checkpoint.every=4",
        "--set", "train.progress=false", "--set", f"runtime.timeout_s={TIMEOUT_S}"]  # fmt: skip


def _start(
    run_dir: Path, *extra: str, fault: str = "", log: Path | None = None
) -> subprocess.Popen:
    env = {**os.environ, "PHALANX_FAULT": fault}
    if log is not None:
        env["PHALANX_FAULT_LOG"] = str(log)
    args = [sys.executable, "-m", "phalanx", "train", CONFIG, *BASE, "--run-dir", str(run_dir)]
    return subprocess.Popen(
        [*args, *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def _finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 120) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"phalanx train still running after {timeout} s") from None
    assert wait_gone(str(run_dir)) == [], "worker processes left behind"
    return proc.returncode, err


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def _wait_for_steps(run_dir: Path, steps: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 90
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if path.is_file() and len(path.read_text().splitlines()) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {steps}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The uninterrupted run's per-step losses."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    code, err = _finish(_start(run_dir), run_dir)
    assert code == 0, err
    return _losses(run_dir)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "fault",
    ["kill@forward:step=5:rank=1", "kill@exchange:step=5:rank=1", "kill@checkpoint:step=8:rank=0"],
)
def test_kill_9_names_the_rank_and_the_others_stop(tmp_path: Path, fault: str) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "fault.log"
    code, err = _finish(_start(run_dir, fault=fault, log=log), run_dir)
    ended = time.time()
    killed = fault.rsplit("rank=", 1)[1]
    assert code == 1, err
    assert f"rank {killed} failed: killed — out of memory? (SIGKILL" in err.splitlines()[-1]
    fired = float(log.read_text().split()[0])
    assert ended - fired < TIMEOUT_S + 10  # survivors stopped within the timeout, no hang
    if "checkpoint" in fault:  # the half-written step 8 never counts: step 4 is the newest
        from phalanx import checkpoint

        assert checkpoint.latest_step(run_dir / "checkpoints") == 4
        assert checkpoint.load(run_dir / "checkpoints")["trainer"]["step"] == 4


@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_worker_with_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "--set", "train.steps=100000")
    _wait_for_steps(run_dir, 2, proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    code, err = _finish(proc, run_dir, timeout=30)
    assert time.monotonic() - sent < 10
    assert code == 130
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == ["phalanx: interrupted"], err


@pytest.mark.timeout(240)
def test_sigterm_checkpoints_then_resume_is_exact(tmp_path: Path, reference: list[float]) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    _wait_for_steps(run_dir, 2, proc)
    proc.send_signal(signal.SIGTERM)
    code, err = _finish(proc, run_dir, timeout=60)
    assert code == 143, err
    assert "preempted (SIGTERM): checkpoint at step" in err
    stopped = json.loads((run_dir / "preempted.json").read_text())["steps"]
    assert 2 <= stopped < STEPS
    resumed = subprocess.run(
        [sys.executable, "-m", "phalanx", "train", "--resume", str(run_dir), "--nproc", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert not (run_dir / "preempted.json").exists()
    assert _losses(run_dir) == reference  # exact: the same steps on the same data


@pytest.mark.timeout(240)
def test_restart_after_a_kill_resumes_and_matches(tmp_path: Path, reference: list[float]) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "--max-restarts", "1", fault="kill@forward:step=6:rank=1")
    code, err = _finish(proc, run_dir, timeout=180)
    assert code == 0, err
    assert "phalanx: restart 1 after a worker failed: resuming from step 4" in err
    assert _losses(run_dir) == reference
    # The newest checkpoint corrupted: resume falls back to the one before, with a warning.
    newest = run_dir / "checkpoints" / f"step-{STEPS:07d}" / "__1_0.distcp"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    resumed = subprocess.run(
        [sys.executable, "-m", "phalanx", "train", "--resume", str(run_dir), "--nproc", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from step-0000008" in resumed.stderr
    assert _losses(run_dir) == reference


@pytest.mark.timeout(120)
def test_injected_nan_is_skipped_or_aborts_naming_the_step(tmp_path: Path) -> None:
    fault = "nan@forward:step=5:rank=1"
    run_dir = tmp_path / "skip"
    code, err = _finish(_start(run_dir, fault=fault), run_dir)
    assert code == 0, err
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["nonfinite_skipped"]] == [5]
    assert err.count("step 5: inf/NaN loss or gradients, update skipped") == 1
    assert json.loads((run_dir / "summary.json").read_text())["nonfinite_steps"] == 1
    run_dir = tmp_path / "abort"
    code, err = _finish(_start(run_dir, "--set", "train.nonfinite=abort", fault=fault), run_dir)
    assert code == 1
    assert "step 5: loss or gradients are inf/NaN (nonfinite = 'abort')" in err.splitlines()[-1]
