"""Run a user's script or command the way users do: a subprocess under torchrun or
``phalanx train``, with nothing from the test process inside it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.faults.procs import ROOT, wait_gone

SCRIPTS = Path(__file__).parent / "scripts"


@dataclass
class Finished:
    returncode: int
    output: str  # stdout and stderr together


def torchrun(
    script: Path | str,
    *args: str,
    nproc: int,
    timeout: float = 240.0,
    marker: str = "",
    env: dict[str, str] | None = None,
) -> Finished:
    """``torchrun --standalone --nproc-per-node NPROC SCRIPT ARGS``; fails the test if the job
    runs past ``timeout`` (every process is killed) or leaves a process behind (``marker``: a
    string on its command lines; default the first argument, else the script)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), str(script), *args]
    marker = marker or (str(args[0]) if args else str(script))
    return run(command, marker=marker, timeout=timeout, env=env)


def run(
    command: list[str], *, marker: str, timeout: float = 240.0, env: dict[str, str] | None = None
) -> Finished:
    """Run ``command`` from the repository root; ``marker`` is a string on every command line
    it starts (a temporary directory), to find processes left behind; ``env``: variables
    added to this process's."""
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout stops every rank
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{command[-3:]} still running after {timeout} s:\n{output}") from None
    left = wait_gone(marker)
    assert left == [], f"processes left behind: {left}"
    return Finished(proc.returncode, output)


def assert_clean(done: Finished) -> None:
    """Exit code 0 and no rank aborted at exit (the message leads with the ranks' errors,
    which torchrun's own report pushes out of the output's tail)."""
    tail = "".join(raised(done.output)) + done.output[-4000:]
    assert "terminate called" not in done.output, tail
    assert "Fatal Python error" not in done.output, tail
    assert done.returncode == 0, f"exit code {done.returncode}:\n{tail}"


def raised(output: str) -> list[str]:
    """The lines naming the exceptions the ranks raised (``[rank1]: ValueError: ...``), each
    once, the first ten."""
    error = re.compile(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Lost)\b.*: ")
    lines = [line + "\n" for line in output.splitlines() if error.match(line)]
    return list(dict.fromkeys(lines))[:10]


def readme_example() -> str:
    """The README's Python example, verbatim."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```\n", start)]
