"""``phalanx plan``: a tiny config with a given profile, its outputs, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.cli import main
from phalanx.planner.step import StepProfile
from phalanx.planner.trace import read_trace

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "digits_cnn.toml")
CLUSTER = str(ROOT / "configs" / "clusters" / "this_machine.toml")


def run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    return info.value.code, out, err


@pytest.fixture
def step_json(tmp_path) -> str:
    step = StepProfile.synthesize(
        samples_per_s=4000,
        batch_size=32,
        layer_params=[320, 18496, 131200, 1290],
        layer_compute=[1, 4, 2, 0.1],
    )
    return str(step.save(tmp_path / "step.json"))


def test_plan_with_profile_writes_json_plot_and_traces(tmp_path, capsys, step_json):
    out_json, traces, png = tmp_path / "plan.json", tmp_path / "traces", tmp_path / "plan.png"
    argv = ["plan", CONFIG, "--cluster", CLUSTER, "--profile", step_json, "--devices", "1,2"]
    argv += ["--json", str(out_json), "--trace", str(traces), "--plot", str(png)]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert "best per N (at most 100% efficient):" in out and "<- best" in out
    # by default one row per (N, strategy): its best threshold and compression
    table = _rows(out, "1") + _rows(out, "2")
    assert len(table) == len({(cells[0], cells[1]) for cells in table}) >= 10, out
    # each reason for an efficiency over 100% is said once
    notes = [line for line in out.splitlines() if line.startswith("over 100%:")]
    assert len(notes) == len({line.rsplit(": ", 1)[-1] for line in notes}), notes
    plan = json.loads(out_json.read_text())
    assert plan["devices"] == [1, 2]
    strategies = {r["strategy"] for r in plan["rows"]}
    assert {"allreduce", "tree", "partitioned", "ps", "fsdp"} <= strategies
    assert {r["compress"] for r in plan["rows"]} == {"none", "fp16"}
    bucketed = [r for r in plan["rows"] if r["strategy"] != "fsdp"]
    assert {r["threshold"].split(" ")[0] for r in bucketed} == {"25", "auto"}
    # fsdp: one row per N (its units are the layers; fp16 is not one of its options)
    fsdp = [
        (r["devices"], r["threshold"], r["compress"])
        for r in plan["rows"]
        if r["strategy"] == "fsdp"
    ]
    assert fsdp == [(1, "per layer", "none"), (2, "per layer", "none")]
    assert [x.split(" (")[0] for x in plan["not_applicable"]] == ["fsdp / fp16"]
    assert "not planned: fsdp / fp16" in out
    one = [r for r in plan["rows"] if r["devices"] == 1]
    assert all(r["speedup"] == pytest.approx(1.0) for r in one if r["strategy"] != "ps")
    best = plan["best"]["2"]  # the fastest at most 100% efficient: never an above-linear row
    assert "above_linear" not in best
    assert best["samples_per_s"] == max(
        r["samples_per_s"] for r in plan["rows"] if r["devices"] == 2 and "above_linear" not in r
    )
    assert 1.0 < best["speedup"] <= 2.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = read_trace(traces / "plan-n2.json")
    assert {e["lane"] for e in events} >= {"compute", "exchange"}


def test_all_lists_every_combination_but_not_the_ones_that_cannot_differ(capsys, step_json):
    argv = ["plan", CONFIG, "--cluster", CLUSTER, "--profile", step_json, "--devices", "1,2"]
    code, short, err = run(argv, capsys)
    assert code == 0, err
    code, every, err = run([*argv, "--all"], capsys)
    assert code == 0, err
    assert len(_rows(every, "2")) > len(_rows(short, "2"))  # thresholds x compression at N = 2
    for n in ("1", "2"):  # no strategy's row repeats another's prediction
        seen = [(c[1], c[4], c[5]) for c in _rows(every, n) if c[4] != "skipped"]
        assert len(seen) == len(set(seen)), _rows(every, n)
    assert len(_rows(every, "1")) == 5  # at N = 1 threshold and compression cannot differ


def _rows(out: str, n: str) -> list[list[str]]:
    """The cells of the per-N table's rows at N = ``n`` (not the summary's, whose setup
    column reads "strategy / threshold / compress")."""
    cells = [line.split() for line in out.splitlines()]
    return [c for c in cells if len(c) > 4 and c[0] == n and c[2] != "/"]


def test_bad_cluster_file_is_one_line_exit_2(tmp_path, capsys, step_json):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        'name = "x"\ndevices_per_node = 2\nnodes = 1\n[intra]\nalpha_s = -1.0\n'
        "beta_bytes_per_s = 1e9\n"
    )
    code, _, err = run(["plan", CONFIG, "--cluster", str(bad), "--profile", step_json], capsys)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err
    assert str(bad) in lines[0] and "intra.alpha_s" in lines[0]


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--devices", "1,4"], "--devices"),  # this machine has 2 devices
        (["--strategies", "gossip"], "--strategies"),
        (["--compress", "zip"], "--compress"),
        (["--thresholds", "-3"], "--thresholds"),
        (["--devices", "two"], "--devices"),
    ],
)
def test_bad_arguments_exit_2(capsys, step_json, extra, fragment):
    code, _, err = run(
        ["plan", CONFIG, "--cluster", CLUSTER, "--profile", step_json, *extra], capsys
    )
    assert code == 2 and fragment in err and "Traceback" not in err


def test_missing_profile_file_exit_2(tmp_path, capsys):
    code, _, err = run(
        ["plan", CONFIG, "--cluster", CLUSTER, "--profile", str(tmp_path / "none.json")], capsys
    )
    assert code == 2 and "none.json" in err


@pytest.mark.slow
def test_plan_measures_the_config_without_a_profile(tmp_path, capsys):
    """No --profile: the config's model is built and a few steps are timed here."""
    out_json = tmp_path / "plan.json"
    code, out, err = run(
        [
            "plan",
            CONFIG,
            "--cluster",
            CLUSTER,
            "--strategies",
            "allreduce",
            "--steps",
            "3",
            "--device",
            "cpu",
            "--json",
            str(out_json),
        ],
        capsys,
    )
    assert code == 0, err
    plan = json.loads(out_json.read_text())
    assert plan["devices"] == [1, 2]  # the defaults, up to the cluster's 2 devices
    assert plan["profile"]["gradient_bytes"] > 500_000  # the digits CNN's 0.6 MB


def test_compare_puts_a_measured_trace_beside_the_simulated_step(tmp_path, capsys, step_json):
    """--compare: a measured trace's lanes (here written by hand for 2 ranks) next to the
    config's own setup simulated at the trace's number of ranks; a plan without that N is a
    one-line error."""
    from phalanx.planner.trace import TraceEvent, write_trace

    events = [
        TraceEvent(lane=lane, name=name, start_s=start, duration_s=dur, rank=rank, step=step)
        for rank in (0, 1)
        for step in (2, 3, 4)
        for lane, name, start, dur in (
            ("compute", "forward", 0.0, 0.002),
            ("compute", "backward b0", 0.002, 0.004),
            ("wait", "exchange", 0.006, 0.001),
            ("optimizer", "update", 0.007, 0.0005),
        )
    ]
    measured = write_trace(tmp_path / "trace.json", events)
    argv = ["plan", CONFIG, "--cluster", CLUSTER, "--profile", step_json, "--devices", "1,2"]
    code, out, err = run([*argv, "--compare", str(measured)], capsys)
    assert code == 0, err
    assert "vs simulated (allreduce / 25 MiB / none, 2 devices)" in out
    compute = next(line for line in out.splitlines() if line.strip().startswith("compute"))
    assert compute.split()[1] == "6.00"  # forward + backward, ms
    argv[-1] = "1"
    code, _, err = run([*argv, "--compare", str(measured)], capsys)
    assert (
        code == 2 and "--compare: the plan has no allreduce" in err and len(err.splitlines()) == 1
    )
