"""Measure what `phalanx train` does under faults, for the table in docs/reliability.md.

    .venv/bin/python tools/fault_drill.py [--repeats N] [--json PATH] [--only 1,4]

Each scenario runs a short 2-process training run (its own temporary run directory) with a fault
injected (PHALANX_FAULT, see src/phalanx/faults.py) or a signal sent, `--repeats` times, and
reports the exit code, the last stderr line, a time (median [min-max]) and whether any process
whose command line holds the run directory was still alive 10 s after the launcher exited.
Every run is bounded by a timeout: on expiry everything of that run is killed and the sample is
recorded as "timeout". Progress goes to stderr; the report (Markdown) to stdout.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.faults.procs import processes_with, wait_gone  # noqa: E402

CONFIG = "tests/multiproc/digits_no_dropout.toml"
STEPS = 12
TIMEOUT_S = 20  # runtime.timeout_s of every run
ELASTIC_GRACE_S = 30  # torch elastic waits this long after SIGTERM before SIGKILL
BASE = ["--nproc", "2", "--set", f"train.steps={STEPS}", "--set", "checkpoint.every=4",
        "--set", "train.progress=false", "--set", f"runtime.timeout_s={TIMEOUT_S}"]  # fmt: skip
RUN_LIMIT_S = 150.0  # one phalanx invocation; past it the run counts as "timeout"
LEFTOVER_WAIT_S = 10.0  # a process of the run still alive this long after the launcher: left
STEP_WAIT_S = 90.0  # waiting for metrics.jsonl lines before a signal is sent


# -- pure helpers (unit tested) -----------------------------------------------------------------
def parse_environ(data: bytes) -> dict[str, str]:
    """The variables of /proc/PID/environ (NUL-separated KEY=VALUE entries)."""
    out: dict[str, str] = {}
    for entry in data.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep and key:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def summarize(values: Iterable[float | None]) -> dict[str, Any]:
    """Median, min and max of the measured values (None, a run with no time, is left out)."""
    got = [v for v in values if v is not None and math.isfinite(v)]
    if not got:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(got), "median": statistics.median(got), "min": min(got), "max": max(got)}


def format_time(summary: dict[str, Any], total: int) -> str:
    """'12.34 s [12.00-13.10] over 3' (or 'n/a'), naming how many samples had a time."""
    if not summary["n"]:
        return f"n/a (0 of {total} runs timed)"
    over = f"over {total}" if summary["n"] == total else f"over {summary['n']} of {total}"
    return f"{summary['median']:.2f} s [{summary['min']:.2f}-{summary['max']:.2f}] {over}"


def fault_time(log_text: str) -> float | None:
    """UNIX time of the first fault in a PHALANX_FAULT_LOG file ("TIME ACTION POINT STEP RANK")."""
    for line in log_text.splitlines():
        fields = line.split()
        if len(fields) == 5:
            try:
                return float(fields[0])
            except ValueError:
                continue
    return None


def last_line(text: str) -> str:
    """The last non-empty line (what the user sees last)."""
    lines = nonempty_lines(text)
    return lines[-1] if lines else ""


def nonempty_lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def flip_middle_byte(data: bytes) -> bytes:
    """``data`` with the byte in the middle inverted (bit rot in a checkpoint)."""
    out = bytearray(data)
    out[len(out) // 2] ^= 0xFF
    return bytes(out)


def normalize(text: str, top: str = "") -> str:
    """A message with what differs between repeats masked: the drill's temporary directory
    (``top``) becomes <tmp>, ``pid 1234`` becomes ``pid N``, ``/sN-rR/`` becomes ``/sN-r*/``."""
    if top:
        text = text.replace(top, "<tmp>")
    text = re.sub(r"\bpid \d+", "pid N", text)
    return re.sub(r"/s(\d+)-r\d+/", r"/s\1-r*/", text)


def md_cell(text: str) -> str:
    """Text safe inside one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def counted(values: Iterable[Any]) -> str:
    """'1 ×3' or '1 ×2, timeout ×1': distinct values in first-seen order with their counts."""
    counts: dict[str, int] = {}
    for value in values:
        counts[str(value)] = counts.get(str(value), 0) + 1
    return ", ".join(f"{value} ×{n}" for value, n in counts.items())


# -- running phalanx ----------------------------------------------------------------------------
@dataclass
class Outcome:
    """One finished (or timed-out) `phalanx` invocation."""

    code: int | None  # None: timed out (killed by the drill)
    started: float  # time.time() at Popen
    ended: float  # time.time() when the launcher was seen to exit (or was killed)
    stderr: str
    left: list[str] = field(default_factory=list)  # "PID (state)" alive LEFTOVER_WAIT_S later

    @property
    def timed_out(self) -> bool:
        return self.code is None

    @property
    def wall_s(self) -> float:
        return self.ended - self.started

    @property
    def exit(self) -> int | str:
        return "timeout" if self.code is None else self.code


class Launch:
    """`python -m phalanx train ...` in the background, stdout/stderr into files (not pipes: a
    worker left behind would hold a pipe open and hang a reader)."""

    def __init__(self, work: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.marker = str(work / "run")
        self.work = work
        n = len(list(work.glob("stderr-*.txt")))
        self.err_path = work / f"stderr-{n}.txt"
        self._out = open(work / f"stdout-{n}.txt", "wb")  # noqa: SIM115 - closed in finish
        self._err = open(self.err_path, "wb")  # noqa: SIM115
        environ = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
        self.started = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx", *args],
            cwd=ROOT, env={**environ, **(env or {})}, stdout=self._out, stderr=self._err,
        )  # fmt: skip

    def finish(self, timeout: float = RUN_LIMIT_S) -> Outcome:
        """Wait for the launcher (killing everything of the run past ``timeout``), then look for
        processes of the run still alive LEFTOVER_WAIT_S later; those are killed afterwards."""
        remaining = max(0.1, self.started + timeout - time.time())
        code: int | None
        try:
            code = self.proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            code = None
        ended = time.time()
        if code is None:
            kill_run(self.marker)
            self.proc.kill()
            self.proc.wait(timeout=30)
        left = [f"{pid} ({proc_state(pid)})" for pid in wait_gone(self.marker, LEFTOVER_WAIT_S)]
        if left:
            kill_run(self.marker)
        self._out.close()
        self._err.close()
        stderr = self.err_path.read_text(encoding="utf-8", errors="replace")
        return Outcome(code, self.started, ended, stderr, left)


def kill_run(marker: str) -> None:
    """SIGKILL every process of the run (a stopped one too) and wait until they are gone."""
    for pid in processes_with(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_gone(marker, 10.0)


def proc_state(pid: int) -> str:
    """The one-letter state of /proc/PID/stat (T: stopped, S: sleeping), '?' if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def train_args(work: Path, *extra: str) -> list[str]:
    return ["train", CONFIG, *BASE, "--run-dir", str(work / "run"), *extra]


def resume_args(work: Path) -> list[str]:
    return ["train", "--resume", str(work / "run"), "--nproc", "2"]


def fault_env(work: Path, fault: str) -> dict[str, str]:
    return {"PHALANX_FAULT": fault, "PHALANX_FAULT_LOG": str(work / "fault.log")}


def losses(run_dir: Path) -> list[float] | None:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]


def metric_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


def wait_for_lines(launch: Launch, lines: int) -> bool:
    """Poll until metrics.jsonl has ``lines`` lines; False if the run ended or took too long."""
    deadline = time.monotonic() + STEP_WAIT_S
    run_dir = Path(launch.marker)
    while time.monotonic() < deadline and launch.proc.poll() is None:
        if metric_lines(run_dir) >= lines:
            return True
        time.sleep(0.01)
    return False


def worker_of_rank(marker: str, rank: int) -> list[int]:
    """PIDs of the worker processes of rank ``rank``: command line holds the run directory and
    "phalanx", environment has RANK=rank; a child of such a process (same environment) is not
    counted, only the top one."""
    found: dict[int, int] = {}  # pid -> ppid
    for pid in processes_with(marker):
        proc = Path(f"/proc/{pid}")
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = parse_environ((proc / "environ").read_bytes())
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if "phalanx" in cmdline and environ.get("RANK") == str(rank):
            found[pid] = ppid
    return sorted(pid for pid, ppid in found.items() if ppid not in found)


def log(message: str) -> None:
    print(f"[fault_drill {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- scenarios -------------------------------------------------------------------------------
Sample = dict[str, Any]


def base_sample(outcome: Outcome) -> Sample:
    return {
        "exit_code": outcome.exit,
        "wall_s": outcome.wall_s,
        "stderr_last": last_line(outcome.stderr),
        "stderr_lines": len(nonempty_lines(outcome.stderr)),
        "stderr_all": nonempty_lines(outcome.stderr)[-40:],
        "leftovers": outcome.left,
        "time_s": None,
    }


def run_kill(work: Path, fault: str, ctx: dict[str, Any]) -> Sample:
    """Scenarios 1-3: time from the fault (its log line) to the launcher's exit."""
    outcome = Launch(work, train_args(work), fault_env(work, fault)).finish()
    sample = base_sample(outcome)
    log_path = work / "fault.log"
    fired = fault_time(log_path.read_text()) if log_path.is_file() else None
    sample["fault_time"] = fired
    if fired is not None and not outcome.timed_out:
        sample["time_s"] = outcome.ended - fired
    if "checkpoint" in fault:
        from phalanx import checkpoint

        sample["latest_step_after"] = checkpoint.latest_step(work / "run" / "checkpoints")
    return sample


def run_hang(work: Path, ctx: dict[str, Any]) -> Sample:
    """Scenario 4: SIGSTOP the rank-1 worker after 3 steps; time from SIGSTOP to exit."""
    launch = Launch(work, train_args(work))
    extra: dict[str, Any] = {}
    stopped_at = None
    if wait_for_lines(launch, 3):
        pids = worker_of_rank(launch.marker, 1)
        extra["rank1_pids"] = pids
        extra["lines_at_signal"] = metric_lines(Path(launch.marker))
        rank0 = worker_of_rank(launch.marker, 0)
        if pids:
            os.kill(pids[0], signal.SIGSTOP)
            stopped_at = time.time()
            extra["rank0_exit_after_s"] = wait_exit(launch, rank0, stopped_at)
    else:
        extra["note"] = "the run did not reach 3 steps (or ended first)"
    outcome = launch.finish()
    sample = {**base_sample(outcome), **extra, "signal_time": stopped_at}
    if stopped_at is not None and not outcome.timed_out:
        sample["time_s"] = outcome.ended - stopped_at
    if "rank1_pids" in extra and extra["rank1_pids"]:
        stopped = str(extra["rank1_pids"][0])
        sample["stopped_rank_left"] = any(p.split()[0] == stopped for p in outcome.left)
    return sample


def wait_exit(launch: Launch, pids: list[int], since: float) -> float | None:
    """Seconds from ``since`` until every process in ``pids`` has exited (gone or a zombie),
    polled while the launcher runs; None if the launcher ended first or the run's limit hit."""
    deadline = launch.started + RUN_LIMIT_S
    while pids and launch.proc.poll() is None and time.time() < deadline:
        if all(proc_state(pid) in ("?", "Z") for pid in pids):
            return time.time() - since
        time.sleep(0.05)
    return None


def run_signal(work: Path, signum: signal.Signals, ctx: dict[str, Any]) -> Sample:
    """Scenarios 5-6: the launcher gets SIGINT/SIGTERM after 2 steps; time from signal to exit.
    After SIGTERM the run is resumed to the end and its losses compared with the reference."""
    launch = Launch(work, train_args(work))
    sent = None
    extra: dict[str, Any] = {}
    if wait_for_lines(launch, 2):
        launch.proc.send_signal(signum)
        sent = time.time()
        extra["lines_at_signal"] = metric_lines(Path(launch.marker))
    else:
        extra["note"] = "the run did not reach 2 steps (or ended first)"
    outcome = launch.finish()
    sample = {**base_sample(outcome), **extra, "signal_time": sent}
    if sent is not None and not outcome.timed_out:
        sample["time_s"] = outcome.ended - sent
    if signum == signal.SIGTERM:
        from phalanx import checkpoint

        run_dir = work / "run"
        preempted = run_dir / "preempted.json"
        sample["preempted_steps"] = (
            json.loads(preempted.read_text())["steps"] if preempted.is_file() else None
        )
        sample["checkpoint_step"] = checkpoint.latest_step(run_dir / "checkpoints")
        if sample["checkpoint_step"] is not None:
            resumed = Launch(work, resume_args(work)).finish()
            sample["resume_exit_code"] = resumed.exit
            sample["resume_wall_s"] = resumed.wall_s
            sample["resume_stderr_last"] = last_line(resumed.stderr)
            sample["leftovers"] = sample["leftovers"] + resumed.left
            sample["losses_equal_reference"] = losses(run_dir) == ctx["reference_losses"]
    return sample


def run_restart(work: Path, ctx: dict[str, Any]) -> Sample:
    """Scenario 7: --max-restarts 1, rank 1 killed in step 6; wall time of the whole run."""
    fault = "kill@forward:step=6:rank=1"
    outcome = Launch(work, train_args(work, "--max-restarts", "1"), fault_env(work, fault)).finish()
    sample = base_sample(outcome)
    if not outcome.timed_out:
        sample["time_s"] = outcome.wall_s
    sample["reference_wall_s"] = ctx["reference_wall_s"]
    sample["stderr_names_rank1"] = "restart 1 after a worker failed" in outcome.stderr
    sample["losses_equal_reference"] = losses(work / "run") == ctx["reference_losses"]
    return sample


def run_corrupt(work: Path, ctx: dict[str, Any]) -> Sample:
    """Scenario 8: a clean run, the middle byte of step-0000012's rank-1 shard file flipped,
    then --resume; time is the resume's wall time."""
    first = Launch(work, train_args(work)).finish()
    sample: Sample = {"first_exit_code": first.exit, "first_wall_s": first.wall_s}
    newest = work / "run" / "checkpoints" / f"step-{STEPS:07d}" / "__1_0.distcp"
    if first.code != 0 or not newest.is_file():
        sample.update(base_sample(first))
        sample["note"] = f"the clean run failed or left no {newest.name}"
        return sample
    newest.write_bytes(flip_middle_byte(newest.read_bytes()))
    resumed = Launch(work, resume_args(work)).finish()
    sample.update(base_sample(resumed))
    sample["leftovers"] = first.left + resumed.left
    if not resumed.timed_out:
        sample["time_s"] = resumed.wall_s
    warnings = [line for line in nonempty_lines(resumed.stderr) if "resuming from" in line]
    sample["warning"] = warnings[0] if warnings else None
    sample["losses_equal_reference"] = losses(work / "run") == ctx["reference_losses"]
    return sample


def run_nan(work: Path, ctx: dict[str, Any]) -> Sample:
    """Scenario 9: the loss of rank 1 becomes NaN in step 5 (0-based); wall time of the run."""
    fault = "nan@forward:step=5:rank=1"
    outcome = Launch(work, train_args(work), fault_env(work, fault)).finish()
    sample = base_sample(outcome)
    if not outcome.timed_out:
        sample["time_s"] = outcome.wall_s
    path = work / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    sample["skipped_steps"] = [r["step"] for r in records if r.get("nonfinite_skipped")]
    sample["skipped_records"] = [i + 1 for i, r in enumerate(records) if r.get("nonfinite_skipped")]
    sample["metrics_records"] = len(records)
    return sample


@dataclass
class Scenario:
    key: str
    title: str
    timed: str  # what the time column measures
    run: Callable[[Path, dict[str, Any]], Sample]
    check: Callable[[Sample, dict[str, Any]], list[str]]  # surprises in one sample
    details: Callable[[list[Sample]], list[str]] = lambda samples: []


def _expect(cond: bool, text: str) -> list[str]:
    return [] if cond else [text]


def _check_kill(rank: int) -> Callable[[Sample, dict[str, Any]], list[str]]:
    def check(s: Sample, ctx: dict[str, Any]) -> list[str]:
        msg = f"rank {rank} failed: killed — out of memory? (SIGKILL"
        out = _expect(s["exit_code"] == 1, f"exit code {s['exit_code']}, expected 1")
        out += _expect(msg in s["stderr_last"], f"last stderr line lacks {msg!r}")
        out += _expect(s.get("fault_time") is not None, "no fault log line")
        t = s["time_s"]
        out += _expect(t is None or t < TIMEOUT_S + 10, f"took {t:.1f} s (>= timeout_s + 10)")
        if "latest_step_after" in s:
            out += _expect(
                s["latest_step_after"] == 4, f"latest_step {s['latest_step_after']}, expected 4"
            )
        return out

    return check


def _check_hang(s: Sample, ctx: dict[str, Any]) -> list[str]:
    out = _expect(s["exit_code"] == 1, f"exit code {s['exit_code']}, expected 1")
    out += _expect(bool(s.get("rank1_pids")), "rank-1 worker not found")
    pids = s.get("rank1_pids") or []
    out += _expect(len(pids) <= 1, f"several rank-1 worker pids {pids}")
    # The survivor stops at the collective timeout; the launcher then waits out torch elastic's
    # 30 s grace period for the stopped rank (it cannot act on SIGTERM) before SIGKILL.
    survivor = s.get("rank0_exit_after_s")
    out += _expect(
        survivor is None or abs(survivor - TIMEOUT_S) < 5,
        f"survivor stopped after {survivor} s, expected ~{TIMEOUT_S} s",
    )
    t = s["time_s"]
    bound = TIMEOUT_S + ELASTIC_GRACE_S + 5
    out += _expect(t is None or t < bound, f"took {t:.1f} s, expected < {bound} s")
    out += _expect(
        "out of memory" not in s["stderr_last"],
        "the last line blames SIGKILL ('out of memory?') on the rank the drill only stopped",
    )
    return out


def _check_int(s: Sample, ctx: dict[str, Any]) -> list[str]:
    out = _expect(s["exit_code"] == 130, f"exit code {s['exit_code']}, expected 130")
    out += _expect(
        s.get("stderr_all") == ["phalanx: interrupted"], f"stderr was {s.get('stderr_all')}"
    )
    t = s["time_s"]
    out += _expect(t is None or t < 10, f"took {t:.1f} s (>= 10 s)")
    return out


def _check_term(s: Sample, ctx: dict[str, Any]) -> list[str]:
    out = _expect(s["exit_code"] == 143, f"exit code {s['exit_code']}, expected 143")
    out += _expect("preempted (SIGTERM): checkpoint at step" in s["stderr_last"], "no preempt line")
    out += _expect(s.get("checkpoint_step") is not None, "no checkpoint after SIGTERM")
    out += _expect(s.get("resume_exit_code") == 0, f"resume exit {s.get('resume_exit_code')}")
    out += _expect(s.get("losses_equal_reference") is True, "resumed losses != reference")
    return out


def _check_restart(s: Sample, ctx: dict[str, Any]) -> list[str]:
    out = _expect(s["exit_code"] == 0, f"exit code {s['exit_code']}, expected 0")
    out += _expect(
        s.get("stderr_names_rank1") is True,
        "stderr never announces the restart",
    )
    out += _expect(s.get("losses_equal_reference") is True, "losses != reference")
    return out


def _check_corrupt(s: Sample, ctx: dict[str, Any]) -> list[str]:
    out = _expect(s["exit_code"] == 0, f"resume exit code {s['exit_code']}, expected 0")
    out += _expect(
        "resuming from step-0000008" in (s.get("warning") or ""), f"warning: {s.get('warning')}"
    )
    out += _expect(s.get("losses_equal_reference") is True, "losses != reference")
    return out


def _check_nan(s: Sample, ctx: dict[str, Any]) -> list[str]:
    out = _expect(s["exit_code"] == 0, f"exit code {s['exit_code']}, expected 0")
    out += _expect(s.get("skipped_steps") == [5], f"skipped steps {s.get('skipped_steps')}")
    out += _expect(s.get("skipped_records") == [5], f"skipped records {s.get('skipped_records')}")
    return out


def _values(samples: list[Sample], key: str) -> str:
    return counted(s.get(key) for s in samples)


def _warning_unless_last(samples: list[Sample]) -> list[str]:
    """The resume warning, when it is not already the last stderr line the row shows."""
    first = samples[0] if samples else {}
    warning = first.get("warning")
    return [] if warning == first.get("stderr_last") else [f"warning: {warning}"]


def _secs(samples: list[Sample], key: str) -> str:
    """A per-sample number of seconds as 'median [min-max]'."""
    got = summarize(s.get(key) for s in samples)
    if not got["n"]:
        return "n/a"
    return f"{got['median']:.2f} s [{got['min']:.2f}-{got['max']:.2f}]"


SCENARIOS = [
    Scenario("1", "kill -9 rank 1 in forward (step 5)", "fault → launcher exit",
             lambda w, c: run_kill(w, "kill@forward:step=5:rank=1", c), _check_kill(1)),
    Scenario("2", "kill -9 rank 1 in the exchange (step 5)", "fault → launcher exit",
             lambda w, c: run_kill(w, "kill@exchange:step=5:rank=1", c), _check_kill(1)),
    Scenario("3", "kill -9 rank 0 writing checkpoint 8", "fault → launcher exit",
             lambda w, c: run_kill(w, "kill@checkpoint:step=8:rank=0", c), _check_kill(0),
             lambda ss: [f"newest checkpoint afterwards: step {_values(ss, 'latest_step_after')}"]),
    Scenario("4", "rank 1 hangs (SIGSTOP after 3 steps)", "SIGSTOP → launcher exit",
             run_hang, _check_hang,
             lambda ss: [f"rank 0 worker exited {_secs(ss, 'rank0_exit_after_s')} after SIGSTOP"]),
    Scenario("5", "Ctrl-C (SIGINT to launcher after 2 steps)", "signal → launcher exit",
             lambda w, c: run_signal(w, signal.SIGINT, c), _check_int,
             lambda ss: [f"non-empty stderr lines: {_values(ss, 'stderr_lines')}",
                         f"metrics lines at signal: {_values(ss, 'lines_at_signal')}"]),
    Scenario("6", "preemption (SIGTERM to launcher after 2 steps), then --resume",
             "signal → launcher exit", lambda w, c: run_signal(w, signal.SIGTERM, c), _check_term,
             lambda ss: [f"metrics lines at signal: {_values(ss, 'lines_at_signal')}",
                         f"checkpoint at step {_values(ss, 'checkpoint_step')}",
                         f"resume exit {_values(ss, 'resume_exit_code')}",
                         f"losses == reference: {_values(ss, 'losses_equal_reference')}"]),
    Scenario("7", "--max-restarts 1, kill -9 rank 1 in forward (step 6)", "whole run wall time",
             run_restart, _check_restart,
             lambda ss: [f"losses == reference: {_values(ss, 'losses_equal_reference')}",
                         f"restart announced: {_values(ss, 'stderr_names_rank1')}",
                         f"reference run wall {_secs(ss, 'reference_wall_s')}"]),
    Scenario("8", "newest checkpoint corrupted (1 byte), then --resume", "resume wall time",
             run_corrupt, _check_corrupt,
             lambda ss: [f"losses == reference: {_values(ss, 'losses_equal_reference')}",
                         *_warning_unless_last(ss)]),
    Scenario("9", "NaN loss on rank 1 in step 5", "whole run wall time",
             run_nan, _check_nan,
             lambda ss: [f"steps with nonfinite_skipped: {_values(ss, 'skipped_steps')}",
                         f"non-empty stderr lines: {_values(ss, 'stderr_lines')}"]),
]  # fmt: skip


# -- report ----------------------------------------------------------------------------------
def machine_facts() -> dict[str, Any]:
    try:
        nproc = subprocess.run(
            ["nproc"], capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        nproc = "?"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nproc": nproc,
        "cpu_count": os.cpu_count(),
        "torch": importlib.metadata.version("torch"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def scenario_row(
    scenario: Scenario, samples: list[Sample], top: str = ""
) -> tuple[str, str, str, str]:
    last = [normalize(s["stderr_last"], top) or "(no stderr)" for s in samples]
    messages = last[0] if len(set(last)) == 1 else counted(last)
    details = [normalize(d, top) for d in scenario.details(samples)]
    did = "; ".join([f"exit {_values(samples, 'exit_code')}", f"“{messages}”", *details])
    times = format_time(summarize(s["time_s"] for s in samples), len(samples))
    with_left = [s for s in samples if s["leftovers"]]
    if with_left:
        pids = "; ".join(", ".join(s["leftovers"]) for s in with_left)
        left = f"{len(with_left)} of {len(samples)} runs: {pids} (killed by the drill)"
    else:
        left = "none"
    return (
        f"{scenario.key}. {scenario.title}",
        did,
        f"{times} ({scenario.timed})",
        left,
    )


def report(
    facts: dict[str, Any],
    reference: Sample,
    results: dict[str, list[Sample]],
    repeats: int,
    top: str = "",
) -> str:
    lines = ["## Machine", ""]
    lines += [f"- {key}: {value}" for key, value in facts.items()]
    lines += [
        f"- run: `python -m phalanx train {CONFIG} {' '.join(BASE)} --run-dir <tmp>`",
        f"- reference run (no fault, once): exit {reference['exit_code']}, "
        f"wall {reference['wall_s']:.2f} s",
        "",
        f"## Faults ({repeats} repeats each; <tmp> is the drill's temporary directory)",
        "",
        "| scenario | what phalanx did (exit code, message) | measured time (median [min-max]) "
        "| leftovers after 10 s |",
        "|---|---|---|---|",
    ]
    surprises = []
    by_key = {s.key: s for s in SCENARIOS}
    for key, samples in results.items():
        row = scenario_row(by_key[key], samples, top)
        lines.append("| " + " | ".join(md_cell(cell) for cell in row) + " |")
        for i, sample in enumerate(samples):
            for problem in sample.get("surprises", []):
                surprises.append(f"- scenario {key}, repeat {i + 1}: {problem}")
            if sample["leftovers"]:
                surprises.append(f"- scenario {key}, repeat {i + 1}: left {sample['leftovers']}")
    lines += ["", "## Not as expected", ""]
    lines += surprises or ["- nothing: every sample met its expectation"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per scenario (default 3)")
    parser.add_argument("--json", type=Path, help="write every raw number here")
    parser.add_argument("--only", default="", help="comma-separated scenario numbers (default all)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary run directories")
    args = parser.parse_args(argv)
    wanted = [s for s in SCENARIOS if not args.only or s.key in args.only.split(",")]
    facts = machine_facts()
    top = Path(tempfile.mkdtemp(prefix="fault_drill-"))
    ctx: dict[str, Any] = {}
    started = time.monotonic()
    try:
        log(f"reference run (work dir {top})")
        ref_work = top / "reference"
        ref_work.mkdir()
        ref = Launch(ref_work, train_args(ref_work)).finish()
        reference = base_sample(ref)
        ctx["reference_losses"] = losses(ref_work / "run")
        ctx["reference_wall_s"] = ref.wall_s
        reference["losses"] = ctx["reference_losses"]
        if ref.code != 0:
            log(f"reference run failed: exit {ref.exit}: {last_line(ref.stderr)}")
        results: dict[str, list[Sample]] = {s.key: [] for s in wanted}
        for repeat in range(args.repeats):
            for scenario in wanted:
                work = top / f"s{scenario.key}-r{repeat}"
                work.mkdir()
                t0 = time.monotonic()
                sample = scenario.run(work, ctx)
                sample["surprises"] = scenario.check(sample, ctx)
                results[scenario.key].append(sample)
                t = sample["time_s"]
                log(
                    f"scenario {scenario.key} repeat {repeat + 1}/{args.repeats}: "
                    f"exit {sample['exit_code']}, time {'n/a' if t is None else f'{t:.2f} s'}, "
                    f"{time.monotonic() - t0:.0f} s in all; {sample['stderr_last']!r}"
                    + (f"; NOT AS EXPECTED: {sample['surprises']}" if sample["surprises"] else "")
                )
    finally:
        if not args.keep:
            shutil.rmtree(top, ignore_errors=True)
    facts["drill_wall_s"] = round(time.monotonic() - started, 1)
    print(report(facts, reference, results, args.repeats, str(top)))
    if args.json:
        summary = {k: summarize(s["time_s"] for s in v) for k, v in results.items()}
        payload = {
            "machine": facts,
            "repeats": args.repeats,
            "command": ["python", "-m", "phalanx", "train", CONFIG, *BASE],
            "reference": reference,
            "scenarios": {
                s.key: {"title": s.title, "timed": s.timed, "summary": summary[s.key],
                        "samples": results[s.key]}
                for s in wanted
            },
        }  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
