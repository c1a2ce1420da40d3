"""``make test-cuda``: every CUDA-only test and the CUDA parts of the benchmarks, in one
invocation, on a machine with a GPU; writes a short report (Markdown) and exits non-zero if
anything failed.

Parts, each run as its own process with a time limit:
  - the tests marked ``cuda`` (pinned host tiers, the side-stream copies, the host optimizer
    mirror, fsdp on NCCL, compile on a GPU), with CUDA visible;
  - the benchmarks' GPU runs at small sizes: ``bench fsdp`` (fsdp vs torch's FSDP2 loop,
    world 1), ``bench exchange`` (the strategies on NCCL, world 1: one GPU holds one rank),
    ``bench memory-layers --device cuda`` (the memory manager against torch's checkpoint and
    save_on_cpu, peaks in device memory), ``bench optimizer --device cuda`` (the optimizer's
    state in pinned host memory, the host mirror), ``bench data`` (pinned copies on a side
    stream) and ``bench compile`` (one process).

Usage: python tools/test_cuda.py [--out cuda-report.md] [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHALANX = [sys.executable, "-m", "phalanx"]
TAIL_LINES = 14


def parts(quick: bool) -> list[tuple[str, list[str], int]]:
    """(name, command, seconds allowed) of every part, in order."""
    rounds = ["--rounds", "2" if quick else "3"]
    found = [
        ("tests marked cuda", [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda",
                               "-p", "no:cacheprovider", "tests"], 900),
        ("bench fsdp (world 1)", [*PHALANX, "bench", "fsdp", "--nproc", "1", *rounds], 300),
        ("bench exchange (NCCL, world 1)", [*PHALANX, "bench", "exchange", "--nproc", "1",
                                           "--models", "mlp", *rounds], 300),
        ("bench memory-layers (cuda)", [*PHALANX, "bench", "memory-layers", "--device", "cuda",
                                        "--rounds", "1", "--budgets", "0.5"], 300),
        ("bench optimizer (cuda)", [*PHALANX, "bench", "optimizer", "--device", "cuda",
                                    "--rounds", "1", "--layers", "6"], 300),
        ("bench data (pinned copies)", [*PHALANX, "bench", "data", "--rounds", "2",
                                        "--train-rounds", "1"], 300),
    ]  # fmt: skip
    if _has_bench("compile"):
        # one GPU holds one process: the GPT config as one data-parallel process
        one = ["--nproc", "1", "--sets", "parallel.pipeline=1"]
        found.append(("bench compile (1 process)", [*PHALANX, "bench", "compile", *one, *rounds],
                      600))  # fmt: skip
    return found


def _has_bench(name: str) -> bool:
    done = subprocess.run([*PHALANX, "bench", name, "--help"], capture_output=True, cwd=ROOT)
    return done.returncode == 0


def device_line() -> str:
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA device visible (torch {torch.__version__})"
    name = torch.cuda.get_device_name()
    return f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}"


def run_part(name: str, command: list[str], limit_s: int) -> tuple[bool, float, str]:
    print(f"== {name}: {' '.join(command[1:])}", flush=True)
    started = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=limit_s)  # fmt: skip
        output, ok = done.stdout + done.stderr, done.returncode == 0
    except subprocess.TimeoutExpired as e:
        output = f"{e.stdout or ''}{e.stderr or ''}\n(stopped after {limit_s} s)"
        output, ok = str(output), False
    seconds = time.perf_counter() - started
    lines = [line for line in output.splitlines() if "Warning" not in line and line.strip()]
    tail = "\n".join(lines[-TAIL_LINES:])
    print(tail, flush=True)
    print(f"-- {name}: {'ok' if ok else 'FAILED'} in {seconds:.0f} s", flush=True)
    return ok, seconds, tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="cuda-report.md", help="the report (Markdown)")
    parser.add_argument("--quick", action="store_true", help="fewer benchmark rounds")
    args = parser.parse_args()
    device = device_line()
    print(f"device: {device}", flush=True)
    sections, failed = [], []
    for name, command, limit in parts(args.quick):
        ok, seconds, tail = run_part(name, command, limit)
        if not ok:
            failed.append(name)
        status = "ok" if ok else "FAILED"
        sections.append(f"## {name}: {status} ({seconds:.0f} s)\n\n```\n{tail}\n```\n")
    date = time.strftime("%Y-%m-%d %H:%M %Z")
    summary = f"{len(sections) - len(failed)} of {len(sections)} parts ok" + (
        f"; failed: {', '.join(failed)}" if failed else ""
    )
    report = f"# make test-cuda\n\n{date}; {device}\n\n{summary}\n\n" + "\n".join(sections)
    Path(args.out).write_text(report)
    print(f"{summary}; report: {args.out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
