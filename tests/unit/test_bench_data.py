"""``phalanx bench data``: one tiny real run (structure and JSON), the preprocessing, bad flags.
No timing assertions."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from phalanx.bench import data as bench
from phalanx.cli import main


def _positive(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.mark.slow  # spawns processes: not in make test-fast
def test_tiny_run_writes_every_number(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["bench", "data", "--rounds", "2", "--batches", "2", "--batch-size", "8", "--warmup",
            "1", "--train-rounds", "1", "--train-steps", "2", "--contenders",
            "pipeline,dataloader-batched", "--json", str(path)]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    printed = capsys.readouterr().out
    assert "pipeline" in printed and "input wait" in printed and "digits_cnn" in printed

    result = json.loads(path.read_text())
    assert result["meta"]["config"]["contenders"] == ["pipeline", "dataloader-batched"]
    throughput = result["throughput"]
    assert set(throughput) == {"pipeline", "dataloader-batched"}
    for entry in throughput.values():
        assert len(entry["samples_per_s"]) == 2 and all(map(_positive, entry["samples_per_s"]))
    assert _positive(throughput["pipeline"]["median_vs_dataloader-batched"])
    assert [case["case"].split()[0] for case in result["training"]] == ["cnn", "digits_cnn"]
    for case in result["training"]:
        assert set(case["feeders"]) in ({"pipeline", "dataloader-batched"},
                                        {"pipeline", "dataloader"})  # fmt: skip
        for feeder in case["feeders"].values():
            assert 0.0 <= feeder["median_wait_fraction"] < 1.0
            assert _positive(feeder["median_step_ms"])


def test_per_sample_and_per_batch_preprocessing_agree():
    """Both forms crop, flip and normalise the same way (given the same draws)."""
    x = np.random.default_rng(0).integers(0, 256, (4, 3, 10, 10), dtype=np.uint8)
    batch = bench.augment_batch((torch.from_numpy(x), torch.arange(4)), np.random.default_rng(1), 6)
    draws = np.random.default_rng(1)
    offsets, flips = draws.integers(0, 5, size=(4, 2)), draws.random(4) < 0.5
    for k in range(4):
        i, j = offsets[k]
        window = x[k, :, i : i + 6, j : j + 6]
        window = window[:, :, ::-1] if flips[k] else window
        expected = (window.astype(np.float32) / 255 - bench.MEAN) / bench.STD
        np.testing.assert_allclose(batch[0][k].numpy(), expected, rtol=1e-5, atol=1e-5)
    one = bench.augment_sample(x[0], np.random.default_rng(2), 6)
    assert one.shape == (3, 6, 6) and one.dtype == np.float32


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [(["--workers", "0"], "--workers: must be >= 1"), (["--contenders", "x"], "unknown 'x'")],
)
def test_bad_flags_exit_2(flags, fragment, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "data", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1
