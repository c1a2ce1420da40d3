"""``phalanx train --auto-plan``: before the workers start, the planner picks the exchange setup
for this run (strategy, options, fusion threshold, compression) at its number of processes,
from this machine's cached calibration and a profile of the config; the run then records the
predicted step time beside the measured one (``summary.json``), so the run is a validation
point of the planner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from phalanx.commands.plan import _strategies
from phalanx.errors import ConfigError
from phalanx.exchange.base import strategy_factory
from phalanx.fileio import atomic_write_text
from phalanx.guard import rescaling_problem
from phalanx.planner.calibrate import load_or_calibrate
from phalanx.planner.plan import make_plan, recommended_sets
from phalanx.planner.prediction import PREDICTION
from phalanx.planner.step import measure_step_profile


def auto_plan(config: Any, world_size: int, run_dir: Path) -> list[str]:
    """The ``--set`` items of the fastest setup the config can run at ``world_size``; writes
    ``run_dir/prediction.json`` and says the choice in one line."""
    if config.parallel.enabled:
        raise ConfigError(
            "--auto-plan: the planner does not model [parallel] pipeline > 1 yet; "
            "choose the exchange yourself (phalanx plan CONFIG)"
        )
    # phalanx train --nproc N starts its N workers on this host
    cluster = load_or_calibrate(False).cluster.on_one_host(world_size)
    cluster.check_devices(world_size)
    strategies = [s for s in _strategies(None, config.exchange) if _runnable(config, s[0])]
    profile = measure_step_profile(config, strategies=[name for name, _ in strategies])
    plan = make_plan(profile, cluster, [world_size], strategies)
    best = plan.best(world_size)
    if best is None or best.result is None:
        raise ConfigError("--auto-plan: the planner skipped every setup; see phalanx plan CONFIG")
    sets = recommended_sets(best)
    record = {
        "devices": world_size,
        "setup": best.setup.label(),
        "sets": sets,
        "predicted_step_s": best.result.step_s,
        "profile_spread": profile.spread,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / PREDICTION, json.dumps(record, indent=2) + "\n")
    print(
        f"auto-plan: {best.setup.label()} at {world_size} process(es), predicted "
        f"{best.result.step_s * 1e3:.1f} ms per step ({' '.join(sets)})"
    )
    return sets


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
