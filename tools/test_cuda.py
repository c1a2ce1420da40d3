"""``make test-cuda``: the CUDA-only tests and the GPU benchmarks in one invocation that fits one
GPU machine's 10-minute call; writes a short report (Markdown) and exits non-zero if a part
failed.

Parts run in order of importance, each as its own process group with its own time limit, the
whole within ``--budget-s`` (default 480 s): a part whose limit no longer fits in what is left is
skipped (and reported so). Before anything runs, every ``phalanx`` part's command is parsed and
its bench config validated in this process, so a typo fails that part at once instead of
wasting the GPU window. The report is rewritten (atomically) after every part, so a run killed
from outside still leaves what finished; SIGTERM stops the running part and writes it.

  1. ``tests``: the tests marked ``cuda`` (pinned host tiers, side-stream copies, the host
     optimizer mirror, fsdp on NCCL, compile on a GPU, ...), only the files that mark one;
  2. ``gpu``: ``bench gpu``, GPT-2 small against the plain PyTorch loop, DDP, FSDP2 and
     phalanx's ``allreduce`` and ``fsdp``, eager and compiled (its JSON next to the report);
  3. ``memory-layers`` and 4. ``optimizer``: the memory manager and the host optimizer on a
     GPU; 5. ``data``: pinned copies on a side stream; 6. ``exchange`` and 7. ``fsdp`` with
     NCCL at world 1; 8. ``compile``: ``[train] compile`` in ``phalanx train`` processes.
Limits (``PARTS``): 150 + 270 s for the first two, so both fit with a minute to spare; the
rest run while what is left allows.

``--device cpu`` runs the same parts at tiny sizes with CUDA hidden (the unit tier's smoke test
of this tool: tests/unit/test_cuda_tool.py). Every child finds phalanx through PYTHONPATH (this
checkout's src/ first), so nothing needs installing.

Usage: PYTHONPATH=src python3 tools/test_cuda.py [--out cuda-report.md] [--budget-s 480]
       [--device cuda|cpu] [--only tests,gpu,...]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
TAIL_LINES = 14
NOISE = re.compile(r"Warning|^\[rank\d+\]:[WI]\d")  # left out of a part's tail: torch's warnings


@dataclass
class Part:
    """One part: ``argv`` after the interpreter, run from the repository root."""

    key: str  # its name for --only
    name: str
    argv: list[str]
    limit_s: int
    tail_lines: int = TAIL_LINES
    status: str = "pending"  # then ok, failed or skipped
    note: str = ""  # why it failed or was skipped
    seconds: float = 0.0
    tail: str = field(default="", repr=False)


# The parts, most important first: key (--only; a bench's target) -> its title and its limits
# in seconds on a GPU and with --device cpu.
PARTS = {
    "tests": ("tests marked cuda", 150, 40),
    "gpu": ("bench gpu (GPT-2 small vs plain PyTorch)", 270, 120),
    "memory-layers": ("bench memory-layers (memory manager)", 90, 60),
    "optimizer": ("bench optimizer (host optimizer)", 90, 60),
    "data": ("bench data (pinned copies)", 60, 60),
    "exchange": ("bench exchange (world 1)", 60, 60),
    "fsdp": ("bench fsdp (world 1)", 60, 60),
    "compile": ("bench compile (1 process)", 90, 150),
}
# A bench's flags on a GPU, then what --device cpu appends to them (the last value of a flag
# given twice wins): the same command at tiny sizes.
FLAGS = {
    "gpu": ("--rounds 3 --steps 10 --warmup 2", "--device cpu --rounds 2 --steps 2 --warmup 1"),
    "memory-layers": ("--device cuda --rounds 1 --budgets 0.5",
                      "--device cpu --blocks 2 --batch-size 8 --image-size 16 --steps 1"),
    "optimizer": ("--device cuda --rounds 1 --layers 6",
                  "--device cpu --layers 2 --width 128 --steps 1"),
    "data": ("--rounds 2 --train-rounds 1",
             "--rounds 1 --batches 4 --warmup 1 --train-steps 4 --workers 1"),
    "exchange": ("--nproc 1 --models mlp --rounds 2", "--rounds 1 --steps 2 --warmup 1"),
    "fsdp": ("--nproc 1 --rounds 2",
             "--rounds 1 --steps 2 --warmup 1 --num-layers 1 --width 64 --vocab 256 --seq-len 16"),
    "compile": ("--nproc 1 --sets parallel.pipeline=1 --rounds 1 --steps 20",
                "--steps 4 --warmup 1"),
}  # fmt: skip
PYTEST = "-m pytest -v -rs -m cuda -p no:cacheprovider --continue-on-collection-errors"


def parts(device: str, gpu_json: Path) -> list[Part]:
    """Every part, most important first; on ``cpu`` the same commands at tiny sizes."""
    cpu = device == "cpu"
    found = []
    for key, (name, gpu_limit, cpu_limit) in PARTS.items():
        if key == "tests":
            argv = [*PYTEST.split(), *cuda_test_files()]
        else:
            gpu_flags, tiny = FLAGS[key]
            argv = [
                "-m",
                "phalanx",
                "bench",
                key,
                *gpu_flags.split(),
                *(tiny.split() if cpu else []),
            ]
        if key == "gpu":  # its figures, next to the report
            argv += ["--json", str(gpu_json)]
        tail = {"gpu": 40, "tests": 30}.get(key, TAIL_LINES)  # bench gpu's table, each test
        found.append(Part(key, name, argv, cpu_limit if cpu else gpu_limit, tail))
    return found


def cuda_test_files() -> list[str]:
    """The test files that mark a test ``cuda`` (collecting only them is quicker, and a file
    whose imports fail on the GPU machine cannot hold the others back)."""
    found = [p for p in sorted((ROOT / "tests").rglob("test_*.py")) if "mark.cuda" in p.read_text()]
    return [str(p.relative_to(ROOT)) for p in found] or ["tests"]


def child_env(device: str) -> dict[str, str]:
    """This environment, with this checkout's src/ first on PYTHONPATH (and CUDA hidden on
    ``cpu``)."""
    paths = [str(SRC), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(paths)}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def check_command(argv: list[str]) -> str | None:
    """Why a ``-m phalanx`` part cannot run (phalanx's own parser, then the bench config's
    checks, in this process), or None; other parts are not checked."""
    if argv[:2] != ["-m", "phalanx"]:
        return None
    try:
        from phalanx.bench import load
        from phalanx.cli import build_parser
        from phalanx.commands.bench.flags import config_from_args
    except Exception as e:  # a broken checkout: every phalanx part fails the same way
        return f"cannot load phalanx's CLI: {type(e).__name__}: {e}"
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(argv[2:])
        if getattr(args, "target", None) is not None and argv[2] == "bench":
            bench = load().get(args.target)()
            config_from_args(bench, args).validate()
    except SystemExit:
        lines = [line for line in said.getvalue().splitlines() if line.strip()]
        return lines[-1] if lines else "the arguments do not parse"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


class Stopped(Exception):
    """SIGTERM or SIGINT arrived: stop the running part, write the report, exit."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


def run_part(part: Part, env: dict[str, str]) -> None:
    """Run ``part`` in its own process group, its output streamed here and its tail kept;
    past its limit (or when this process is told to stop) the whole group is killed."""
    started = time.perf_counter()
    lines: list[str] = []
    proc: subprocess.Popen[str] | None = None
    reader: threading.Thread | None = None
    try:
        proc = subprocess.Popen([sys.executable, *part.argv], cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, errors="replace")  # fmt: skip
        reader = threading.Thread(target=_stream, args=(proc, lines), daemon=True)
        reader.start()
        print(f"== {part.name}: {' '.join(part.argv)}", flush=True)
        code = proc.wait(timeout=part.limit_s)
        part.status = "ok" if code == 0 else "failed"
        part.note = "" if code == 0 else f"exit status {code}"
    except subprocess.TimeoutExpired:
        part.status, part.note = "failed", f"stopped at its limit of {part.limit_s} s"
    except Stopped as e:
        part.status, part.note = "failed", f"stopped by {e}"
        raise
    finally:
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the part and whatever it started
            proc.wait()
        if reader is not None:
            reader.join(timeout=5)
        part.seconds = time.perf_counter() - started
        kept = [x for x in lines if x.strip() and not NOISE.search(x)]
        part.tail = "\n".join(kept[-part.tail_lines :])
        print(f"-- {part.name}: {part.status} in {part.seconds:.0f} s {part.note}", flush=True)


def _stream(proc: subprocess.Popen[str], lines: list[str]) -> None:
    """The part's output, printed here as it comes and kept in ``lines``."""
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        print(f"   | {line}", end="", flush=True)


def device_line(device: str) -> str:
    import torch

    if device == "cpu":
        return f"--device cpu: tiny sizes, CUDA hidden from the parts (torch {torch.__version__})"
    if not torch.cuda.is_available():
        return f"no CUDA device visible (torch {torch.__version__})"
    name = torch.cuda.get_device_name()
    return f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}"


def summary(all_parts: list[Part]) -> str:
    """``N of M parts ok``, then the parts of every other status."""
    by_status = {s: [p.name for p in all_parts if p.status == s] for s in
                 ("failed", "skipped", "pending")}  # fmt: skip
    ok = sum(p.status == "ok" for p in all_parts)
    return f"{ok} of {len(all_parts)} parts ok" + "".join(
        f"; {status}: {', '.join(names)}" for status, names in by_status.items() if names
    )


def report(all_parts: list[Part], head: str, budget_s: float, used_s: float) -> str:
    """The Markdown report: the summary, a table row per part, each run part's output tail."""
    rows = ["| part | status | seconds | limit s | note |", "| --- | --- | --- | --- | --- |"]
    rows += [f"| {p.name} | {p.status} | {p.seconds:.0f} | {p.limit_s} | "
             f"{p.note.replace('|', '/')} |" for p in all_parts]  # fmt: skip
    sections = [f"## {p.name}: {p.status} ({p.seconds:.0f} s)\n\n`python {' '.join(p.argv)}`"
                f"\n\n```\n{p.tail}\n```\n" for p in all_parts if p.tail]  # fmt: skip
    top = f"# make test-cuda\n\n{head}; budget {budget_s:.0f} s, {used_s:.0f} s used"
    return "\n\n".join([top, summary(all_parts), "\n".join(rows), "\n".join(sections)])


def write_atomically(path: Path, text: str) -> None:
    """A reader (or a run killed now) sees the old report or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="cuda-report.md", help="the report (Markdown)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for all parts")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the same parts at tiny sizes, CUDA hidden")  # fmt: skip
    parser.add_argument("--only", default="", help="comma list of part keys to run")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    out = Path(args.out).resolve()
    all_parts = parts(args.device, out.with_suffix(".gpu.json"))
    only = [k for k in args.only.split(",") if k]
    unknown = [k for k in only if k not in {p.key for p in all_parts}]
    if unknown:
        parser.error(f"--only: unknown part {unknown[0]!r}; parts: "
                     + ", ".join(p.key for p in all_parts))  # fmt: skip
    sys.path.insert(0, str(SRC))  # the commands' checks import this checkout's phalanx
    os.chdir(ROOT)  # where the parts run (bench configs name files relative to it)
    head = f"{time.strftime('%Y-%m-%d %H:%M %Z')}; {device_line(args.device)}"
    print(head, flush=True)

    def write() -> None:
        used = time.perf_counter() - started
        write_atomically(out, report(all_parts, head, args.budget_s, used))

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    stopped = False
    try:
        for part in all_parts:
            if only and part.key not in only:
                part.status, part.note = "skipped", "not selected (--only)"
            elif problem := check_command(part.argv):
                part.status, part.note = "failed", f"not run: {problem}"
        write()
        run_parts(
            all_parts,
            args.budget_s - (time.perf_counter() - started),
            child_env(args.device),
            write,
        )
    except Stopped as e:
        for part in all_parts:
            if part.status == "pending":
                part.status, part.note = "skipped", f"the run was stopped by {e}"
        stopped = True
    write()
    print(summary(all_parts), f"report: {out}", sep="\n", flush=True)
    return 1 if stopped or any(p.status == "failed" for p in all_parts) else 0


def run_parts(
    all_parts: list[Part], budget_s: float, env: dict[str, str], write: Callable[[], None]
) -> None:
    """Each pending part whose limit fits in what is left of ``budget_s``; the report after each."""
    started = time.perf_counter()
    for part in all_parts:
        if part.status != "pending":
            continue
        left = budget_s - (time.perf_counter() - started)
        if part.limit_s > left:
            part.status, part.note = "skipped", f"its {part.limit_s} s > {left:.0f} s left"
            print(f"-- {part.name}: skipped ({part.note})", flush=True)
        else:
            run_part(part, env)
        write()


if __name__ == "__main__":
    sys.exit(main())
