"""What ``phalanx train --auto-plan`` predicted for a run (``prediction.json`` in its run
directory) and how the run's measured step compares (``summary.json``)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

PREDICTION = "prediction.json"


def prediction_summary(run_dir: Path, step_times: list[float]) -> dict[str, float]:
    """``summary.json``'s predicted vs measured step (median of the timed steps, the first
    few left out), where ``--auto-plan`` predicted this run; {} otherwise."""
    path = run_dir / PREDICTION
    timed = step_times[len(step_times) // 5 :]  # warm-up (allocator, caches, auto layout)
    if not path.is_file() or not timed:
        return {}
    predicted = float(json.loads(path.read_text(encoding="utf-8"))["predicted_step_s"])
    measured = statistics.median(timed)
    return {
        "predicted_step_s": predicted,
        "measured_step_s": measured,
        "prediction_error": predicted / measured - 1.0,
    }
