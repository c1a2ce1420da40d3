"""Start a user's script as N ranks the way torchrun does, and find processes left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from phalanx.runtime.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


def start_ranks(args: list[str], world_size: int, **env: str) -> list[subprocess.Popen]:
    """``python -u *args`` once per rank with torchrun's environment variables."""
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        environ = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
            **env,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-u", *args],
                cwd=ROOT,
                env=environ,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """(exit code, stderr) per rank; kills every rank and fails if one runs past ``timeout``."""
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            out.append((p.returncode, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"ranks still running after {timeout} s") from None
    return out


def processes_with(marker: str) -> list[int]:
    """PIDs of live processes whose command line contains ``marker`` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def wait_gone(marker: str, timeout: float = 10.0) -> list[int]:
    """Poll until no process carries ``marker``; returns those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
