"""TensorBoard scalars beside metrics.jsonl, and ``phalanx plot``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.errors import DataError
from phalanx.metrics import MetricsWriter, plot_runs


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_records_become_grouped_scalars(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path)
    writer.write({"step": 1, "loss": 2.5, "lr": 0.1, "backward_s": 0.01, "grad_norm": float("nan")})
    writer.write({"step": 2, "loss": 2.0, "lr": 0.05, "val_accuracy": 0.5, "note": "text"})
    writer.close()
    scalars = _scalars(tmp_path)
    assert scalars["train/loss"] == [(1, 2.5), (2, 2.0)]
    assert scalars["train/lr"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.05))]
    assert scalars["time/backward_s"] == [(1, pytest.approx(0.01))]
    assert scalars["val/accuracy"] == [(2, 0.5)]
    assert "train/grad_norm" not in scalars and "train/note" not in scalars  # nan, text


def _fake_run(directory: Path, num_steps: int) -> Path:
    directory.mkdir(parents=True)
    lines = [
        json.dumps({"step": s, "loss": 2.0 / s, "time_s": 0.01, **({"val_loss": 1.0 / s}
                   if s % 5 == 0 else {})})
        for s in range(1, num_steps + 1)
    ]  # fmt: skip
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (directory / "summary.json").write_text(json.dumps({"global_batch": 64}))
    return directory


def test_plot_writes_a_png_of_several_runs(tmp_path: Path) -> None:
    runs = [_fake_run(tmp_path / "a", 20), _fake_run(tmp_path / "b", 12)]
    output = tmp_path / "out" / "runs.png"
    plot_runs(runs, output)
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and output.stat().st_size > 10_000


def test_plot_names_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"{tmp_path}: no metrics.jsonl"):
        plot_runs([tmp_path], tmp_path / "x.png")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\nnot json\n')
    with pytest.raises(DataError, match="metrics.jsonl:2: not a JSON record"):
        plot_runs([bad], tmp_path / "x.png")
