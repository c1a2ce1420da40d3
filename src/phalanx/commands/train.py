"""``phalanx train``: one process, a launched group of workers, or a worker of one; resume,
restarts, preemption, ``--dry-run``."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, cast

from phalanx import checkpoint
from phalanx.commands.auto_plan import auto_plan, predict_run
from phalanx.commands.common import EXIT_PREEMPTED, PROG
from phalanx.config import config_from_data, load_config, read_config, with_overrides
from phalanx.engine.guard import rescaling_problem
from phalanx.errors import Interrupted, PhalanxError
from phalanx.exchange.base import STRATEGIES, Strategy
from phalanx.fields import from_dict
from phalanx.memory import measure
from phalanx.memory.manager import MemoryConfig


def _add_launch_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=1, help="worker processes on this node")
    p.add_argument("--nnodes", type=int, default=1, help="number of machines")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of node 0")
    p.add_argument("--master-port", type=int, default=0, help="port on node 0 (0: pick one)")


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("train", help="train a model from a TOML config")
    p.add_argument("config", nargs="?", help="TOML config (optional with --resume)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR")
    p.add_argument(
        "--trace", metavar="DIR", help="write a Chrome trace of steps 2-4 to DIR/trace.json"
    )
    p.add_argument(
        "--run-dir", help="run directory (default: runs/<config>-<time>, -2, ... if taken)"
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="after a worker dies, restart the group up to N times; it resumes from the newest "
        "good checkpoint",
    )
    p.add_argument(
        "--stop-grace",
        type=int,
        default=30,
        metavar="S",
        help="when phalanx train itself gets SIGTERM or Ctrl-C: seconds the workers get to "
        "finish a step and write the preemption checkpoint before SIGKILL (after a worker "
        "failure torch elastic always waits 30 s for a worker that ignores SIGTERM)",
    )
    p.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    p.add_argument(
        "--auto-plan",
        action="store_true",
        help="let the planner pick the exchange (strategy, options, bucket size, compression) "
        "for this run's processes from this machine's cached calibration and a profile of the "
        "config; summary.json then holds its predicted step time beside the measured one",
    )
    p.add_argument(
        "--predict",
        action="store_true",
        help="let the planner predict this run's step time as configured (nothing changes), "
        "from the same calibration and profile; summary.json then holds it beside the "
        "measured one and the error",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config, the model and the layout; start nothing",
    )
    _add_launch_flags(p)
    p.set_defaults(handler=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    if args.config is None and args.resume is None:
        raise PhalanxError("train needs a CONFIG file or --resume RUN_DIR")
    data = with_overrides(
        read_config(args.config) if args.config is not None else _saved_config(Path(args.resume)),
        args.set,
    )
    _host_memory_first(data)
    config = config_from_data(data)
    if args.trace:
        config.trace.directory = args.trace
    in_worker = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    explicit = args.resume or args.run_dir or config.train.run_dir
    run_dir = Path(explicit or _default_run_dir(args))
    # a default directory is claimed before anything writes into it (a worker's ranks agree
    # on rank 0's instead: Trainer)
    unclaimed = not explicit and not in_worker
    world_size = int(os.environ["WORLD_SIZE"]) if in_worker else args.nproc * args.nnodes
    planning = getattr(args, "auto_plan", False), getattr(args, "predict", False)
    if any(planning) and not in_worker and not args.dry_run:
        flag = "--auto-plan" if planning[0] else "--predict"
        if all(planning):
            raise PhalanxError("--auto-plan already predicts the setup it picks; drop --predict")
        if args.resume:
            raise PhalanxError(f"{flag}: predicts a new run; drop it with --resume")
        run_dir, unclaimed = (_claim(run_dir) if unclaimed else run_dir), False
        if planning[0]:
            args.set = [*args.set, *auto_plan(config, world_size, run_dir)]  # workers get them
            config = load_config(args.config, args.set)
        else:
            predict_run(config, world_size, run_dir)
    config.check_world(world_size)  # before any process group work
    _check_rescaling(config)
    if args.dry_run:
        from phalanx.dryrun import describe_run

        print(describe_run(config, world_size, str(run_dir)))
        return 0
    run_dir = _claim(run_dir) if unclaimed else run_dir
    if args.resume and not in_worker:
        checkpoint.choose(run_dir / "checkpoints", warn=False)  # fail early; rank 0 warns
    if in_worker or (args.nproc == 1 and args.nnodes == 1):
        resume = bool(args.resume) or _restarted_with_checkpoint(run_dir)
        return _train_here(config, run_dir, resume, quiet=in_worker and _launched())
    return _train_launched(args, run_dir)


def _host_memory_first(data: dict) -> None:
    """Where the memory manager releases freed host memory, tensors of 2 MiB and more get huge
    pages. torch decides that at its first such block, and checking the config's layers (on
    the meta device) allocates one, so the ``[memory]`` table is read before the rest."""
    memory = from_dict(MemoryConfig, data.get("memory", {}), "memory")
    if memory.releases_host_memory:
        measure.huge_pages_for_large_tensors()


def _check_rescaling(config: Any) -> None:
    """Clipping and fp16 need a strategy that sees the whole gradient (the Engine's rule,
    checked before any worker starts)."""
    name = config.exchange.strategy
    problem = rescaling_problem(
        cast("type[Strategy]", STRATEGIES.get(name)).updates_during_exchange,  # a class
        f"exchange.strategy {name!r}",
        max_grad_norm=config.train.max_grad_norm,
        precision=config.train.precision,
        nonfinite=config.train.nonfinite,
    )
    if problem is not None:
        raise PhalanxError(f"train.{problem[0]}: {problem[1]}")


def _restarted_with_checkpoint(run_dir: Path) -> bool:
    """An elastic restart (--max-restarts) resumes from the newest good checkpoint, if any."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return restarts > 0 and checkpoint.latest_step(run_dir / "checkpoints") is not None


def _train_here(config: object, run_dir: Path, resume: bool, quiet: bool) -> int:
    from phalanx.trainer import Trainer

    trainer = Trainer(config, run_dir, resume=resume)  # type: ignore[arg-type]
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restarts and trainer.ctx.is_main:
        where = f"resuming from step {trainer.step}" if resume else "no checkpoint yet: from step 0"
        print(f"{PROG}: restart {restarts} after a worker failed: {where}", file=sys.stderr)
    try:
        summary = trainer.run()
        if trainer.memory is not None:  # checkpointed: the state in the tier stays there
            trainer.memory.discard_optimizer_state()
    finally:
        trainer.engine.close()  # its threads, hooks and memory tiers go now, not at exit
    if summary.get("preempted"):
        if trainer.ctx.is_main and not quiet:
            print(_preempted_line(summary), file=sys.stderr)
        return 0 if quiet else EXIT_PREEMPTED
    if trainer.ctx.is_main and not quiet:
        _print_summary(summary)
    return 0


def _preempted_line(summary: dict) -> str:
    run_dir = summary["run_dir"]
    return (
        f"{PROG}: preempted (SIGTERM): checkpoint at step {summary['steps']} in {run_dir}; "
        f"continue with: phalanx train --resume {run_dir}"
    )


def _preempted(run_dir: Path) -> dict | None:
    from phalanx.trainer import PREEMPTED

    path = run_dir / PREEMPTED
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _train_launched(args: argparse.Namespace, run_dir: Path) -> int:
    from phalanx.runtime.launch import LaunchSpec, launch

    keys = ("nproc", "nnodes", "node_rank", "master_addr", "master_port", "max_restarts", "debug")
    spec = LaunchSpec(**{k: getattr(args, k) for k in keys}, stop_grace_s=args.stop_grace)
    worker_args = ["train"] + ([args.config] if args.config else [])
    for item in args.set:
        worker_args += ["--set", item]
    worker_args += ["--trace", args.trace] if args.trace else []
    worker_args += ["--resume", str(run_dir)] if args.resume else ["--run-dir", str(run_dir)]
    os.environ["PHALANX_LAUNCHED"] = "1"
    try:
        launch(spec, ["-m", "phalanx", *worker_args])
    except Interrupted as e:
        preempted = _preempted(run_dir) if e.signum == signal.SIGTERM else None
        if preempted is None:
            raise
        print(_preempted_line(preempted), file=sys.stderr)
        return EXIT_PREEMPTED
    if (preempted := _preempted(run_dir)) is not None:  # a worker, not the launcher, got it
        print(_preempted_line(preempted), file=sys.stderr)
        return EXIT_PREEMPTED
    if args.node_rank == 0:
        _print_summary(json.loads((run_dir / "summary.json").read_text(encoding="utf-8")))
    return 0


def _launched() -> bool:
    return os.environ.get("PHALANX_LAUNCHED") == "1"


def _saved_config(run_dir: Path) -> dict:
    path = run_dir / "config.json"
    if not path.is_file():
        raise PhalanxError(f"--resume {run_dir}: no config.json there (not a run directory)")
    return json.loads(path.read_text(encoding="utf-8"))


def _default_run_dir(args: argparse.Namespace) -> str:
    stem = Path(args.config).stem if args.config else "run"
    return str(Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}")


def _claim(run_dir: Path) -> Path:
    """Create the default ``run_dir``, or the first free of ``-2``, ``-3``, ...: a sweep that
    starts several runs in one second would otherwise share one directory."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        candidate = run_dir if n == 1 else run_dir.with_name(f"{run_dir.name}-{n}")
        try:
            candidate.mkdir()  # atomic: each name goes to one process
            return candidate
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def _print_summary(summary: dict) -> None:
    extra = "".join(
        f"| {label} {summary[key]:.4f} "
        for key, label in (("val_loss", "loss"), ("val_perplexity", "perplexity"))
        if key in summary
    )
    print(
        f"final validation accuracy {summary['val_accuracy']:.4f} {extra}| "
        f"{summary['samples_per_s']:,.0f} samples/s on {summary['world_size']} process(es) | "
        f"{summary['steps']} steps | run directory {summary['run_dir']}"
    )
    _print_memory(summary)
    if "predicted_step_s" in summary:
        print(
            f"plan: predicted {summary['predicted_step_s'] * 1e3:.1f} ms per step, measured "
            f"{summary['measured_step_s'] * 1e3:.1f} ms ({summary['prediction_error']:+.0%})"
        )


def _print_memory(summary: dict) -> None:
    """The measured peak against the budget (a warning line when over it)."""
    peak, budget = summary.get("memory_peak_mb"), summary.get("memory_budget_mb")
    if peak is None or not budget:
        return
    of = summary.get("memory_peak_of", "resident")
    line = (
        f"memory: measured peak {peak:.1f} MiB above the start ({of}; "
        f"{summary['memory_start_mb']:.1f} MiB at the start), budget {budget:.1f} MiB"
    )
    print(line)
    if peak > budget:
        print(
            f"{PROG}: warning: the measured peak {peak:.1f} MiB is over memory.budget_mb "
            f"{budget:.1f} MiB: set a lower budget_mb to leave the plan more margin",
            file=sys.stderr,
        )
