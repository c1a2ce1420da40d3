"""The step simulation: closed forms, overlap, owner updates, profiles and traces."""

from __future__ import annotations

import json
import math

import pytest

from phalanx.costs import LayerCost
from phalanx.errors import ConfigError
from phalanx.exchange.buckets import FIRST_BUCKET_BYTES, plan_buckets
from phalanx.exchange.link import LinkModel
from phalanx.exchange.threshold import BackwardProfile
from phalanx.planner.cluster import ClusterConfig, LinkConfig
from phalanx.planner.sim import (
    FLAG_BYTES,
    ExchangeSetup,
    Simulator,
    TooLarge,
    plan_step_buckets,
    predict_step,
)
from phalanx.planner.step import StepProfile, load_step_profile
from phalanx.planner.trace import LANES, lane_totals, read_trace, write_trace

ALPHA, BETA = 50e-6, 1e9
MIB = 2**20


def one_node(devices: int = 16, **kwargs) -> ClusterConfig:
    intra = LinkConfig(alpha_s=ALPHA, beta_bytes_per_s=BETA)
    return ClusterConfig(name="node", nodes=1, devices_per_node=devices, intra=intra, **kwargs)


def two_nodes(inter_beta: float = BETA, shared_nic: bool = True) -> ClusterConfig:
    return ClusterConfig(
        name="two",
        nodes=2,
        devices_per_node=2,
        shared_nic=shared_nic,
        intra=LinkConfig(alpha_s=ALPHA, beta_bytes_per_s=BETA),
        inter=LinkConfig(alpha_s=ALPHA, beta_bytes_per_s=inter_beta),
    )


def profile(
    layers: list[tuple[float, float, int]], batch: int = 8, optimizer_s_per_byte: float = 0.0
) -> StepProfile:
    """Layers in backward order as (forward_s, backward_s, gradient bytes)."""
    return StepProfile(
        layers=[
            LayerCost(name=f"l{i}", forward_s=f, backward_s=b, grad_bytes=(g,) if g else ())
            for i, (f, b, g) in enumerate(layers)
        ],
        batch_size=batch,
        optimizer_s_per_byte=optimizer_s_per_byte,
    )


def ring_s(p: int, n: float) -> float:
    return 2 * (p - 1) * ALPHA + 2 * (p - 1) / p * n / BETA


@pytest.mark.parametrize("p", [2, 3, 4, 7])
def test_no_compute_exposes_the_whole_ring(p):
    n = 4 * MIB
    step = profile([(0.0, 0.0, n - FLAG_BYTES)])  # one gradient: bucket of n bytes
    result = Simulator(step, one_node()).run(p, ExchangeSetup())
    assert result.bucket_bytes == [n]
    assert result.compute_s == 0.0
    assert result.exposed_s == pytest.approx(ring_s(p, n), rel=1e-9)
    assert result.step_s == pytest.approx(ring_s(p, n), rel=1e-9)


@pytest.mark.parametrize("p", [2, 5, 8])
def test_tree_with_no_compute(p):
    n = 2 * MIB
    step = profile([(0.0, 0.0, n - FLAG_BYTES)])
    result = Simulator(step, one_node()).run(p, ExchangeSetup(strategy="tree"))
    assert result.step_s == pytest.approx(2 * math.ceil(math.log2(p)) * (ALPHA + n / BETA))


def test_long_backward_exposes_only_the_last_bucket():
    """Ten 1 MiB layers, 50 ms of backward each: every bucket's ring is done before the next
    is ready, so only the last bucket's exchange (after backward) is exposed."""
    p, grad = 4, MIB - FLAG_BYTES
    step = profile([(0.01, 0.05, grad)] * 10)
    result = Simulator(step, one_node()).run(p, ExchangeSetup(bucket_bytes=MIB))
    assert len(result.bucket_bytes) == 10
    assert result.exposed_s == pytest.approx(ring_s(p, MIB), rel=1e-9)
    assert result.exchange_wait_s == pytest.approx(result.exposed_s)
    assert result.compute_s == pytest.approx(0.6)


def test_exposure_grows_when_the_link_falls_behind():
    p, grad = 8, 8 * MIB
    fast = profile([(0.001, 0.5, grad)] * 4)
    slow = profile([(0.001, 0.001, grad)] * 4)
    setup = ExchangeSetup(bucket_bytes=8 * MIB)
    exposed_fast = Simulator(fast, one_node()).run(p, setup).exposed_s
    exposed_slow = Simulator(slow, one_node()).run(p, setup).exposed_s
    per_bucket = ring_s(p, grad + FLAG_BYTES)
    assert exposed_fast == pytest.approx(per_bucket, rel=1e-6)
    # backward takes 4 ms, the link needs 4 buckets' time: 3 ms of it hidden
    assert exposed_slow == pytest.approx(4 * per_bucket - 0.003, rel=1e-6)


def test_nic_sharing_slows_inter_node_traffic():
    """Workers 0 and 1 (node 0) push to servers 2 and 3 (node 1): rank 0's message to server 3
    and rank 1's to server 2 could travel at once, but one network card takes them in turn."""
    n = 4 * MIB
    step = profile([(0.0, 0.0, n - FLAG_BYTES)])
    setup = ExchangeSetup(strategy="ps", options={"servers": 2})
    shared = Simulator(step, two_nodes(shared_nic=True)).run(4, setup)
    own = Simulator(step, two_nodes(shared_nic=False)).run(4, setup)
    assert shared.step_s > own.step_s
    assert shared.bytes_inter == pytest.approx(own.bytes_inter)


def test_slower_inter_node_links_slow_the_ring():
    step = profile([(0.0, 0.0, 4 * MIB)])
    fast = Simulator(step, two_nodes(BETA)).run(4, ExchangeSetup())
    slow = Simulator(step, two_nodes(BETA / 4)).run(4, ExchangeSetup())
    assert slow.step_s == pytest.approx(6 * (ALPHA + (4 * MIB + FLAG_BYTES) / 4 / (BETA / 4)))
    assert fast.step_s < slow.step_s
    assert fast.bytes_inter > 0 and fast.bytes_intra > 0


def test_partitioned_send_back_overlaps_the_next_forward():
    """The send-back runs after the optimizer; the next forward waits only for its bucket."""
    p = 4
    step = profile([(0.02, 0.04, 4 * MIB)] * 6, optimizer_s_per_byte=1e-9)
    setup = ExchangeSetup(strategy="partitioned", bucket_bytes=4 * MIB)
    result = Simulator(step, one_node()).run(p, setup)
    names = [e.name for e in result.events]
    assert any(n.endswith("send-back") for n in names)
    # the owner updates only its shard: 1/floor(p/2) of the optimizer's work
    assert result.optimizer_s == pytest.approx(step.optimizer_s / 2)
    send_back = [e for e in result.events if e.name.endswith("send-back") and e.step == 0]
    forward = [e for e in result.events if e.name == "forward"]
    assert send_back and forward  # the first step's send-back runs into this step's forward
    assert result.step_s >= result.compute_s


def test_ps_pulls_gate_the_next_forward_and_servers_do_not_train():
    step = profile([(0.01, 0.02, 2 * MIB)] * 4)
    result = Simulator(step, one_node()).run(
        4, ExchangeSetup(strategy="ps", options={"servers": 1})
    )
    assert result.trainers == 3
    assert result.samples_per_s == pytest.approx(3 * 8 / result.step_s)
    assert any(e.name.endswith("pull") for e in result.events)


def test_fusion_cycles_batch_ready_gradients():
    """Horovod's fusion: everything ready at a cycle tick goes as one message."""
    step = profile([(0.001, 0.001, MIB)] * 20)
    setup = ExchangeSetup(bucket_bytes=64 * MIB, fusion_cycle_s=0.005)
    result = Simulator(step, one_node()).run(4, setup)
    assert sum(result.bucket_bytes) == 20 * (MIB + FLAG_BYTES)
    assert 2 <= len(result.bucket_bytes) < 20
    with pytest.raises(ConfigError, match="fusion"):
        Simulator(step, one_node()).run(
            4, ExchangeSetup(strategy="partitioned", fusion_cycle_s=0.005)
        )


def test_budget_refuses_huge_schedules():
    step = profile([(0.0, 0.0, MIB)])
    simulator = Simulator(step, one_node(64), max_rounds=100)
    with pytest.raises(TooLarge, match="allreduce on 64 ranks takes 126 rounds per bucket"):
        simulator.run(64, ExchangeSetup(strategy="allreduce"))
    simulator = Simulator(step, one_node(64), max_round_messages=1000)  # ps: p(p-1) at once
    with pytest.raises(TooLarge, match="push on 64 ranks sends 4032 messages in one round"):
        simulator.run(64, ExchangeSetup(strategy="ps"))
    assert simulator.run(16, ExchangeSetup(strategy="ps")).step_s > 0  # 240 messages: fine


def test_buckets_are_the_engines():
    step = StepProfile.synthesize(
        samples_per_s=100, batch_size=10, layer_params=[3e5, 1e3, 2e6, 5e5, 7e6]
    )
    import torch

    stand_ins = [torch.empty(n, dtype=torch.uint8, device="meta") for n in step.grad_sizes]
    for bucket_bytes in (1, MIB, 8 * MIB, 25 * MIB):
        groups = plan_buckets(stand_ins, bucket_bytes, FIRST_BUCKET_BYTES)
        planned = plan_step_buckets(step, bucket_bytes)
        assert [list(b.grads) for b in planned] == groups


def test_synthesized_profile():
    step = StepProfile.synthesize(
        samples_per_s=128,
        batch_size=64,
        layer_params=[10, 30, 60],
        layer_compute=[1, 1, 2],
        optimizer_s_per_byte=1e-6,
    )
    assert step.compute_s == pytest.approx(0.5)
    assert step.backward_s == pytest.approx(2 * step.forward_s)
    assert step.grad_sizes == [240, 120, 40]  # backward order: the last layer first
    assert step.layers[0].forward_s == pytest.approx(2 * step.layers[1].forward_s)


def test_profile_json_and_backward_profile(tmp_path):
    step = profile([(0.01, 0.02, 100), (0.0, 0.005, 0), (0.02, 0.03, 300)])
    path = step.save(tmp_path / "step.json")
    assert load_step_profile(path) == step
    backward = BackwardProfile.from_layers(step.layers)
    assert backward.ready_s == pytest.approx((0.02, 0.055))
    assert backward.nbytes == (100, 300)
    (tmp_path / "bp.json").write_text(json.dumps(backward.to_dict()))
    again = load_step_profile(tmp_path / "bp.json")
    assert again.backward_s == pytest.approx(step.backward_s)
    (tmp_path / "junk.json").write_text('{"x": 1}')
    with pytest.raises(ConfigError, match="not a step profile"):
        load_step_profile(tmp_path / "junk.json")


def test_predict_step_from_measurements(tmp_path):
    backward = BackwardProfile(ready_s=(0.002, 0.010), nbytes=(4 * MIB, 4 * MIB), backward_s=0.012)
    link = LinkModel(alpha_s=ALPHA, beta_bytes_per_s=BETA, world_size=2)
    result = predict_step(
        backward,
        link.save(tmp_path),
        world_size=2,
        forward_s=0.006,
        batch_size=32,
        bucket_bytes=4 * MIB,
    )
    assert result.compute_s == pytest.approx(0.018)
    last = ring_s(2, 4 * MIB + FLAG_BYTES)
    # the second bucket is ready at 10 ms, its ring ends after backward (12 ms)
    assert result.exposed_s == pytest.approx(max(0.0, 0.010 + last - 0.012), rel=1e-6)


def test_trace_round_trip(tmp_path):
    step = profile([(0.01, 0.02, 2 * MIB)] * 3, optimizer_s_per_byte=1e-9)
    result = Simulator(step, one_node()).run(4, ExchangeSetup(bucket_bytes=2 * MIB))
    path = write_trace(tmp_path / "t.json", result.events, devices=4)
    data = json.loads(path.read_text())
    assert data["displayTimeUnit"] == "ms"
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert all({"name", "ts", "dur", "pid", "tid", "args", "cat"} <= set(e) for e in slices)
    assert any("bytes" in e["args"] for e in slices if e["cat"] == "exchange")
    totals = lane_totals(read_trace(path), step=1)
    assert set(totals) == set(LANES)
    # the compute stream's lanes add up to the step
    busy = totals["compute"] + totals["wait"] + totals["optimizer"] + totals["input"]
    assert busy == pytest.approx(result.step_s, rel=1e-9)
    assert totals["wait"] == pytest.approx(result.exposed_s, rel=1e-9)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_tree_ps_fetch_before_the_next_step(p):
    """The parallel-CNN paper's scheme: the tree up during backward, then every replica
    fetches the whole bucket from the server before its next step."""
    n = 2 * MIB
    step = profile([(0.0, 0.0, n - FLAG_BYTES)])
    result = Simulator(step, one_node()).run(p, ExchangeSetup(strategy="tree_ps"))
    up = math.ceil(math.log2(p)) * (ALPHA + n / BETA)
    fetch = (p - 1) * (ALPHA + n / BETA)
    assert result.step_s == pytest.approx(up + fetch, rel=1e-9)
    assert result.parameter_wait_s == pytest.approx(fetch, rel=1e-9)


@pytest.mark.parametrize("p", [3, 4, 8, 16])
def test_ps_star_with_every_rank_serving_takes_p_minus_1_turns(p):
    """docs/planner.md: every rank pushes its p-1 partitions of n/p at once, in turns that use
    distinct ports (star_turn), so the push lasts p-1 message times of n/p, as an all-to-all;
    the pull the same during the next forward."""
    n = 2 * MIB
    step = profile([(0.0, 0.0, n - FLAG_BYTES)])
    result = Simulator(step, one_node()).run(p, ExchangeSetup(strategy="ps"))
    push = result.events[[e.name for e in result.events].index("b0 exchange")]
    slot = ALPHA + n / p / BETA
    assert push.args["phases"]["push"] == pytest.approx((p - 1) * slot, rel=1e-9)
    assert push.args["phases"]["pull"] == pytest.approx((p - 1) * slot, rel=1e-9)


def test_ps_agrees_on_the_loss_between_forward_and_backward():
    """The Engine's non-finite guard holds ps ranks in a 1-element allreduce after forward
    (servers update while gradients arrive): the simulated step carries it, 2(p-1) alphas."""
    step = profile([(1e-3, 2e-3, 4 * MIB)])
    for p in (2, 4):
        ps = Simulator(step, one_node()).run(p, ExchangeSetup(strategy="ps"))
        agree = [e for e in ps.events if e.name == "agree"]
        assert len(agree) == 1 and agree[0].lane == "wait"
        ring_step = ALPHA + 4 / p / BETA  # a ring step carries n/p of the 4 bytes
        assert agree[0].duration_s == pytest.approx(2 * (p - 1) * ring_step, rel=1e-9)
        forward_end = max(e.start_s + e.duration_s for e in ps.events if e.name == "forward")
        assert agree[0].start_s == pytest.approx(forward_end)
    allreduce = Simulator(step, one_node()).run(2, ExchangeSetup(strategy="allreduce"))
    assert not [e for e in allreduce.events if e.name == "agree"]


def test_thread_hand_overs_cost_handoff_s_where_a_thread_sleeps_or_is_waited_for():
    """``handoff_s``: a job handed to the sleeping communication thread starts that much later,
    and the compute thread that waits for it resumes that much after it ends. One bucket
    launched as backward ends, no compute after it: the step pays both hand-overs once for
    ``tree``; nothing for uncompressed ``allreduce`` (the backend's own collective) or for the
    compressed one's last bucket (the compute thread exchanges it itself)."""
    h, p = 3e-4, 2
    step = profile([(1e-3, 2e-3, 4 * MIB)])
    plain, slow = one_node(), one_node(handoff_s=h)

    def extra(setup: ExchangeSetup) -> float:
        return (
            Simulator(step, slow).run(p, setup).step_s - Simulator(step, plain).run(p, setup).step_s
        )

    assert extra(ExchangeSetup(strategy="tree")) == pytest.approx(2 * h, rel=1e-9)
    assert extra(ExchangeSetup(strategy="allreduce")) == 0.0
    assert extra(ExchangeSetup(strategy="allreduce", compress="fp16")) == 0.0
    # two buckets, compressed: the first is a thread's job (launched while backward runs: the
    # thread sleeps); the last is not
    two = profile([(1e-3, 2e-3, 4 * MIB), (1e-3, 2e-3, 4 * MIB)])
    setup = ExchangeSetup(strategy="allreduce", compress="fp16", bucket_bytes=4 * MIB)
    runs = [Simulator(two, c).run(p, setup) for c in (plain, slow)]
    assert len(runs[0].bucket_bytes) == 2
    first = [[e for e in r.events if e.name == "b0 exchange"][0] for r in runs]
    assert first[1].start_s == pytest.approx(first[0].start_s)  # launched at the same time
    assert first[1].duration_s == pytest.approx(first[0].duration_s + h)  # started h later
    # ps: the push is a job (h to start), the step waits for the update (h to resume, hidden:
    # the thread goes on with the pull meanwhile) and the next forward for the pull (h)
    ps = ExchangeSetup(strategy="ps")
    assert extra(ps) == pytest.approx(2 * h, rel=1e-9)
    # partitioned: the reduce (h to start, h to resume), then the send-back, a job after the
    # optimizer (h to start), waited for by the next forward (h to resume)
    part = ExchangeSetup(strategy="partitioned")
    assert extra(part) == pytest.approx(4 * h, rel=1e-9)
    # a one-rank run has no exchange and no hand-over
    assert Simulator(step, slow).run(1, ExchangeSetup(strategy="tree")).step_s == pytest.approx(
        Simulator(step, plain).run(1, ExchangeSetup(strategy="tree")).step_s
    )


def test_point_to_point_reductions_pay_the_receivers_add():
    """``add_s_per_byte``: phalanx's own reductions add each arriving (uncompressed) gradient
    message into a buffer; the backend's allreduce (its calibration includes its adds), the
    results sent down a tree and a codec (its ``codec_s_per_byte`` includes the decode-add)
    pay nothing more. At p = 2 ``tree`` adds the bucket once (up), ``partitioned`` (one
    partition) once, ``ps`` with every rank serving half the bucket per rank."""
    a, p, n = 1e-10, 2, 8 * MIB
    step = profile([(0.0, 0.0, n - FLAG_BYTES)])
    plain, adding = one_node(), one_node(add_s_per_byte=a)

    def extra(setup: ExchangeSetup) -> float:
        return (
            Simulator(step, adding).run(p, setup).step_s
            - Simulator(step, plain).run(p, setup).step_s
        )

    assert extra(ExchangeSetup(strategy="tree")) == pytest.approx(a * n, rel=1e-9)
    assert extra(ExchangeSetup(strategy="partitioned")) == pytest.approx(a * n, rel=1e-9)
    assert extra(ExchangeSetup(strategy="ps")) == pytest.approx(a * n / 2, rel=1e-9)
    assert extra(ExchangeSetup(strategy="allreduce")) == 0.0
    assert extra(ExchangeSetup(strategy="ring")) == pytest.approx(a * n / 2, rel=1e-9)
    assert extra(ExchangeSetup(strategy="tree", compress="fp16")) == 0.0


def test_cpu_ranks_slow_communication_while_compute_runs():
    """``host_cores_per_node``: CPU ranks share the node's cores between each rank's compute
    and communication thread, so communication beside compute runs at cores / (2 x ranks)
    of its speed (here 2 / 4): a bucket launched at the start of a long backward takes
    twice its time, and the compute loses the same share (backward ends later); after
    backward, full speed; devices (0 cores given) are not slowed."""
    p, n = 2, 4 * MIB
    first, rest = 0.5, 1e-3  # a long backward after the first bucket is ready
    step = profile([(1e-3, 1e-3, n - FLAG_BYTES), (1e-3, first, 0), (1e-3, rest, n - FLAG_BYTES)])
    setup = ExchangeSetup(bucket_bytes=n)
    own = Simulator(step, one_node()).run(p, setup)
    cpu = Simulator(step, one_node(host_cores_per_node=2)).run(p, setup)
    assert one_node(host_cores_per_node=2).comm_rate_beside_compute(p) == 0.5
    assert one_node(host_cores_per_node=8).comm_rate_beside_compute(p) == 1.0
    b0 = [[e for e in r.events if e.name == "b0 exchange"][0] for r in (own, cpu)]
    assert b0[1].duration_s == pytest.approx(2 * b0[0].duration_s)  # all of it beside backward
    b1 = [[e for e in r.events if e.name == "b1 exchange"][0] for r in (own, cpu)]
    assert b1[1].duration_s == pytest.approx(b1[0].duration_s)  # after backward: full speed
    # b0 stays hidden behind the backward, but takes the cores' share from it: the compute
    # thread runs at the same half speed meanwhile, so backward loses half of b0's 2x time
    shared = [e for e in cpu.events if e.name == "shared cores"]
    assert sum(e.duration_s for e in shared) >= b0[0].duration_s * (1 - 1e-9)
    assert not [e for e in own.events if e.name == "shared cores"]  # devices: no sharing
    assert cpu.step_s >= own.step_s + b0[0].duration_s * (1 - 1e-9)
    with pytest.raises(ConfigError, match="host_cores_per_node"):
        one_node(host_cores_per_node=-1)
