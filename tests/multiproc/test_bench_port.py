"""``phalanx bench port`` runs every contender and reports tokens/s and the ratios asked for
(the figures themselves are measured runs, in docs/benchmarks.md)."""

from __future__ import annotations

from phalanx.bench.port import PortBenchConfig, format_table, run_benchmark


def test_bench_port_reports_every_contender() -> None:
    cfg = PortBenchConfig(nproc=2, vocab=32, width=16, seq_len=8, batch_size=2, steps=1,
                          rounds=2, warmup=0, single_rounds=3, single_steps=1)  # fmt: skip
    result = run_benchmark(cfg)
    rows = result["rows"]
    assert set(rows) == {"ddp", "allreduce", "partitioned", "plain", "engine"}
    assert all(len(rows[k]["seconds"]) == 2 for k in ("ddp", "allreduce", "partitioned"))
    assert all(len(rows[k]["seconds"]) == 3 for k in ("plain", "engine"))
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    low, high = rows["engine"]["ratio_iqr"]
    assert low <= rows["engine"]["vs_plain"] <= high
    assert {"vs_ddp"} <= set(rows["allreduce"]) and "vs_plain" in rows["engine"]
    table = format_table(result)
    assert "x ddp" in table and "x plain" in table
