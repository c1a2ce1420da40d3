"""A user's plain script (no sync, no close) exits 0, leaves nothing behind and saves the same
parameters as one process would, for every strategy, with compression and bucket_mb = "auto",
with an LR scheduler attached to ``engine.optimizer`` (it must act on every step)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.faults.procs import ROOT, start_ranks, wait_all, wait_gone

SCRIPTS = ROOT / "tests" / "faults" / "scripts"
sys.path.insert(0, str(SCRIPTS))
from plain_model import STEPS, build_model, global_batch  # noqa: E402

STRATEGIES = ["allreduce", "tree", "partitioned", "ps"]
EXACT = [f"{s}:none:25" for s in STRATEGIES] + ["ddp:none:25"]  # DDP alongside, as users do
EXACT += ["allreduce:none:25:host", "ps:none:25:host"]  # optimizer state in the spill file
EXACT += ["allreduce:none:25:mirror", "partitioned:none:25:mirror"]  # the host mirror (F19)
VARIANTS = [f"{s}:fp16:auto" for s in STRATEGIES] + ["partitioned:none:0.001"]


def reference() -> tuple[dict[str, torch.Tensor], float]:
    """One process, the global batch, the same optimizer and schedule."""
    torch.manual_seed(0)
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for step in range(STEPS):
        x, y = global_batch(step)
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        scheduler.step()
    return model.state_dict(), optimizer.param_groups[0]["lr"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_plain_script_exits_cleanly_with_current_weights(tmp_path: Path, world_size: int) -> None:
    specs = EXACT + (VARIANTS if world_size < 4 else [])  # 4 ranks on 2 cores: keep it short
    procs = start_ranks([str(SCRIPTS / "plain_user.py"), str(tmp_path), *specs], world_size)
    results = wait_all(procs, timeout=200)
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{err[-3000:]}"
        assert "terminate called" not in err
        assert "teardown at shutdown failed" not in err, err[-3000:]
        left = json.loads((tmp_path / f"exit-rank{rank}.json").read_text())
        assert left == {"process_group": False, "threads": []}, left
    assert wait_gone(str(tmp_path)) == []
    expected, expected_lr = reference()
    for spec in specs:
        tolerance = 1e-5 if ":none:" in spec else 2e-3  # fp16 messages round the gradients
        for rank in range(world_size):
            saved = torch.load(tmp_path / f"{spec.replace(':', '_')}-rank{rank}.pt")
            assert saved["lr"] == pytest.approx(expected_lr), (spec, rank)
            for name, value in expected.items():
                torch.testing.assert_close(
                    saved["state"][name], value, atol=tolerance, rtol=0,
                    msg=lambda m, s=spec, r=rank, n=name: f"{s} rank {r} {n}: {m}",
                )  # fmt: skip
