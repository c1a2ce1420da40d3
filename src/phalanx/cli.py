"""The ``phalanx`` command: ``train``, ``bench``.

User mistakes print one line and exit with code 2 (``--debug`` shows the traceback); a failed
worker exits 1 with the rank and its error.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from phalanx.errors import Interrupted, PhalanxError, WorkerError
from phalanx.fileio import atomic_write_text

PROG = "phalanx"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
EXIT_PREEMPTED = 143  # 128 + SIGTERM
_interrupted = False  # a worker got SIGINT: it exits quietly (the launcher prints the line)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        sys.exit(2)
    sys.exit(_run_guarded(args.handler, args))


def _run_guarded(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    in_worker = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if in_worker:
        signal.signal(signal.SIGINT, _on_worker_sigint)
    try:
        return handler(args)
    except Interrupted as e:
        if e.signum == signal.SIGINT:
            print(f"{PROG}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        print(f"{PROG}: {e}", file=sys.stderr)
        return 128 + e.signum
    except (PhalanxError, ValueError) as e:
        if _interrupted:
            return EXIT_INTERRUPTED
        if args.debug:
            raise
        _report(e, in_worker)
        return 1 if isinstance(e, WorkerError) else 2
    except KeyboardInterrupt:
        if not in_worker:
            print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        if _interrupted:  # e.g. a peer that stopped first: part of the interrupt, not an error
            return EXIT_INTERRUPTED
        if args.debug or not in_worker:
            raise
        _report(e, in_worker)
        return 1


def _on_worker_sigint(signum: int, frame: Any) -> None:
    """Ctrl-C reaches every worker through the launcher: stop now, say nothing."""
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def _report(error: BaseException, in_worker: bool) -> None:
    from phalanx.runtime.launch import PEER_LOSS

    message = str(error) if isinstance(error, PhalanxError) else f"{type(error).__name__}: {error}"
    if in_worker:  # the launcher reads this file to name the rank and the error
        _record_for_launcher(error)
        if any(p in message.lower() for p in PEER_LOSS):  # a consequence: keep it short
            message = "lost its connection to a peer (the launcher names the rank that failed)"
        print(f"{PROG}: rank {os.environ['RANK']}: {message}", file=sys.stderr)
    else:
        print(f"{PROG}: error: {message}", file=sys.stderr)


def _record_for_launcher(error: BaseException) -> None:
    """Write the error file torch elastic's agent reads (``TORCHELASTIC_ERROR_FILE``, the
    format of its ``ErrorHandler.record_exception``), atomically: a worker the launcher stops
    while it writes must not leave half a file, which the agent fails to parse (the launcher
    then died with a JSONDecodeError instead of naming the rank)."""
    import traceback

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": f"{type(error).__name__}: {error}",
            "extraInfo": {
                "py_callstack": traceback.format_exc(),
                "timestamp": str(int(time.time())),
            },
        }
    }
    atomic_write_text(Path(path), json.dumps(data))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_train(commands)
    _add_config(commands)
    _add_plot(commands)
    _add_export(commands)
    _add_profile(commands)
    _add_bench(commands)
    _add_plan(commands)
    from phalanx.data import cli_data

    cli_data.add_arguments(commands.add_parser("data", help="pack and inspect record stores"))
    return parser


def _add_launch_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=1, help="worker processes on this node")
    p.add_argument("--nnodes", type=int, default=1, help="number of machines")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of node 0")
    p.add_argument("--master-port", type=int, default=0, help="port on node 0 (0: pick one)")


def _add_train(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("train", help="train a model from a TOML config")
    p.add_argument("config", nargs="?", help="TOML config (optional with --resume)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR")
    p.add_argument(
        "--trace", metavar="DIR", help="write a Chrome trace of steps 2-4 to DIR/trace.json"
    )
    p.add_argument("--run-dir", help="run directory (default: runs/<config>-<time>)")
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
        "--dry-run",
        action="store_true",
        help="print the resolved config, the model and the layout; start nothing",
    )
    _add_launch_flags(p)
    p.set_defaults(handler=cmd_train)


def _add_config(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("config", help="inspect configs")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="print a config with every default filled in")
    show.add_argument("config", help="TOML config")
    show.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    show.set_defaults(handler=cmd_config_show)


def _add_plot(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("plot", help="loss, validation and throughput curves of runs (PNG)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to compare")
    p.add_argument("-o", "--output", default="runs.png", help="PNG to write (default runs.png)")
    p.set_defaults(handler=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    from phalanx.viz import plot_runs

    plot_runs([Path(d) for d in args.run_dirs], Path(args.output))
    print(f"wrote {args.output}")
    return 0


def _add_export(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("export", help="a run's model weights as safetensors")
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory")
    p.add_argument("-o", "--output", default="model.safetensors", help="file to write")
    p.set_defaults(handler=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from phalanx.export import export_weights

    step, count = export_weights(Path(args.run_dir), Path(args.output))
    print(f"wrote {args.output}: {count} tensors from the step-{step} checkpoint")
    return 0


def _add_profile(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "profile", help="per-layer time and memory of a config's first steps, on one process"
    )
    p.add_argument("config", help="TOML config")
    p.add_argument("--steps", type=int, default=3, metavar="N", help="steps (first: warm-up)")
    p.add_argument("--json", metavar="FILE", help="write the profile as JSON (for the planner)")
    p.add_argument("--plot", metavar="PNG", help="memory over one step by category (viz extra)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda[:N]")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    p.set_defaults(handler=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    from phalanx import build
    from phalanx.config import load_config
    from phalanx.memory import profile as memory

    config = load_config(args.config, args.set)
    if args.plot:
        memory.require_matplotlib()  # fail before the run, not after it
    profile = build.profile_run(config, steps=args.steps, device=args.device)
    print(memory.format_profile(profile))
    if args.json:
        profile.save(Path(args.json))
        print(f"wrote {args.json}")
    if args.plot:
        memory.plot_profile(profile, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    from phalanx.config import load_config

    print(json.dumps(load_config(args.config, args.set).to_dict(), indent=2))
    return 0


def _version() -> str:
    """phalanx's version and the torch it runs on, without importing torch."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    from phalanx import __version__

    return f"{PROG} {__version__} (torch {torch_version})"


def _add_plan(commands: argparse._SubParsersAction) -> None:
    from phalanx.planner import plan

    plan.add_arguments(
        commands.add_parser("plan", help="predict step time and speed-up at N devices")
    )


def _add_bench(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("bench", help="benchmarks against the PyTorch baseline")
    targets = p.add_subparsers(dest="target", metavar="TARGET", required=True)
    from phalanx.bench import exchange

    exchange.add_arguments(targets.add_parser("exchange", help="phalanx Engine vs torch DDP"))
    from phalanx.bench import rnn

    rnn.add_arguments(targets.add_parser("rnn", help="LSTM tokens/s: DDP, Engine, WorkerPool"))
    from phalanx.bench import data

    data.add_arguments(targets.add_parser("data", help="input Pipeline vs torch DataLoader"))
    from phalanx.bench import link

    link.add_arguments(targets.add_parser("link", help="link latency/bandwidth and threshold"))
    from phalanx.bench import pipeline

    pipeline.add_arguments(
        targets.add_parser("pipeline", help="pipeline schedules vs torch.distributed.pipelining")
    )
    from phalanx.bench import memory

    memory.add_arguments(
        targets.add_parser("memory", help="offload/recompute plan vs checkpoint, save_on_cpu")
    )
    from phalanx.bench import optimizer

    optimizer.add_arguments(
        targets.add_parser("optimizer", help="optimizer state in memory vs in the spill file")
    )
    from phalanx.bench import port

    port.add_arguments(targets.add_parser("port", help="a user's GPT script: DDP vs Engine"))
    from phalanx.bench import planner

    planner.add_arguments(
        targets.add_parser("planner", help="the planner's predicted step time vs measured here")
    )


def cmd_train(args: argparse.Namespace) -> int:
    from phalanx import checkpoint
    from phalanx.config import config_from_data, load_config

    if args.config is None and args.resume is None:
        raise PhalanxError("train needs a CONFIG file or --resume RUN_DIR")
    if args.config is not None:
        config = load_config(args.config, args.set)
    else:
        config = config_from_data(_saved_config(Path(args.resume)), args.set)
    if args.trace:
        config.trace.directory = args.trace
    run_dir = Path(args.resume or args.run_dir or config.train.run_dir or _default_run_dir(args))
    in_worker = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if in_worker else args.nproc * args.nnodes
    config.check_world(world_size)  # before any process group work
    _check_rescaling(config)
    if args.dry_run:
        from phalanx.dryrun import describe_run

        print(describe_run(config, world_size, str(run_dir)))
        return 0
    if args.resume and not in_worker:
        checkpoint.choose(run_dir / "checkpoints", warn=False)  # fail early; rank 0 warns
    if in_worker or (args.nproc == 1 and args.nnodes == 1):
        resume = bool(args.resume) or _restarted_with_checkpoint(run_dir)
        return _train_here(config, run_dir, resume, quiet=in_worker and _launched())
    return _train_launched(args, run_dir)


def _check_rescaling(config: Any) -> None:
    """Clipping and fp16 need a strategy that sees the whole gradient (one-line error before
    any worker starts; the Engine applies the same rule)."""
    from phalanx.engine import rescaling_problem
    from phalanx.exchange.base import STRATEGIES, Strategy

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
    from phalanx import checkpoint

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

    spec = LaunchSpec(
        nproc=args.nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        stop_grace_s=args.stop_grace,
        debug=args.debug,
    )
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
