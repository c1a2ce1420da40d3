"""``phalanx bench fsdp`` runs every contender and reports step time, the ratio to torch's own
FSDP2 loop and the bytes per rank (the figures themselves are measured runs, in
docs/benchmarks.md)."""

from __future__ import annotations

from phalanx.bench.fsdp import KINDS, FsdpBenchConfig, format_table, run_benchmark


def test_bench_fsdp_reports_every_contender_and_sharded_bytes() -> None:
    cfg = FsdpBenchConfig(nproc=2, vocab=64, width=32, num_layers=2, seq_len=8, batch_size=2,
                          steps=1, rounds=2, warmup=1)  # fmt: skip
    result = run_benchmark(cfg)
    rows = result["rows"]
    assert tuple(rows) == KINDS
    assert all(len(r["seconds"]) == 2 and r["step_s"] > 0 for r in rows.values())
    # parameters, gradients and state: sharded (fsdp, torch's) about half of replicated
    for sharded in ("fsdp", "fsdp2"):
        assert rows[sharded]["held_mib"] < 0.6 * rows["allreduce"]["held_mib"], rows
    assert rows["fsdp"]["held_mib"] == rows["fsdp2"]["held_mib"]  # the same shards
    table = format_table(result)
    assert "vs fsdp2" in table and "fsdp vs torch's FSDP2 loop" in table
