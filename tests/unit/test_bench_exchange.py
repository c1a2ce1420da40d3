"""``phalanx bench exchange``: result structure, JSON output, errors. No timing assertions."""

from __future__ import annotations

import json
import math

import pytest

from phalanx.bench import exchange as bench
from phalanx.cli import main
from phalanx.errors import ConfigError, WorkerError


def _positive(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.mark.slow  # spawns processes: not in make test-fast
def test_two_ranks_digits_json(tmp_path, capsys):
    """One real spawned run (2 ranks, tiny): every number positive and finite, JSON written."""
    path = tmp_path / "out" / "bench.json"
    argv = ["bench", "exchange", "--nproc", "2", "--models", "digits_cnn", "--steps", "2"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--rounds", "2", "--warmup", "1", "--json", str(path)])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "digits_cnn" in printed and "vs ddp" in printed and "torch" in printed

    result = json.loads(path.read_text(encoding="utf-8"))
    assert result["meta"]["backend"] == "gloo" and result["meta"]["config"]["nproc"] == 2
    (model,) = result["models"]
    assert model["model"] == "digits_cnn" and model["params"] > 0 and model["rounds"] == 2
    contenders = model["contenders"]
    assert list(contenders) == ["single", "ddp", "phalanx"]
    for c in contenders.values():
        assert len(c["samples_per_s"]) == 2 and len(c["seconds"]) == 2
        assert all(_positive(v) for v in c["samples_per_s"] + c["seconds"])
        assert _positive(c["median_samples_per_s"])
    for name in ("ddp", "phalanx"):
        assert _positive(contenders[name]["efficiency"])
    assert _positive(contenders["phalanx"]["median_vs_ddp"])
    stats = contenders["phalanx"]["median_step_stats"]
    assert _positive(stats["bytes_sent"]) and _positive(stats["step_s"])
    assert stats["exchange_s"] >= 0 and math.isfinite(stats["exchange_s"])


@pytest.mark.slow  # spawns processes: not in make test-fast
def test_worker_error_names_the_rank():
    """A contender failing inside the ranks is raised in the parent; nothing hangs."""
    bad = bench.ContenderSpec("bad", "phalanx", (("exchange", "no-such-strategy"),))
    cfg = bench.BenchConfig(
        nproc=2, models=("digits_cnn",), steps=1, rounds=1, warmup=0, contenders=(bad,)
    )
    with pytest.raises(WorkerError, match=r"rank [01] failed: ConfigError: .*no-such-strategy"):
        bench.run_benchmark(cfg)


def _fake_raw(seconds: dict[str, list[float]]) -> dict:
    rounds = [
        {n: {"seconds": s[i], "stats": {"exchange_s": 0.001, "bytes_sent": 2.0**20}}
         for n, s in seconds.items()}
        for i in range(len(seconds["single"]))
    ]  # fmt: skip
    for r in rounds:
        r["single"]["stats"] = r["ddp"]["stats"] = {}
    return {"model": "mlp", "params": 8_400_000, "steps": 10, "rounds": rounds}


def test_summarize_medians_efficiency_ratio():
    cfg = bench.BenchConfig(nproc=2, batch_size=4, rounds=3)
    raw = _fake_raw({"single": [1.0, 2.0, 1.0], "ddp": [1.0, 1.0, 4.0], "phalanx": [0.5, 1, 2]})
    out = bench.summarize(raw, cfg)["contenders"]
    assert out["single"]["samples_per_s"] == [40.0, 20.0, 40.0]
    assert out["ddp"]["samples_per_s"] == [80.0, 80.0, 20.0]
    assert out["ddp"]["efficiency"] == pytest.approx(80.0 / (2 * 40.0))
    assert out["phalanx"]["vs_ddp"] == [2.0, 1.0, 2.0]
    assert out["phalanx"]["median_vs_ddp"] == 2.0
    table = bench.format_table(
        {"meta": {**_meta(), "config": {"nproc": 2, "batch_size": 4, "rounds": 3}},
         "models": [bench.summarize(raw, cfg)]}
    )  # fmt: skip
    row = table.splitlines()[-1].split()
    assert row[:3] == ["mlp", "8.40M", "phalanx"] and row[5:7] == ["2.00x", "1.00-2.00"]


def _meta() -> dict:
    return {"date": "d", "torch": "t", "backend": "gloo", "threads_per_process": 1, "cpu_count": 2}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--models", "resnet9000"], "--models: unknown model 'resnet9000'"),
        (["--steps", "0"], "--steps: must be >= 1"),
        (["--nproc", "0"], "--nproc: must be >= 1"),
    ],
)
def test_bad_flags_exit_2_with_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "exchange", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_config_validation_direct():
    with pytest.raises(ConfigError, match="--rounds"):
        bench.BenchConfig(rounds=0).validate()


@pytest.mark.slow  # spawns processes: not in make test-fast
def test_strategies_axis(tmp_path, capsys):
    """--strategies adds one phalanx contender per strategy, each with its own counters."""
    path = tmp_path / "bench.json"
    argv = ["bench", "exchange", "--models", "digits_cnn", "--steps", "2", "--rounds", "1"]
    argv += ["--warmup", "1", "--strategies", "tree,partitioned-native,ps-star"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--json", str(path)])
    assert exit_info.value.code == 0
    contenders = json.loads(path.read_text())["models"][0]["contenders"]
    names = ["phalanx-tree", "phalanx-partitioned-native", "phalanx-ps-star"]
    assert list(contenders) == ["single", "ddp", *names]
    ddp_state = contenders["ddp"]["median_step_stats"]["optimizer_bytes"]
    native = contenders["phalanx-partitioned-native"]["median_step_stats"]
    assert 0 < native["optimizer_bytes"] < 0.6 * ddp_state  # about half on 2 ranks
    for name in names:
        assert _positive(contenders[name]["median_step_stats"]["bytes_sent"])


def test_unknown_strategy_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "exchange", "--strategies", "ring"])
    assert exit_info.value.code == 2
    assert "--strategies: unknown 'ring'; known: all, allreduce" in capsys.readouterr().err


def test_compressed_contenders_are_compared_with_the_fp16_hook():
    specs = bench.strategy_contenders(["allreduce"], ["none", "fp16"])
    names = [s.name for s in specs]
    assert names == ["single", "ddp", "ddp-fp16hook", "phalanx-none", "phalanx-fp16"]
    cfg = bench.BenchConfig(nproc=2, batch_size=4, rounds=3, contenders=specs)
    seconds = {
        "single": [1.0, 1.0, 1.0],
        "ddp": [1.0, 1.0, 1.0],
        "ddp-fp16hook": [2.0, 1.0, 1.0],
        "phalanx-none": [1.0, 1.0, 1.0],
        "phalanx-fp16": [1.0, 2.0, 1.0],
    }
    out = bench.summarize(_fake_raw(seconds), cfg)["contenders"]
    assert out["phalanx-fp16"]["vs_hook"] == [2.0, 0.5, 1.0]
    assert out["phalanx-fp16"]["median_vs_hook"] == 1.0
    assert "vs_hook" not in out["phalanx-none"] and "vs_hook" not in out["ddp"]
    table = bench.format_table(
        {"meta": {**_meta(), "config": {"nproc": 2, "batch_size": 4, "rounds": 3}},
         "models": [bench.summarize(_fake_raw(seconds), cfg)]}
    )  # fmt: skip
    assert "1.00x(0.50-2.00)" in table.splitlines()[-1]
