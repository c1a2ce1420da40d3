"""``phalanx bench strategy-memory``'s formula and the targets of ``partitioned`` (issue 46), on
fabricated numbers: what each strategy keeps of the optimizer state per rank, when a target
passes, and what a miss says; the reports print them."""

from __future__ import annotations

import pytest

from phalanx.bench import port
from phalanx.bench.port import speed_target
from phalanx.bench.strategy_memory import (
    StrategyMemoryConfig,
    format_table,
    formula_saving,
    formula_state,
    memory_target,
)
from phalanx.errors import ConfigError

MIB = 2**20


def test_the_formula_keeps_the_state_where_docs_exchange_says() -> None:
    assert formula_state("ddp", 2, 100.0) == [100.0, 100.0]
    assert formula_state("allreduce", 3, 90.0) == [90.0] * 3
    # cyclic: floor(p/2) owners 0, 2, ...: at p = 2 and 3 rank 0 owns every partition
    assert formula_state("partitioned", 2, 100.0) == [100.0, 0.0]
    assert formula_state("partitioned", 3, 90.0) == [90.0, 0.0, 0.0]
    assert formula_state("partitioned", 4, 100.0) == [50.0, 0.0, 50.0, 0.0]
    assert formula_state("partitioned", 5, 100.0) == [50.0, 0.0, 50.0, 0.0, 0.0]
    for kind in ("partitioned-native", "ps", "fsdp"):
        assert formula_state(kind, 3, 90.0) == [30.0] * 3
    assert formula_saving("partitioned", 2, 50.0, 100.0) == [0.0, 100.0]
    assert formula_saving("ps", 2, 50.0, 100.0) == [50.0, 50.0]
    # fsdp also keeps 1/p of the parameters and of the gradients
    assert formula_saving("fsdp", 2, 50.0, 100.0) == [100.0, 100.0]


def test_the_speed_target_passes_within_3_percent_and_says_by_how_much_it_misses() -> None:
    assert speed_target(1.0).passed and speed_target(1.03).passed
    assert speed_target(0.9).text.startswith("PASS: step time 0.900x DDP's (limit 1.03x)")
    miss = speed_target(1.08)
    assert not miss.passed and miss.measured == 1.08 and miss.limit == 1.03
    assert miss.text.startswith("MISS by 5.0% of DDP's step time: step time 1.080x")
    assert "two synchronisations a step" in miss.text and "floor(p/2) owners" in miss.text
    assert "floor(p/2)" not in speed_target(1.08, cyclic=False).text


def test_the_memory_target_is_80_percent_of_the_states_p_minus_1_over_p_share() -> None:
    state = 400 * MIB  # at p = 2: 80% of 200 MiB = 160 MiB to save on the busiest rank
    passed = memory_target(1000 * MIB, 840 * MIB, state, 2, formula_busiest=200 * MIB)
    assert passed.passed and passed.limit == 160 * MIB and passed.measured == 160 * MIB
    assert passed.text.startswith("PASS: busiest rank 160 MiB below DDP's, needed 160 MiB")
    # cyclic at p = 2: rank 0 keeps all of it, the formula itself cannot save enough
    cyclic = memory_target(1000 * MIB, 930 * MIB, state, 2, formula_busiest=state)
    assert not cyclic.passed
    assert cyclic.text.startswith("MISS by 90 MiB: busiest rank 70 MiB below DDP's")
    assert "keeps 100% of the state (cyclic: floor(p/2) = 1 owner(s) at p = 2)" in cyclic.text
    short = memory_target(1000 * MIB, 900 * MIB, 300 * MIB, 3, formula_busiest=100 * MIB)
    assert not short.passed and short.text.startswith("MISS by 60 MiB")
    assert "the formula saves enough" in short.text


def _row(peak: list[float], step: float) -> dict:
    n = len(peak)
    per_rank = {"end": peak, "held": peak, "step_s": [step] * n, "vs_ddp": [1.0] * n}
    formula = {"saving": [0.0] * n, "formula_state": [MIB] * n, "formula_saving": [0.0] * n}
    return {"peak": peak, "total": peak, **per_rank, **formula, "step_vs_ddp": 1.0}


def test_the_report_prints_every_world_and_the_targets() -> None:
    cfg = StrategyMemoryConfig(model="mlp", worlds=(2, 3))
    meta = {"config": vars(cfg) | {"worlds": [2, 3]}, "param_bytes": MIB, "state_bytes": 2 * MIB}
    verdicts = {"memory": memory_target(10 * MIB, 9 * MIB, 2 * MIB, 2, 2 * MIB)._asdict(),
                "speed": speed_target(1.2)._asdict()}  # fmt: skip
    worlds = {
        str(w): {
            "rows": {"ddp": _row([10 * MIB] * w, 0.5), "partitioned": _row([9 * MIB] * w, 0.6)},
            "targets": {"partitioned": verdicts},
        }
        for w in (2, 3)
    }
    table = format_table({"meta": meta, "worlds": worlds})
    assert "MLP script (3 Linear layers of 4096), AdamW" in table
    assert "world 2:" in table and "world 3:" in table and "10/10/10" in table
    assert "target, partitioned, memory: PASS" in table
    assert "target, partitioned, speed on this script: MISS by 17.0%" in table


def test_the_port_bench_prints_the_speed_target() -> None:
    rows = {"ddp": {"seconds": [1.0, 1.0, 1.0], "tokens_per_s": 1.0},
            "partitioned": {"seconds": [1.1, 1.0, 1.05], "tokens_per_s": 1.0, "vs_ddp": 0.95,
                            "ratio_iqr": (0.9, 1.0)}}  # fmt: skip
    cfg = {"num_layers": 2, "width": 8, "vocab": 8, "batch_size": 1, "seq_len": 4, "rounds": 3,
           "steps": 1, "single_rounds": 1, "single_steps": 1, "nproc": 2}  # fmt: skip
    table = port.format_table({"meta": {"config": cfg}, "rows": rows})
    assert "target, partitioned, speed: MISS by 2.0% of DDP's step time: step time 1.050x" in table


def test_worlds_and_model_are_checked_in_one_line() -> None:
    assert StrategyMemoryConfig(worlds=(2, 3)).nproc == 3
    with pytest.raises(ConfigError, match=r"--worlds: each must be >= 1"):
        StrategyMemoryConfig(worlds=(0,)).validate()
    with pytest.raises(ConfigError, match=r"--model: unknown 'gpt'; known: resnet, mlp"):
        StrategyMemoryConfig(model="gpt").validate()
    StrategyMemoryConfig(contenders=("ddp", "partitioned-native", "fsdp")).validate()
