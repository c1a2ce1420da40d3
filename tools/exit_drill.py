"""Soak drill for clean exits: many short multi-process jobs, as users start them, and how many
ended cleanly (exit code 0, no "terminate called" / "Fatal Python error", no process left).

    .venv/bin/python tools/exit_drill.py [--jobs 50] [--concurrent 2] [--json PATH]

The jobs cycle through users' entry points and strategies: the README's Python example under
torchrun, a script where only rank 0 reads the weights (tests/integration/scripts/rank0_reads.py)
with each strategy at worlds 2 and 3, ``phalanx train`` and ``run_ranks``. Set PYTHONPATH to
another checkout's ``src`` to drill that code (how the figure before a fix was taken). Not a
test: its result is a count, recorded in docs/benchmarks.md. Progress goes to stderr, the
report (Markdown) to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.faults.procs import wait_gone  # noqa: E402
from tests.integration.users import readme_example  # noqa: E402

RANK0 = str(ROOT / "tests" / "integration" / "scripts" / "rank0_reads.py")
JOB_LIMIT_S = 180.0
ABORTS = ("terminate called", "Fatal Python error")

SPAWN_JOB = """
import functools, torch, phalanx as px
from phalanx.runtime.spawn import run_ranks

def train(ctx, strategy):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    engine = px.Engine(model, torch.nn.functional.cross_entropy,
                       optimizer=functools.partial(torch.optim.SGD, lr=0.1), exchange=strategy)
    for _ in range(4):
        engine.step(torch.randn(8, 8), torch.randint(0, 4, (8,)))
    return ctx.rank

if __name__ == "__main__":
    assert run_ranks(train, 2, "partitioned") == [0, 1]
"""


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), *args]  # fmt: skip


def jobs(tmp: Path) -> list[tuple[str, list[str]]]:
    """(name, command) of each kind of job; ``tmp`` is on every command line."""
    readme, spawn = tmp / "train.py", tmp / "spawn_job.py"
    readme.write_text(readme_example())
    spawn.write_text(SPAWN_JOB)
    train = [sys.executable, "-m", "phalanx", "train", "configs/digits_cnn.toml", "--nproc", "2",
             "--set", "train.steps=6", "--set", "train.progress=false",
             "--set", f"train.run_dir={tmp / 'run'}"]  # fmt: skip
    return [
        ("readme torchrun x2", torchrun(2, str(readme))),
        ("rank0 reads allreduce x2", torchrun(2, RANK0, str(tmp), "allreduce:none")),
        ("rank0 reads ps x2", torchrun(2, RANK0, str(tmp), "ps:none")),
        ("rank0 reads partitioned fp16 x3", torchrun(3, RANK0, str(tmp), "partitioned:fp16")),
        ("rank0 reads tree x3", torchrun(3, RANK0, str(tmp), "tree:none")),
        ("rank0 reads ps fp16 + partitioned x2",
         torchrun(2, RANK0, str(tmp), "ps:fp16", "partitioned:none")),
        ("phalanx train x2", train),
        ("run_ranks partitioned x2", [sys.executable, str(spawn)]),
    ]  # fmt: skip


@dataclass
class Outcome:
    job: str
    clean: bool
    exit_code: int | None
    seconds: float
    why: str  # "" when clean


def run_job(name: str, command: list[str], marker: str) -> Outcome:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=JOB_LIMIT_S)  # fmt: skip
        code, output = done.returncode, done.stdout
    except subprocess.TimeoutExpired as e:
        code, output = None, str(e.output or "")
    seconds = time.monotonic() - start
    left = wait_gone(marker)
    why = [f"exit code {code}"] if code != 0 else []
    why += [f"printed {a!r}" for a in ABORTS if a in output]
    why += [f"left {len(left)} process(es)"] if left else []
    return Outcome(name, not why, code, round(seconds, 1), "; ".join(why))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50, help="jobs to run (default 50)")
    parser.add_argument(
        "--concurrent",
        type=int,
        default=1,
        help="jobs running at once (default 1); 2 on a 2-core machine loads it the way a busy "
        "CI runner does, which makes timing-dependent exits far more likely",
    )
    parser.add_argument("--json", help="also write the outcomes here")
    args = parser.parse_args()
    outcomes: list[Outcome | None] = [None] * args.jobs
    lock = threading.Lock()
    counter = iter(range(args.jobs))

    def slot() -> None:
        # Each slot has its own directory: its jobs' files, run directory and process marker.
        with tempfile.TemporaryDirectory(prefix="phalanx-exit-drill-") as tmp:
            kinds = jobs(Path(tmp))
            while True:
                with lock:
                    n = next(counter, None)
                if n is None:
                    return
                name, command = kinds[n % len(kinds)]
                outcome = outcomes[n] = run_job(name, command, marker=tmp)
                state = "clean" if outcome.clean else f"NOT CLEAN ({outcome.why})"
                print(
                    f"[{n + 1}/{args.jobs}] {name}: {state}, {outcome.seconds} s", file=sys.stderr
                )

    slots = [threading.Thread(target=slot) for _ in range(max(1, args.concurrent))]
    for thread in slots:
        thread.start()
    for thread in slots:
        thread.join()
    report([o for o in outcomes if o is not None], args.concurrent)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(o) for o in outcomes], indent=1))


def report(outcomes: list[Outcome], concurrent: int) -> None:
    import torch

    clean = sum(o.clean for o in outcomes)
    source = os.environ.get("PYTHONPATH") or str(ROOT / "src")
    print(f"exit drill {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{platform.node()} ({os.cpu_count()} cores), torch {torch.__version__}, "
          f"phalanx from {source}, {concurrent} job(s) at a time")  # fmt: skip
    print(f"\n**{clean} of {len(outcomes)} jobs exited cleanly**\n")
    print("| job | runs | clean | not clean (why) |")
    print("|---|---|---|---|")
    for name in dict.fromkeys(o.job for o in outcomes):
        mine = [o for o in outcomes if o.job == name]
        bad = "; ".join(o.why for o in mine if not o.clean) or "-"
        print(f"| {name} | {len(mine)} | {sum(o.clean for o in mine)} | {bad} |")


if __name__ == "__main__":
    main()
