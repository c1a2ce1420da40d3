"""What ``phalanx train --auto-plan`` or ``--predict`` predicted for a run (``prediction.json``
in its run directory) and how the run's measured step compares (``summary.json``)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

PREDICTION = "prediction.json"


def prediction_summary(run_dir: Path, step_times: list[float]) -> dict[str, float]:
    """``summary.json``'s predicted vs measured step (median of the timed steps, the first
    few left out), where ``--auto-plan`` or ``--predict`` predicted this run; {} otherwise."""
    path = run_dir / PREDICTION
    if not path.is_file() or not step_times:
        return {}
    predicted = float(json.loads(path.read_text(encoding="utf-8"))["predicted_step_s"])
    measured = measured_step_s(step_times)
    return {
        "predicted_step_s": predicted,
        "measured_step_s": measured,
        "prediction_error": predicted / measured - 1.0,
    }


def measured_step_s(step_times: list[float]) -> float:
    """A run's measured step: the median of its step times, the first fifth left out (warm-up:
    the allocator, caches, the auto threshold's layout). ``step_times`` must not be empty."""
    return statistics.median(step_times[len(step_times) // 5 :])
