"""A real crash in the middle of writing a checkpoint: the process is SIGKILLed while DCP writes
step 2's shard file, and the directory must still resume from step 1, exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from phalanx import checkpoint

# Saves step 1, then starts saving a 200 MB step 2. From then on fsync never returns, so however
# fast the disk, step 2's temporary directory cannot be completed and renamed into place before
# the test kills the process; the kill itself usually lands mid-write, while the file grows.
CHILD = """
import os, sys, threading
from pathlib import Path
import torch
from phalanx import checkpoint

directory = Path(sys.argv[1])
checkpoint.save(directory, 1, {"step": 1, "w": torch.arange(12.0).reshape(3, 4)})
os.fsync = lambda fd: threading.Event().wait()
checkpoint.save(directory, 2, {"step": 2, "w": torch.ones(50_000_000)})
"""

TEMP_GLOB = ".step-0000002.tmp/__0_0.distcp"


def wait_for_temp_file(proc: subprocess.Popen, directory: Path, timeout: float) -> Path:
    """Step 2's temporary file, as soon as it exists; fails if the child exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = next(directory.glob(TEMP_GLOB), None)
        if found is not None:
            return found
        if proc.poll() is not None:
            stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            pytest.fail(f"child exited with {proc.returncode} before writing step 2:\n{stderr}")
        time.sleep(0.001)
    pytest.fail(f"no {TEMP_GLOB} in {directory} after {timeout} s")


@pytest.mark.timeout(60)
def test_sigkill_while_writing_resumes_from_the_previous_checkpoint(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        temp = wait_for_temp_file(proc, tmp_path, timeout=45)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stderr:
            proc.stderr.close()
    assert proc.returncode is not None  # reaped: the child is gone

    assert temp.exists()
    assert not (tmp_path / "step-0000002").exists()
    assert not (tmp_path / "step-0000002.json").exists()
    assert checkpoint.latest_step(tmp_path) == 1
    loaded = checkpoint.load(tmp_path)
    assert loaded.keys() == {"step", "w"} and loaded["step"] == 1
    assert torch.equal(loaded["w"], torch.arange(12.0).reshape(3, 4))

    checkpoint.save(tmp_path, 3, {"step": 3})  # the next save removes the stray temporary files
    assert not temp.parent.exists()
    assert checkpoint.load(tmp_path) == {"step": 3}
