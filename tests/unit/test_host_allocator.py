"""The host allocator's modes phalanx sets (memory/measure.py): tensors of 2 MiB and more get
transparent huge pages where freed memory goes back to the OS. torch reads that setting once, at
its first block of 2 MiB or more, so each check runs in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not THP.is_file() or "[never]" in THP.read_text(),
    reason="needs Linux with transparent huge pages not disabled",
)
PROBE = (
    "import torch\n"
    "from phalanx.memory import measure\n"
    "{before}\n"
    "print(measure.huge_pages_for_large_tensors(), measure.huge_pages_for_large_tensors())\n"
)


def _probe(before: str = "", **env: str) -> str:
    """A fresh process's answer; the setting is the probe's own unless ``env`` gives it (a
    test before this one may have asked for huge pages in pytest's own process, whose
    environment its children inherit)."""
    code = PROBE.format(before=before)
    inherited = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**inherited, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout.strip()


@pytest.mark.slow  # spawns processes or trains for real: not in make test-fast
@needs_thp
def test_huge_pages_take_only_before_torchs_first_large_block() -> None:
    assert _probe() == "True True"  # the first 2 MiB block: in force, and it stays
    assert _probe("torch.ones(4 << 20, dtype=torch.uint8)") == "False False"  # too late
    # meta-device initialisation makes such a block too: why `phalanx train` reads [memory] first
    assert _probe("torch.empty(3, device='meta').normal_()") == "False False"
    assert _probe(THP_MEM_ALLOC_ENABLE="0") == "False False"  # the user's value is left alone


@pytest.mark.slow  # spawns processes or trains for real: not in make test-fast
@needs_thp
@pytest.mark.timeout(300)
def test_phalanx_train_with_a_budget_backs_large_tensors_with_huge_pages(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(
        '[model]\nlayers = [\n  { type = "gpt_embedding", vocab_size = 97, dim = 64, '
        "max_seq_len = 32 },\n"
        '  { type = "transformer_block", dim = 64, num_heads = 2 },\n'
        '  { type = "linear", in_features = 64, out_features = 97 },\n]\n'
        '[data]\nsource = "text"\nseq_len = 32\nbatch_size = 16\n'
        "[train]\nsteps = 1\nprogress = false\n[checkpoint]\nevery = 0\n"
        "[memory]\nbudget_mb = 4000\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "train", str(config), "--run-dir", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed = done.stdout + done.stderr
    assert "tensors of 2 MiB and more in huge pages" in printed, printed[-2000:]
