"""``phalanx train --auto-plan`` / ``--predict``: before the workers start, the planner predicts
this run's step at its number of processes from this machine's cached calibration and a profile
of the config. ``--auto-plan`` picks the exchange setup (strategy, options, fusion threshold,
compression) it predicts fastest; ``--predict`` predicts the config's own setup and changes
nothing. Either way the run then records the predicted step time beside the measured one
(``summary.json``), so the run is a validation point of the planner.

The prediction is optional: where it cannot be made (no calibration, a profile or probe that
fails on a loaded machine), one warning line says so and the run goes on as configured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from phalanx.commands.plan import _strategies
from phalanx.engine.guard import rescaling_problem
from phalanx.errors import ConfigError
from phalanx.exchange.base import strategy_factory
from phalanx.fileio import atomic_write_text
from phalanx.optional import optional
from phalanx.planner.calibrate import load_or_calibrate, slowdown_now
from phalanx.planner.plan import make_plan, recommended_sets, threshold_of
from phalanx.planner.prediction import PREDICTION
from phalanx.planner.step import measure_step_profile

AGAIN = "phalanx plan CONFIG shows what the planner predicts (--debug: the traceback)"


def auto_plan(config: Any, world_size: int, run_dir: Path) -> list[str]:
    """The ``--set`` items of the fastest setup the config can run at ``world_size``; writes
    ``run_dir/prediction.json`` and says the choice in one line ([] and a warning line where
    the planner cannot choose)."""
    _check_plannable(config, "--auto-plan", "choose the exchange yourself")
    return optional(
        lambda: _choose(config, world_size, run_dir),
        [],
        what="--auto-plan: no setup chosen",
        instead="the config's own exchange setup used",
        again=AGAIN,
    )


def _choose(config: Any, world_size: int, run_dir: Path) -> list[str]:
    strategies = [s for s in _strategies(None, config.exchange) if _runnable(config, s[0])]
    plan = _plan(config, world_size, strategies)
    best = plan.best(world_size, choice=True)
    if best is None or best.result is None:
        raise ConfigError("the planner has no setup within 100% efficiency (or skipped every one)")
    sets = recommended_sets(best)
    _record(run_dir, best, plan.profile.spread, sets)
    print(
        f"auto-plan: {best.setup.label()} at {world_size} process(es), predicted "
        f"{best.result.step_s * 1e3:.1f} ms per step ({' '.join(sets)})"
    )
    return sets


def predict_run(config: Any, world_size: int, run_dir: Path) -> None:
    """Predict the config's own exchange setup at ``world_size`` (nothing changes); writes
    ``run_dir/prediction.json`` and says the prediction in one line (a warning line where the
    planner cannot predict)."""
    _check_plannable(config, "--predict", "drop --predict")
    optional(
        lambda: _predict(config, world_size, run_dir),
        None,
        what="--predict: no prediction",
        instead="the run goes on without one (no predicted_step_s in summary.json)",
        again=AGAIN,
    )


def _predict(config: Any, world_size: int, run_dir: Path) -> None:
    exchange = config.exchange
    strategies = [(exchange.strategy, dict(exchange.options))]
    plan = _plan(config, world_size, strategies, (threshold_of(exchange),), (exchange.compress,))
    row = plan.best(world_size)
    if row is None or row.result is None:
        why = plan.rows[0].skipped if plan.rows else "no setup"
        raise ConfigError(f"the planner cannot model this setup ({why})")
    _record(run_dir, row, plan.profile.spread, [])
    print(
        f"predict: {row.setup.label()} at {world_size} process(es), predicted "
        f"{row.result.step_s * 1e3:.1f} ms per step"
    )


def _check_plannable(config: Any, flag: str, fix: str) -> None:
    if config.parallel.enabled:
        raise ConfigError(f"{flag}: the planner does not model [parallel] pipeline > 1 yet; {fix}")


def _plan(config: Any, world_size: int, strategies: list, *grid: Any) -> Any:
    """The plan of ``strategies`` at ``world_size`` processes on this host (``phalanx train
    --nproc N`` starts its N workers here), from a profile of ``config``."""
    cluster = load_or_calibrate(False).cluster.on_one_host(world_size)
    cluster.check_devices(world_size)
    profile = measure_step_profile(config, strategies=[name for name, _ in strategies])
    cluster = slowdown_now(cluster)  # after the profile, as close to the run as it gets
    return make_plan(profile, cluster, [world_size], strategies, *grid)


def _record(run_dir: Path, row: Any, spread: float, sets: list[str]) -> None:
    record = {
        "devices": row.devices,
        "setup": row.setup.label(),
        "sets": sets,
        "predicted_step_s": row.result.step_s,
        "profile_spread": spread,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / PREDICTION, json.dumps(record, indent=2) + "\n")


def _runnable(config: Any, strategy: str) -> bool:
    """Whether the config's clipping, precision and guard work under ``strategy``."""
    return (
        rescaling_problem(
            strategy_factory(strategy).cls.updates_during_exchange,
            strategy,
            max_grad_norm=config.train.max_grad_norm,
            precision=config.train.precision,
            nonfinite=config.train.nonfinite,
        )
        is None
    )
