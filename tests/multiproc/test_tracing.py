"""Chrome traces of real steps (issue 13 (1)): every strategy at world 2 writes one trace with
both ranks, the traced steps only, every bucket's exchange starting after its backward and
carrying its bytes; the CLI's --trace writes the same with the input lane."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import phalanx as px
from phalanx.engine.tracing import TraceConfig
from phalanx.planner.trace import LANES, lane_totals, read_trace
from tests.helpers.cli import run_main
from tests.helpers.spawn import run_ranks

STRATEGIES = ("allreduce", "tree", "partitioned", "ps")


def train_traced(ctx: Any, directory: str) -> dict[str, Any]:
    out = {}
    for name in STRATEGIES:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.Linear(128, 4))
        trace = TraceConfig(directory=f"{directory}/{name}", first_step=2, num_steps=2)
        engine = px.Engine(
            model,
            nn.functional.cross_entropy,
            lambda ps: torch.optim.SGD(ps, lr=0.1),
            exchange=name,
            bucket_mb=0.03,
            context=ctx,
            trace=trace,
        )
        for _ in range(4):
            engine.step(torch.randn(8, 32), torch.randint(0, 4, (8,)))
        out[name] = {
            "written": str(engine.trace.tracer.written) if engine.trace.tracer.written else None,
            "bucket_bytes": [b.nbytes for b in engine.buckets.buckets],
        }
        engine.close()
    return out


def test_every_strategy_writes_a_trace_of_both_ranks(tmp_path: Path) -> None:
    per_rank = run_ranks(train_traced, 2, str(tmp_path), timeout=120)
    for name in STRATEGIES:
        assert per_rank[1][name]["written"] is None  # rank 0 writes the gathered file
        events = read_trace(per_rank[0][name]["written"])
        buckets = per_rank[0][name]["bucket_bytes"]
        assert len(buckets) >= 2, name
        assert {e["pid"] for e in events} == {0, 1}, name
        assert {e["args"]["step"] for e in events} == {2, 3}, name
        assert {e["lane"] for e in events} <= set(LANES)
        for rank in (0, 1):
            for step in (2, 3):
                mine = [e for e in events if e["pid"] == rank and e["args"]["step"] == step]
                exchanges = [e for e in mine if e["name"].endswith(" exchange")]
                assert sorted(e["args"]["bytes"] for e in exchanges) == sorted(buckets), name
                pulls = [e for e in mine if e["name"].endswith(" pull")]  # ps, in background
                assert {e["lane"] for e in pulls} <= {"exchange"}, name
                assert bool(pulls) == name.startswith("ps"), (name, rank, step)
                assert all(e["args"]["bytes"] in buckets for e in pulls), name
                agreed = [e for e in mine if e["name"] == "agree"]  # the guard, before backward
                assert len(agreed) == (1 if name.startswith("ps") else 0), name
                for e in exchanges:  # a bucket's exchange starts once its backward ended
                    b = e["args"]["bucket"]
                    backward = [x for x in mine if x["name"] == f"backward b{b}"]
                    assert len(backward) == 1, (name, b)
                    end = backward[0]["ts"] + backward[0]["dur"]
                    assert e["ts"] >= end - 1.0 and e["dur"] > 0, (name, b)
                totals = lane_totals(events, rank=rank, step=step)
                assert totals["compute"] > 0 and totals["optimizer"] > 0, (name, totals)
                step_us = max(x["ts"] + x["dur"] for x in mine) - min(x["ts"] for x in mine)
                busy = [
                    x
                    for x in mine
                    if x["lane"] in ("compute", "wait", "optimizer")
                    and not x["name"].startswith("parameters")  # nested in forward
                    and not x["name"].startswith("update b")  # the comm thread's (ps)
                ]
                assert sum(x["dur"] for x in busy) <= step_us * 1.001, name  # one stream
                inside = [x for x in mine if x["name"].startswith("update b")]
                assert bool(inside) == (name.startswith("ps")), name  # servers update
                for x in inside:  # after their bucket's push began, within the step
                    (span,) = [e for e in mine if e["name"] == x["name"][7:] + " exchange"]
                    assert span["ts"] - 1 <= x["ts"] and x["dur"] > 0, name
                    # update() returns once every server stepped: before the step's last slice
                    assert x["ts"] + x["dur"] <= max(e["ts"] + e["dur"] for e in busy) + 1


def test_cli_trace_has_the_input_lane(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(
        '[model]\nname = "digits_cnn"\noptions = { channels = 8, hidden = 16 }\n'
        '[data]\nsource = "digits"\nbatch_size = 32\n[train]\nsteps = 5\nprogress = false\n'
    )
    args = ["train", str(config), "--run-dir", str(tmp_path / "run")]
    assert run_main([*args, "--trace", str(tmp_path / "trace")]) == 0
    events = read_trace(tmp_path / "trace" / "trace.json")
    assert {e["args"]["step"] for e in events} == {2, 3, 4}
    assert {"compute", "wait", "optimizer", "input"} <= {e["lane"] for e in events}


def train_traced_fsdp(ctx: Any, directory: str) -> str | None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.Linear(128, 4))
    engine = px.Engine(
        model,
        nn.functional.cross_entropy,
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        exchange="fsdp",
        context=ctx,
        trace=TraceConfig(directory=directory, first_step=2, num_steps=2),
    )
    for _ in range(4):
        engine.step(torch.randn(8, 32), torch.randint(0, 4, (8,)))
    written = str(engine.trace.tracer.written) if engine.trace.tracer.written else None
    engine.close()
    return written


def test_fsdp_writes_a_trace_of_both_ranks(tmp_path: Path) -> None:
    """fsdp has no buckets (torch's hooks run its exchange inside backward): its trace holds
    both ranks' traced steps with their compute and optimizer lanes, one stream per rank."""
    written = run_ranks(train_traced_fsdp, 2, str(tmp_path), timeout=120)
    assert written[1] is None  # rank 0 writes the gathered file
    events = read_trace(written[0])
    assert {e["pid"] for e in events} == {0, 1}
    assert {e["args"]["step"] for e in events} == {2, 3}
    assert {e["lane"] for e in events} <= set(LANES)
    for rank in (0, 1):
        for step in (2, 3):
            totals = lane_totals(events, rank=rank, step=step)
            assert totals["compute"] > 0 and totals["optimizer"] > 0, (rank, step, totals)
            mine = [e for e in events if e["pid"] == rank and e["args"]["step"] == step]
            assert not [e for e in mine if e["name"].endswith(" exchange")]  # no buckets
            names = [e["name"] for e in mine if e["lane"] == "compute"]
            assert names == ["forward", "backward"], names  # backward whole, after forward
