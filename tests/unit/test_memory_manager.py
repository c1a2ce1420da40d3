"""``[memory]`` in a real run: the planned offload and recomputation train the same model as the
unmanaged run, bit for bit; the plan is printed; bad layer names and budgets are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import assert_one_line_error, metrics, run_main

CONFIG = """
[model]
name = "digits_cnn"
options = { channels = 32, hidden = 64, dropout = 0.1 }
[data]
source = "digits"
batch_size = 128
[train]
steps = 3
progress = false
[optimizer]
name = "adam"
lr = 0.001
"""


def train(tmp_path: Path, name: str, *sets: str) -> tuple[list[float], float]:
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    run_dir = tmp_path / name
    args = ["train", str(config), "--run-dir", str(run_dir)]
    for item in sets:
        args += ["--set", item]
    assert run_main(args) == 0
    records = metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    return [r["loss"] for r in records], summary["val_loss"]


def test_managed_runs_equal_the_unmanaged_run(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    unmanaged = train(tmp_path, "none")
    offloaded = train(tmp_path, "offload", 'memory.offload=["1", "2", "7"]')
    recomputed = train(tmp_path, "recompute", 'memory.recompute=["4", "8"]')  # 8: dropout
    budgeted = train(tmp_path, "budget", "memory.budget_mb=120", "train.progress=true")
    host = train(
        tmp_path,
        "host",
        'memory.optimizer="host"',
        "memory.optimizer_chunk_mb=0.05",
        "train.progress=true",
    )
    mirror = train(tmp_path, "mirror", 'memory.optimizer="mirror"', "train.progress=true")
    assert offloaded == unmanaged and recomputed == unmanaged and budgeted == unmanaged
    assert host == unmanaged and mirror == unmanaged
    printed = "".join(capsys.readouterr())
    assert "optimizer: fp32 master parameters, state and arithmetic on the host" in printed
    assert "memory plan: predicted peak" in printed and "budget 120.0 MiB" in printed
    assert "fault their pages in again: not in the predicted overhead" in printed  # CPU
    assert "optimizer state: in the tier between steps, streamed in chunks of 0.05 MiB" in printed


def test_bad_memory_options_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    assert run_main(["train", str(config), "--set", 'memory.offload=["conv9"]']) == 2
    assert_one_line_error(capsys.readouterr().err, "memory.offload: unknown layer 'conv9'")
    assert run_main(["train", str(config), "--set", "memory.budget_mb=1"]) == 2
    assert_one_line_error(capsys.readouterr().err, "memory.budget_mb: 1.0 MiB cannot be met")
    assert run_main(["train", str(config), "--set", "memory.budget_mb=-1"]) == 2
    assert_one_line_error(capsys.readouterr().err, "memory.budget_mb: must be >= 0")
    assert run_main(["train", str(config), "--set", 'memory.optimizer="cpu"']) == 2
    assert_one_line_error(capsys.readouterr().err, "memory.optimizer: got 'cpu'; allowed: device")
    assert run_main(["train", str(config), "--set", "memory.optimizer_chunk_mb=0"]) == 2
    assert_one_line_error(capsys.readouterr().err, "memory.optimizer_chunk_mb: must be > 0")
    assert run_main(["train", str(config), "--set", "trace.num_steps=0"]) == 2
    assert_one_line_error(capsys.readouterr().err, "trace.num_steps: must be >= 1")


def test_a_plan_under_fsdp_counts_this_ranks_share_of_gradients_and_state() -> None:
    """Sharded over 2 ranks, each keeps half the gradients and Adam's state, plus the largest
    layer's gathered parameters and whole gradient (3 x 9 MiB): the plan holds that much less."""
    import torch
    from torch import nn

    from phalanx.memory.manager import MemoryConfig, MemoryManager

    torch.manual_seed(0)
    layers = [nn.Linear(1536, 1536) for _ in range(4)]  # 9 MiB of parameters each
    sample = (torch.randn(2, 1536), torch.randn(2, 1536))
    config = MemoryConfig(budget_mb=4096)
    plans = [
        MemoryManager.build(
            layers,
            config,
            torch.device("cpu"),
            sample,
            nn.functional.mse_loss,
            lambda ps: torch.optim.Adam(ps),
            shards=shards,
        )  # fmt: skip
        for shards in (1, 2, 1)  # the first grows the process for good (libraries, caches)
    ][1:]
    params = sum(p.numel() * 4 for layer in layers for p in layer.parameters())
    largest = params // 4
    saved = (params + 2 * params) // 2 - 3 * largest  # half of gradients + state, less 3 layers
    sharded, whole = (m.plan.unmanaged_peak for m in plans)
    assert abs((whole - sharded) - saved) < 4 * 2**20, (whole, sharded, saved)
    assert any("sharded over 2 ranks" in note for note in plans[0].plan.notes)
    for manager in plans:
        manager.close()
