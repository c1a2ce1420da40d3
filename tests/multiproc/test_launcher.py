"""The launcher end to end: two "nodes" on localhost, torchrun, a failing worker, resume."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from phalanx import checkpoint
from phalanx.errors import WorkerError
from phalanx.runtime.launch import LaunchSpec, free_port, launch

ROOT = Path(__file__).resolve().parents[2]
PHALANX = [sys.executable, "-m", "phalanx"]

# The digits CNN without dropout, so ranks' random streams cannot make runs differ.
NO_DROPOUT = ROOT / "tests" / "multiproc" / "digits_no_dropout.toml"


def _run(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def _final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(run_dir / "checkpoints")["trainer"]["engine"]["model"]


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_two_nodes_on_localhost_train_one_model(tmp_path: Path) -> None:
    """Two launcher invocations (--nnodes 2, one process each) equal one process with the
    global batch; the same entry point under torchrun gives the same result too."""
    common = ["train", str(NO_DROPOUT), "--set", "train.steps=8", "--set", "data.batch_size=16"]
    port = free_port()
    nodes = [
        subprocess.Popen(
            [*PHALANX, *common, "--run-dir", str(tmp_path / "two_nodes"), "--nnodes", "2",
             "--node-rank", str(rank), "--master-port", str(port), "--nproc", "1"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in (0, 1)
    ]  # fmt: skip
    outputs = [node.communicate(timeout=180) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err
    summary = json.loads((tmp_path / "two_nodes" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch"] == 32
    assert "final validation accuracy" in outputs[0][0]

    single = [*PHALANX, "train", str(NO_DROPOUT), "--set", "train.steps=8"]
    single += ["--set", "data.batch_size=32", "--run-dir", str(tmp_path / "single")]
    assert _run(single).returncode == 0
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-port", str(free_port()), "-m", "phalanx", *common]
    torchrun += ["--run-dir", str(tmp_path / "torchrun")]
    done = _run(torchrun)
    assert done.returncode == 0, done.stderr

    reference = _final_params(tmp_path / "single")
    for run in ("two_nodes", "torchrun"):
        params = _final_params(tmp_path / run)
        for name, value in reference.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=run)
    assert _losses(tmp_path / "two_nodes") == pytest.approx(_losses(tmp_path / "single"), 1e-5)


def test_failing_worker_is_reported_and_the_others_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = str(ROOT / "tests" / "multiproc" / "scripts" / "fail_on_rank1.py")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    started = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 failed: RuntimeError: injected failure"):
        launch(LaunchSpec(nproc=2), [script])
    assert time.monotonic() - started < 60  # rank 0 was stopped, not left in its barrier
    assert list(tmp_path.iterdir()) == []  # the agent's error files were read, then removed


def test_resume_continues_exactly(tmp_path: Path) -> None:
    """Losses after --resume equal the uninterrupted run's, with dropout (RNG state restored),
    a learning-rate schedule with warm-up (its state restored) and on 2 processes."""
    config = str(ROOT / "configs" / "digits_cnn.toml")
    base = [*PHALANX, "train", config, "--nproc", "2", "--set", "checkpoint.every=5"]
    base += ["--set", "scheduler.name=step", "--set", "scheduler.step_size=2",
             "--set", "scheduler.gamma=0.7", "--set", "scheduler.warmup_steps=3"]  # fmt: skip
    full, part = tmp_path / "full", tmp_path / "part"
    assert _run([*base, "--set", "train.steps=12", "--run-dir", str(full)]).returncode == 0
    assert _run([*base, "--set", "train.steps=5", "--run-dir", str(part)]).returncode == 0
    resumed = _run([*PHALANX, "train", "--resume", str(part), "--nproc", "2",
                    "--set", "train.steps=12"])  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert len(_losses(part)) == 12
    assert _losses(part) == _losses(full)  # exact, not approximate
    rates = [json.loads(line)["lr"] for line in (part / "metrics.jsonl").read_text().splitlines()]
    assert rates[:4] == pytest.approx([0.0005, 0.0170, 0.0335, 0.05], rel=1e-3)  # warm-up
    assert rates[4:8] == pytest.approx([0.05, 0.035, 0.035, 0.0245])  # then x0.7 every 2 steps


def test_demo_config_reaches_95_percent_on_two_workers(tmp_path: Path) -> None:
    """What `make demo` runs: configs/digits_cnn.toml on 2 workers, >= 95% validation."""
    run_dir = tmp_path / "demo"
    done = _run([*PHALANX, "train", str(ROOT / "configs" / "digits_cnn.toml"), "--nproc", "2",
                 "--run-dir", str(run_dir)])  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["val_accuracy"] >= 0.95
    assert f"run directory {run_dir}" in done.stdout
