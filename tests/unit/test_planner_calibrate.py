"""This machine's calibration (planner/calibrate.py): every cluster term round-trips, nothing
unmeasured is a silent 0, the per-host cache is written once and reused, ``phalanx plan`` runs
without flags, '...' in --devices, and efficiency over 100% explained. The measurements are
replaced by fixed numbers: these tests check the plumbing, not this machine's timings."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from phalanx.cli import main
from phalanx.errors import ConfigError
from phalanx.exchange.link import LinkModel
from phalanx.fileio import CACHE_ENV
from phalanx.planner import calibrate, plan
from phalanx.planner.cluster import (
    ClusterConfig,
    LinkConfig,
    cluster_from_dict,
    cluster_to_toml,
    from_link,
    load_cluster,
)
from phalanx.planner.step import StepProfile
from tests.helpers.cli import own_process_group

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "digits_cnn.toml")
CLUSTER = str(ROOT / "configs" / "clusters" / "this_machine.toml")

# a Gloo link of 2 ranks with both probes, as bench link measures it
LINK = LinkModel(
    alpha_s=2e-4,
    beta_bytes_per_s=1.5e9,
    world_size=2,
    backend="gloo",
    message_samples_s=(3e-4, 5e-4),
    handoff_samples_s=(2e-5, 3e-5),
)


PROBE = calibrate.measure_compute_slowdown  # the real one, before the fixture replaces it


@pytest.fixture(autouse=True)
def probed_slowdown(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``phalanx plan`` on this machine probes the compute slow-down (~20 s for real): here
    a fake reading of 1.2 at 2 ranks; the list records the probes."""
    probes: list[int] = []

    def probe(cores: int) -> tuple[float, ...]:
        probes.append(cores)
        return (1.0, 1.2, 1.4, 1.6)[: max(1, min(cores, 4))]

    monkeypatch.setattr(calibrate, "measure_compute_slowdown", probe)
    return probes


def every_term() -> ClusterConfig:
    """A cluster whose every term differs from its default."""
    return ClusterConfig(
        name='a "quoted" name',
        description="line\\with escapes",
        devices_per_node=4,
        nodes=3,
        intra=LinkConfig(alpha_s=1.5e-5, beta_bytes_per_s=2.5e10),
        inter=LinkConfig(alpha_s=3e-5, beta_bytes_per_s=1.2e9),
        shared_nic=False,
        shared_intra=True,
        compute_speed=1.7,
        codec_s_per_byte=2.4e-10,
        add_s_per_byte=5.6e-11,
        message_overhead_s=1.9e-4,
        host_cores_per_node=8,
        handoff_s=1.6e-5,
        compute_slowdown=(1.0, 1.35),
        collective_call_s=7e-4,
        collective_call_cpu_s=4e-4,
        assumed=("inter: not measured: 10 GbE assumed",),
    )


def test_every_term_round_trips_through_toml_and_json(tmp_path: Path) -> None:
    cluster = every_term()
    defaults = ClusterConfig(name="x", devices_per_node=1, intra=cluster.intra)
    for f in dataclasses.fields(ClusterConfig):  # the fixture covers every term
        if f.name not in ("intra", "name", "devices_per_node"):
            assert getattr(cluster, f.name) != getattr(defaults, f.name), f.name
    text = cluster_to_toml(cluster)
    written = set(re.findall(r"^(\w+) = ", text, re.M)) | set(re.findall(r"^\[(\w+)\]", text, re.M))
    fields = {f.name for f in dataclasses.fields(ClusterConfig)}
    assert written == fields | {"alpha_s", "beta_bytes_per_s"}  # a new term must be written
    (tmp_path / "c.toml").write_text(text)
    assert load_cluster(tmp_path / "c.toml") == cluster
    assert cluster_from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster
    path = tmp_path / "clusters" / "host.json"
    calibrate.save_calibration(cluster, path, "host", calibrate.datetime(2026, 11, 25, 10, 0))
    assert calibrate.load_calibration(path).cluster == cluster


def test_a_term_not_measured_is_stated_never_a_silent_zero(tmp_path: Path, monkeypatch) -> None:
    bare = dataclasses.replace(LINK, message_samples_s=(), handoff_samples_s=())
    cluster = from_link(bare)
    assumed = {term.split(":")[0] for term in cluster.assumed}
    assert assumed == {"codec_s_per_byte", "add_s_per_byte", "host_cores_per_node",
                       "message_overhead_s", "handoff_s"}  # fmt: skip
    assert all(term.endswith("0 assumed") for term in cluster.assumed)
    measured = from_link(LINK, codec_s_per_byte=1e-10, add_s_per_byte=2e-11, host_cores=2)
    assert measured.assumed == () and measured.host_cores_per_node == 2
    # --cluster link.json: what the file lacks is measured here, not left at 0
    LINK.save(tmp_path / "link.json")
    monkeypatch.setattr(plan, "measure_codec_s_per_byte", lambda: 3e-10)
    monkeypatch.setattr(plan, "measure_add_s_per_byte", lambda: 4e-11)
    read = plan.read_cluster(str(tmp_path / "link.json"))
    assert (read.codec_s_per_byte, read.add_s_per_byte) == (3e-10, 4e-11)
    assert read.host_cores_per_node == calibrate.host_cores() and read.assumed == ()


MEASURE = calibrate.calibrate_machine  # the real one, before a test replaces it


def fake_calibration(calls: list[int]) -> ClusterConfig:
    calls.append(1)
    return MEASURE(lambda: LINK, lambda: 2e-10, lambda: 5e-11, lambda cores: (1.0, 1.3)[:cores],
                   lambda alpha: 1e-3, lambda: 6e-4)  # fmt: skip


def test_the_calibration_measures_every_term_and_states_the_network() -> None:
    cluster = fake_calibration([])
    assert cluster.codec_s_per_byte == 2e-10 and cluster.add_s_per_byte == 5e-11
    assert cluster.compute_slowdown == (1.0, 1.3)[: calibrate.host_cores()]
    assert cluster.host_cores_per_node == calibrate.host_cores() >= 1
    assert cluster.message_overhead_s > 0 and cluster.handoff_s == pytest.approx(2.5e-5)
    assert cluster.collective_call_s == 1e-3 and cluster.collective_call_cpu_s == 6e-4
    assert cluster.nodes == 0 and cluster.inter == calibrate.ASSUMED_INTER
    assert cluster.assumed == (calibrate.INTER_NOTE,)  # the one term not measured
    cluster.check_devices(1024)


def test_the_cache_is_written_once_per_host_and_reused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    calls: list[int] = []
    said: list[str] = []
    first = calibrate.load_or_calibrate(say=said.append, calibrate=lambda: fake_calibration(calls))
    assert first.fresh and calls == [1] and "calibrating this machine once" in said[0]
    assert first.path == calibrate.cache_path() and first.path.parent == tmp_path / "clusters"
    data = json.loads(first.path.read_text())
    assert data["format"] == calibrate.FORMAT and data["measured_at"].startswith("20")
    again = calibrate.load_or_calibrate(calibrate=lambda: fake_calibration(calls))
    assert not again.fresh and calls == [1] and again.cluster == first.cluster
    assert "measured 20" in again.describe() and str(first.path) in again.describe()
    calibrate.load_or_calibrate(recalibrate=True, calibrate=lambda: fake_calibration(calls))
    assert calls == [1, 1]
    # a cache from before a term was measured is measured again, never read as 0
    data["cluster"].pop("collective_call_cpu_s")
    first.path.write_text(json.dumps(data))
    said.clear()
    renewed = calibrate.load_or_calibrate(say=said.append,
                                          calibrate=lambda: fake_calibration(calls))  # fmt: skip
    assert renewed.fresh and calls == [1, 1, 1] and "lacks collective_call_cpu_s" in said[0]
    assert renewed.cluster.collective_call_cpu_s == 6e-4
    first.path.write_text("{}")
    with pytest.raises(ConfigError, match="--recalibrate"):
        calibrate.load_or_calibrate(calibrate=lambda: fake_calibration(calls))


def run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    return info.value.code, out, err


def test_plan_without_a_cluster_plans_this_machine_to_1024(
    tmp_path, monkeypatch, capsys, probed_slowdown
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    calls: list[int] = []
    monkeypatch.setattr(calibrate, "calibrate_machine", lambda: fake_calibration(calls))
    step = StepProfile.synthesize(samples_per_s=4000, batch_size=32, layer_params=[1000, 5000])
    profile = str(step.save(tmp_path / "step.json"))
    argv = ["plan", CONFIG, "--profile", profile, "--strategies", "allreduce", "--compress",
            "none", "--thresholds", "25", "--json", str(tmp_path / "plan.json")]  # fmt: skip
    code, out, err = run([*argv, "--devices", "1,2,4,...,1024"], capsys)
    assert code == 0, err
    assert "cluster: this machine" in out and "measured now" in out
    assert "assumed (not measured): inter: not measured" in out
    assert json.loads((tmp_path / "plan.json").read_text())["devices"] == [2**k for k in range(11)]
    code, out, err = run([*argv, "--devices", "1,2", "--set", "train.steps=7"], capsys)
    assert code == 0 and calls == [1] and "cached in" in out  # reused, not measured again
    # the recommended command is ready to paste: this config, the plan's own --set first
    assert f"phalanx train {CONFIG} --nproc 2 --set train.steps=7 --set exchange." in out
    if calibrate.host_cores() >= 2:  # the slow-down, unlike the rest, is probed every plan
        assert len(probed_slowdown) == 2
        assert "compute slow-down probed now: 1.20 at 2 ranks (calibration: 1.30)" in out
        assert json.loads((tmp_path / "plan.json").read_text())["cluster"]["compute_slowdown"][
            :2] == [1.0, 1.2]  # fmt: skip
    code, _, err = run([*argv, "--recalibrate", "--cluster", CLUSTER], capsys)
    assert code == 2 and "--recalibrate" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "text, counts",
    [("1,2,4,...,64", [1, 2, 4, 8, 16, 32, 64]), ("1,...,8", [1, 2, 4, 8]),
     ("3,5", [3, 5]), ("2,...,6", [2, 4, 6])],
)  # fmt: skip
def test_devices_dots_continue_a_doubling(text: str, counts: list[int]) -> None:
    from phalanx.commands.plan import _parse_devices

    assert _parse_devices(text) == counts


@pytest.mark.parametrize("text", ["...,8", "1,2,...", "1,x", "0,1"])
def test_bad_devices_are_one_line_errors(text: str) -> None:
    from phalanx.commands.plan import _parse_devices

    with pytest.raises(ConfigError, match="--devices"):
        _parse_devices(text)


def test_efficiency_over_100_percent_is_explained_row_by_row() -> None:
    # a step whose optimizer is half of it: ps updates during backward, partitioned shards it
    step = StepProfile.synthesize(
        samples_per_s=4000, batch_size=32, layer_params=[2**18] * 4, optimizer_s_per_byte=1e-9
    )
    cluster = ClusterConfig(  # a fast link: the exchange hides behind backward
        name="fast", devices_per_node=8, nodes=1,
        intra=LinkConfig(alpha_s=1e-6, beta_bytes_per_s=1e11),
    )  # fmt: skip
    strategies = [("ps", {}), ("partitioned", {}), ("allreduce", {})]
    result = plan.make_plan(step, cluster, [1, 8], strategies, ["25"], ["none"])
    rows = {(r.setup.strategy, r.devices): r for r in result.rows}
    assert rows["ps", 1].efficiency > 1.0 and "communication thread" in rows["ps", 1].above_linear
    assert rows["partitioned", 8].efficiency > 1.0
    assert re.search(r"updates 1/[48] of the parameters", rows["partitioned", 8].above_linear)
    assert all(not r.above_linear for r in result.rows if round(r.efficiency * 100) <= 100)
    text = plan.format_plan(result)
    assert "over 100%: ps / 25 MiB / none at 1 (" in text
    assert rows["ps", 1].to_dict()["above_linear"] == rows["ps", 1].above_linear
    fake = dataclasses.replace(rows["allreduce", 1], efficiency=1.2)
    assert "a bug" in plan.above_linear(fake)  # nothing in the model explains it
    # a strategy whose own one-process Engine step measured faster than the config's: said so
    phases = {"forward": step.forward_s, "backward": step.backward_s,
              "optimizer": step.optimizer_s, "loop": step.compute_s}  # fmt: skip
    measured = dataclasses.replace(step, strategy_phases={
        "allreduce": phases, "tree": {k: 0.8 * v for k, v in phases.items()}})  # fmt: skip
    result = plan.make_plan(measured, cluster, [1], [("tree", {})], ["25"], ["none"])
    (tree,) = result.rows
    assert tree.efficiency > 1.2 and "measurement spread" in tree.above_linear, tree.above_linear


def test_auto_plan_picks_a_setup_the_run_uses_and_the_run_reports_its_error(
    tmp_path, monkeypatch, capsys
) -> None:
    """``phalanx train --auto-plan``: the plan's fastest setup at the run's processes, applied
    through --set (fsdp gets no bucket size; a strategy the config's clipping rules out is
    not picked), prediction.json written, summary.json's predicted vs measured step."""
    from phalanx.commands import auto_plan
    from phalanx.config import load_config
    from phalanx.planner import step as step_module
    from phalanx.planner.plan import PlanRow, recommended_sets
    from phalanx.planner.sim import ExchangeSetup

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(calibrate, "calibrate_machine", lambda: fake_calibration([]))
    step = StepProfile.synthesize(samples_per_s=4000, batch_size=32, layer_params=[1000, 5000])
    monkeypatch.setattr(step_module, "measure_step_profile", lambda config: step)
    run_dir = tmp_path / "run"
    argv = ["train", CONFIG, "--auto-plan", "--run-dir", str(run_dir),
            "--set", "train.steps=5", "--set", "train.progress=false"]  # fmt: skip
    with own_process_group():  # the run's world of one goes with it
        code, out, err = run(argv, capsys)
    assert code == 0, err
    assert "auto-plan: " in out and "plan: predicted" in out
    prediction = json.loads((run_dir / "prediction.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["predicted_step_s"] == prediction["predicted_step_s"] > 0
    assert summary["prediction_error"] == pytest.approx(
        summary["predicted_step_s"] / summary["measured_step_s"] - 1
    )
    assert any(s.startswith("exchange.strategy=") for s in prediction["sets"])
    fsdp = PlanRow(devices=2, setup=ExchangeSetup(strategy="fsdp", threshold_label="per layer"))
    sets = recommended_sets(fsdp)
    assert not any("bucket_mb" in s for s in sets)
    assert load_config(CONFIG, sets).exchange.strategy == "fsdp"  # the sets load as given
    clipped = load_config(CONFIG, ["train.max_grad_norm=1.0"])
    assert not auto_plan._runnable(clipped, "ps") and auto_plan._runnable(clipped, "fsdp")


def test_predict_reports_the_error_of_the_run_as_configured(tmp_path, monkeypatch, capsys) -> None:
    """``phalanx train --predict``: the config's own setup predicted (nothing changes: the
    run keeps its strategy), prediction.json written without --set items, summary.json's
    predicted vs measured step; with --auto-plan too it is a one-line error (exit 2)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(calibrate, "calibrate_machine", lambda: fake_calibration([]))
    run_dir = tmp_path / "run"
    argv = ["train", CONFIG, "--predict", "--run-dir", str(run_dir),
            "--set", "exchange.strategy=tree", "--set", "train.steps=5",
            "--set", "train.progress=false"]  # fmt: skip
    with own_process_group():
        code, out, err = run(argv, capsys)
    assert code == 0, err
    assert "predict: tree / 25 MiB / none at 1 process(es)" in out and "plan: predicted" in out
    prediction = json.loads((run_dir / "prediction.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert prediction["sets"] == [] and prediction["setup"].startswith("tree")
    assert summary["predicted_step_s"] == prediction["predicted_step_s"] > 0
    assert summary["prediction_error"] == pytest.approx(
        summary["predicted_step_s"] / summary["measured_step_s"] - 1
    )
    code, out, err = run([*argv, "--auto-plan"], capsys)
    assert code == 2 and "drop --predict" in err and "Traceback" not in err
    pipeline = ["train", "configs/gpt_pipeline.toml", "--predict", "--run-dir", str(run_dir)]
    code, out, err = run(pipeline, capsys)
    assert code == 2 and "pipeline > 1 yet; drop --predict" in err


@pytest.mark.slow  # spawns processes or trains for real: not in make test-fast
def test_ranks_sharing_a_node_slow_each_ones_compute_in_the_plan() -> None:
    """compute_slowdown: a rank's compute at k ranks per node takes the measured factor
    longer (the last factor past what was measured; none at one device), and the
    reference step's measurement gives 1 for one process."""
    from phalanx.planner.sim import ExchangeSetup, Simulator

    step = StepProfile.synthesize(samples_per_s=4000, batch_size=32, layer_params=[1000, 5000])
    base = every_term()
    plain = dataclasses.replace(base, compute_slowdown=(), host_cores_per_node=0)
    shared = dataclasses.replace(plain, compute_slowdown=(1.0, 1.5))
    assert [shared.compute_slowdown_at(n) for n in (1, 2, 4, 64)] == [1.0, 1.5, 1.5, 1.5]
    setup = ExchangeSetup(strategy="allreduce")
    alone, slowed = (Simulator(step, c).run(2, setup) for c in (plain, shared))
    assert slowed.compute_s == pytest.approx(1.5 * alone.compute_s, rel=1e-6)
    one = Simulator(step, shared).run(1, setup).compute_s
    assert one == pytest.approx(Simulator(step, plain).run(1, setup).compute_s)
    assert PROBE(1) == (1.0,)


def test_the_slowdown_probe_pairs_neighbouring_windows_and_cancels_a_drift() -> None:
    """The probe's windows: a warm-up, then (1 alone, k together) pairs for each k whose order
    flips every round; a machine whose speed drifts 2% per window and whose true factor is
    1.25 at 2 ranks and 1.5 at 3 reads exactly those factors (windows seconds apart would
    read the drift); a pair a late rank missed is dropped; no pair at all is an error."""
    schedule = calibrate.slowdown_schedule(3, 4)
    assert schedule[:5] == [3, 1, 2, 1, 3] and schedule[5:9] == [2, 1, 3, 1]
    assert len(schedule) == 1 + 4 * 2 * 2
    factor = {1: 1.0, 2: 1.25, 3: 1.5}

    def step_s(rank: int, window: int) -> float | None:
        ranks = schedule[window]
        return None if rank >= ranks else 0.01 * factor[ranks] * 1.02**window

    per_rank = [[step_s(rank, w) for w in range(len(schedule))] for rank in range(3)]
    # one pair alone reads the drift (2% off); the rounds' flipped pairs cancel it
    assert per_rank[0][2] / per_rank[0][1] == pytest.approx(1.25 * 1.02, rel=1e-3)
    true = pytest.approx((1.0, 1.25, 1.5), rel=1e-3)
    assert calibrate.slowdown_factors(schedule, per_rank) == true
    per_rank[1][2] = None  # rank 1 started late: the first 2-rank pair is dropped (the
    # three left no longer balance the drift)
    assert calibrate.slowdown_factors(schedule, per_rank) == pytest.approx((1.0, 1.25, 1.5),
                                                                           rel=0.021)  # fmt: skip
    faster = [[None if m is None else m * (0.5 if schedule[w] > 1 else 1) for w, m in
               enumerate(ranks)] for ranks in per_rank]  # fmt: skip
    assert calibrate.slowdown_factors(schedule, faster) == (1.0, 1.0, 1.0)  # noise, not < 1
    late = [[m if schedule[w] == 1 else None for w, m in enumerate(r)] for r in per_rank]
    with pytest.raises(RuntimeError, match="started too late"):
        calibrate.slowdown_factors(schedule, late)


def test_more_ranks_than_cores_on_one_host_take_turns() -> None:
    """``phalanx train --nproc 3`` on a 2-core host: ``on_one_host`` keeps the 3 ranks on one
    node, whose CPU ranks then take turns on its cores (compute 3/2 of the 2-rank factor) and
    whose link model already shares the cores among every rank's messages: beside compute,
    communication and compute split a rank's turn (1/2 each, not cores / (2 x 3))."""
    base = dataclasses.replace(every_term(), devices_per_node=2, host_cores_per_node=2,
                               compute_slowdown=(1.0, 1.1))  # fmt: skip
    assert base.on_one_host(2) is base
    three = base.on_one_host(3)
    assert three.devices_per_node == 3 and three.node_of(2) == 0
    assert three.compute_slowdown_at(3) == pytest.approx(1.1 * 3 / 2)
    assert three.comm_rate_beside_compute(3) == pytest.approx(1 / 2)
    # compute beside communication loses (1 - that rate): 1/2 at 3 ranks and at 2, none
    # where a rank has a core for each of its threads
    assert 1 - base.comm_rate_beside_compute(2) == pytest.approx(1 / 2)
    assert 1 - base.comm_rate_beside_compute(1) == 0.0
    assert 1 - dataclasses.replace(base, devices_per_node=8, host_cores_per_node=8
                                   ).comm_rate_beside_compute(2) == 0.0  # fmt: skip
    assert base.compute_slowdown_at(3) == pytest.approx(1.1)  # 2 per node over a network
    devices = dataclasses.replace(base, host_cores_per_node=0)  # GPUs: no turns
    assert devices.on_one_host(3).compute_slowdown_at(3) == pytest.approx(1.1)


def test_fsdp_collectives_cost_their_cpu_work_alone_once_ranks_outnumber_cores() -> None:
    """collective_call_s: each fully_shard collective (all-gather, its repeat before backward,
    reduce-scatter) costs the compute thread that much per ring step (a 'collective calls'
    span); none at 1 device; when more CPU ranks than cores take turns, only the call's CPU
    work (collective_call_cpu_s: another rank computes while it waits)."""
    from phalanx.planner.sim import ExchangeSetup, Simulator

    step = StepProfile.synthesize(samples_per_s=4000, batch_size=32, layer_params=[1000, 5000])
    base = dataclasses.replace(every_term(), devices_per_node=2, host_cores_per_node=2,
                               compute_slowdown=(), collective_call_s=0.0)  # fmt: skip
    costly = dataclasses.replace(base, collective_call_s=1e-3, collective_call_cpu_s=4e-4)
    assert costly.collective_call_s_at(1) == 0.0 and costly.collective_call_s_at(2) == 1e-3
    assert costly.on_one_host(3).collective_call_s_at(3) == 8e-4  # 3 ranks on 2 cores
    assert costly.on_one_host(4).collective_call_s_at(4) == pytest.approx(1.2e-3)
    assert dataclasses.replace(costly, host_cores_per_node=0).collective_call_s_at(3) == 2e-3
    fsdp = ExchangeSetup(strategy="fsdp")
    free, charged = (Simulator(step, c).run(2, fsdp) for c in (base, costly))
    calls = [e for e in charged.events if e.name == "collective calls"]
    assert len(calls) == 3 * 2 and all(e.duration_s == pytest.approx(1e-3) for e in calls)
    assert not [e for e in free.events if e.name == "collective calls"]
    assert charged.step_s > free.step_s + 3e-3  # some of the calls replace waits for gathers


@pytest.mark.slow
def test_the_collective_call_probe_measures_cpu_work_with_more_ranks_than_cores() -> None:
    """The real probe: 3 ranks pinned to 2 cores (every thread of each) against one alone."""
    per_step = calibrate.measure_collective_call_cpu_s()
    assert 0.0 < per_step < 0.05  # the collectives make CPU work; a probe off by 100x is not a cost


@pytest.mark.slow  # trains for real: not in make test-fast
def test_each_strategys_engine_is_timed_in_alternating_passes(monkeypatch) -> None:
    """The world-1 Engines of a config's strategies are measured in passes whose order
    reverses, so a slow second of a shared machine lands in every strategy's steps."""
    from phalanx import build
    from phalanx.config import load_config

    order: list[str] = []
    config = load_config(str(ROOT / "configs" / "digits_cnn.toml"))
    real = build._time_engine

    def timed(cfg, where, times):  # the pass's steps, then a slow second for whoever is next
        order.append(cfg.exchange.strategy)
        real(cfg, where, times)
        if len(order) == 2:
            for values in times.values():
                values[-build.ENGINE_STEPS :] = [1.0] * build.ENGINE_STEPS

    monkeypatch.setattr(build, "_time_engine", timed)
    others = [dataclasses.replace(config, exchange=dataclasses.replace(config.exchange,
              strategy=s, options={})) for s in ("tree", "ps")]  # fmt: skip
    phases = build.engine_phases([config, *others], device="cpu")
    assert order == ["allreduce", "tree", "ps", "ps", "tree", "allreduce"] + order[:3]
    assert build.ENGINE_PASSES == 3
    assert all(0 < p["loop"] < 0.5 for p in phases)  # one slow pass in three: not the median
    assert all(p["forward"] + p["backward"] + p["optimizer"] <= p["loop"] for p in phases)
