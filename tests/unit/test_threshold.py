"""Fusion threshold (F12): link fit, backward recorder, cost model and choice. No timing."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from torch import nn

from phalanx.costs import LayerCost
from phalanx.errors import ConfigError
from phalanx.exchange.buckets import FIRST_BUCKET_BYTES
from phalanx.exchange.link import DEFAULT_SIZES, LinkModel, fit_line, model_from_fit
from phalanx.exchange.threshold import (
    BackwardProfile,
    BackwardRecorder,
    choose_bucket_bytes,
    predict_exposed,
    uniform_exposed,
    uniform_optimum,
)

MIB = 2**20
G = 32 * MIB  # gradient bytes of the synthetic models (about the bench MLP)
ALPHA, BETA = 40e-6, 1.2e9


def _ring_times(alpha: float, beta: float, p: int, sizes: tuple[int, ...]) -> list[float]:
    return [2 * (p - 1) * alpha + 2 * (p - 1) / p * n / beta for n in sizes]


# -- link fit ---------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 3, 8])
def test_exact_line_recovers_alpha_and_beta(p: int) -> None:
    times = _ring_times(ALPHA, BETA, p, DEFAULT_SIZES)
    link = model_from_fit(*fit_line(DEFAULT_SIZES, times), p)
    assert link.alpha_s == pytest.approx(ALPHA, rel=1e-9)
    assert link.beta_bytes_per_s == pytest.approx(BETA, rel=1e-9)
    for n, t in zip(DEFAULT_SIZES, times):
        assert link.predict(n) == pytest.approx(t, rel=1e-9)


def test_noisy_timings_fit_close() -> None:
    """+-10 % multiplicative noise, 5 repeats, medians: alpha within 25 %, beta within 10 %."""
    rng = random.Random(0)
    exact = _ring_times(ALPHA, BETA, 2, DEFAULT_SIZES)
    medians = [sorted(t * rng.uniform(0.9, 1.1) for _ in range(5))[2] for t in exact]
    link = model_from_fit(*fit_line(DEFAULT_SIZES, medians), 2)
    assert link.alpha_s == pytest.approx(ALPHA, rel=0.25)
    assert link.beta_bytes_per_s == pytest.approx(BETA, rel=0.10)


def test_relative_weights_keep_latency_despite_noise_on_large_messages() -> None:
    """A 5 % error on the 4 MiB point is ~0.2 ms, far more than alpha; the fit must not care."""
    times = _ring_times(ALPHA, BETA, 2, DEFAULT_SIZES)
    times[-1] *= 1.05
    link = model_from_fit(*fit_line(DEFAULT_SIZES, times), 2)
    assert link.alpha_s == pytest.approx(ALPHA, rel=0.05)


def test_fit_clamps_negative_terms() -> None:
    sizes = (1000, 2000, 4000)
    intercept, slope = fit_line(sizes, [0.5e-6, 1.5e-6, 3.5e-6])  # line through -0.5 us
    assert intercept == 0.0 and slope > 0
    intercept, slope = fit_line(sizes, [3e-5, 2e-5, 1e-5])  # falling: no bandwidth term
    assert slope == 0.0 and intercept > 0
    assert math.isinf(model_from_fit(intercept, slope, 2).beta_bytes_per_s)
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_line((1000, 1000), [1e-5, 1e-5])


def test_calibrate_rejects_bad_sweeps_before_any_collective() -> None:
    from phalanx.exchange.link import calibrate

    with pytest.raises(ValueError, match="two distinct sizes >= 4 bytes"):
        calibrate(sizes=(4096, 4096))
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        calibrate(repeats=0)


def test_link_model_world_of_one_and_files(tmp_path) -> None:
    one = LinkModel(alpha_s=0.0, beta_bytes_per_s=math.inf, world_size=1)
    assert one.predict(10 * MIB) == 0.0
    link = model_from_fit(
        1e-4, 1e-9, 2, sizes=(4096, 16384), samples_s=((1e-4, 2e-4, 3e-4), (1e-4, 1e-4, 5e-4))
    )
    assert link.medians_s == (2e-4, 1e-4)
    assert link.predict(0, world_size=4) == pytest.approx(6 * link.alpha_s)
    path = link.save(tmp_path / "run")
    assert path.name == "link.json" and json.loads(path.read_text())["world_size"] == 2
    assert LinkModel.load(tmp_path / "run") == link
    assert LinkModel.from_dict(one.to_dict()) == one  # inf survives as null
    with pytest.raises(ValueError, match="link model: missing or bad field"):
        LinkModel.from_dict({"alpha_s": 1.0})
    with pytest.raises(ValueError, match="cannot read link model"):
        LinkModel.load(tmp_path / "nowhere.json")


# -- the cost model ---------------------------------------------------------------------------
def test_simulation_equals_closed_form_for_uniform_production() -> None:
    """n = G/b whole buckets, no first-bucket cap: the replay is the closed form, exactly."""
    for backward_s in (0.005, 0.02, 0.2):
        profile = BackwardProfile.uniform(G, 512, backward_s)
        link = LinkModel(ALPHA, BETA, 2)
        for num in (1, 2, 4, 8, 64, 512):
            simulated = predict_exposed(profile, link, 2, G // num, first_bucket_bytes=None)
            closed = uniform_exposed(G // num, G, backward_s, ALPHA, BETA, 2)
            assert simulated == pytest.approx(closed, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(
    "backward_s, alpha",
    [(0.01, 40e-6), (0.03, 40e-6), (0.2, 40e-6), (0.03, 2e-3)],
    ids=["bandwidth-bound", "little-slack", "much-slack", "latency-heavy"],
)
def test_closed_form_optimum(backward_s: float, alpha: float) -> None:
    """b* minimises the closed form (dense grid), and the replay of a fine-grained uniform
    profile reaches (within quantisation) the closed form's least exposed time."""
    b_star = uniform_optimum(G, backward_s, alpha, BETA, 2)
    at_b_star = uniform_exposed(b_star, G, backward_s, alpha, BETA, 2)
    grid = [G / 4096 * 4096 ** (k / 2000) for k in range(2001)]
    assert at_b_star <= min(uniform_exposed(b, G, backward_s, alpha, BETA, 2) for b in grid)
    profile = BackwardProfile.uniform(G, 4096, backward_s)
    choice = choose_bucket_bytes(
        profile.layer_costs(), LinkModel(alpha, BETA, 2), 2, first_bucket_bytes=None
    )
    best = min(x for _, x in choice.candidates)
    assert best == pytest.approx(at_b_star, rel=0.05)


def test_regimes_of_the_closed_form() -> None:
    wire = G * 1.0 / BETA  # g(2) = 1: time to move every byte once, ~28 ms
    a = 2 * ALPHA
    fast = uniform_optimum(G, wire / 2, ALPHA, BETA, 2)  # bandwidth-bound: sqrt(a/E_b)
    assert fast == pytest.approx(G * math.sqrt(a / (wire / 2)))
    slow = uniform_optimum(G, 10 * wire, ALPHA, BETA, 2)  # slack: link just keeps up
    assert slow == pytest.approx(G * a / (9 * wire))
    assert uniform_optimum(G, 1e-5, 1.0, BETA, 2) == G  # latency beyond backward: one bucket


def test_fast_backward_picks_large_buckets_slow_backward_small() -> None:
    """Nothing to hide behind: few big messages. Plenty of backward: small, early buckets."""
    link = LinkModel(ALPHA, BETA, 2)
    fast = choose_bucket_bytes(BackwardProfile.uniform(G, 256, 0.0005).layer_costs(), link, 2)
    slow = choose_bucket_bytes(BackwardProfile.uniform(G, 256, 0.2).layer_costs(), link, 2)
    assert fast.bucket_bytes >= G // 2
    assert slow.bucket_bytes <= MIB
    assert slow.predicted_exposed_s < slow.reference_exposed_s / 10


def test_choice_is_monotonic_in_alpha_and_backward_time() -> None:
    profile = BackwardProfile.uniform(G, 256, 0.03)
    alphas = [1e-6, 1e-5, 4e-5, 1e-4, 1e-3, 1e-2]
    picks = [choose_bucket_bytes(profile.layer_costs(), LinkModel(a, BETA, 2), 2) for a in alphas]
    assert [c.bucket_bytes for c in picks] == sorted(c.bucket_bytes for c in picks)
    assert picks[0].bucket_bytes < picks[-1].bucket_bytes
    for slower, faster in zip(picks[1:], picks):  # more latency never predicts less exposure
        for (b1, x1), (b2, x2) in zip(slower.candidates, faster.candidates):
            assert b1 == b2 and x1 >= x2
    # A slower backward (same bytes) never predicts more exposure, and picks smaller buckets.
    # Candidates are whole powers of two of layers: a ragged last bucket would otherwise make
    # any b whose remainder is one layer as good as one-layer buckets (a true tie of the model).
    link = LinkModel(ALPHA, BETA, 2)
    powers = [G // 256 * 2**k for k in range(9)]
    times = [0.001, 0.01, 0.03, 0.1, 0.3]
    picks = [
        choose_bucket_bytes(
            BackwardProfile.uniform(G, 256, t).layer_costs(), link, 2, candidates=powers
        )
        for t in times
    ]
    sizes = [c.bucket_bytes for c in picks]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    for slower, faster in zip(picks[1:], picks):
        assert all(
            x1 <= x2 + 1e-12 for (_, x1), (_, x2) in zip(slower.candidates, faster.candidates)
        )


def test_one_process_picks_one_bucket() -> None:
    profile = BackwardProfile.uniform(G, 64, 0.03)
    link = LinkModel(alpha_s=0.0, beta_bytes_per_s=math.inf, world_size=1)
    for world in (1,):
        choice = choose_bucket_bytes(profile.layer_costs(), link, world)
        assert choice.bucket_bytes == G
        assert all(x == 0.0 for _, x in choice.candidates)
    # a calibrated link asked about a world of one also predicts nothing on the wire
    assert (
        choose_bucket_bytes(profile.layer_costs(), LinkModel(ALPHA, BETA, 2), 1).bucket_bytes == G
    )


def test_choice_reports_inputs_and_candidates() -> None:
    profile = BackwardProfile.uniform(G, 8, 0.018)
    choice = choose_bucket_bytes(profile.layer_costs(), LinkModel(45e-6, 1.2e9, 2), 2)
    assert choice.num_layers == 8 and choice.total_bytes == G and choice.world_size == 2
    sizes = [b for b, _ in choice.candidates]
    assert sizes == sorted(sizes) and sizes[0] == G // 8 and sizes[-1] == G
    assert choice.bucket_bytes in sizes
    assert choice.predicted_exposed_s == min(
        x for b, x in choice.candidates if b == choice.bucket_bytes
    )
    assert choice.first_bucket_bytes == FIRST_BUCKET_BYTES
    line = choice.describe()
    for part in ("fusion threshold", "P=2", "L=8", "E_b=18.0 ms", "alpha=45 us", "1.20 GB/s",
                 "vs 25.0 MiB"):  # fmt: skip
        assert part in line
    data = choice.to_dict()
    assert data["bucket_bytes"] == choice.bucket_bytes and len(data["candidates"]) == len(sizes)
    json.dumps(data)
    explicit = choose_bucket_bytes(
        profile.layer_costs(), LinkModel(45e-6, 1.2e9, 2), 2, candidates=[MIB]
    )
    assert explicit.bucket_bytes == MIB
    with pytest.raises(ValueError, match="candidates must be >= 1 byte"):
        choose_bucket_bytes(
            profile.layer_costs(), LinkModel(45e-6, 1.2e9, 2), 2, candidates=[0, MIB]
        )


def test_real_profile_groups_like_the_planner() -> None:
    """A profile with uneven sizes and times: buckets follow the ready order, first capped."""
    profile = BackwardProfile(
        ready_s=(0.001, 0.002, 0.010, 0.011, 0.020),
        nbytes=(40_000, 4 * MIB, 4 * MIB, 64, 8 * MIB),
        backward_s=0.025,
    )
    link = LinkModel(1e-3, 1e9, 2)  # cost 2 ms + n / 1 GB/s per bucket at P = 2
    # b = 4 MiB: buckets [40k] @1ms, [4M] @2ms, [4M, 64] @11ms, [8M] @20ms, in series.
    t = 0.001 + 0.002 + 40_000 / 1e9
    t = max(t, 0.002) + 0.002 + 4 * MIB / 1e9
    t = max(t, 0.011) + 0.002 + (4 * MIB + 64) / 1e9
    t = max(t, 0.020) + 0.002 + 8 * MIB / 1e9
    assert predict_exposed(profile, link, 2, 4 * MIB + 64) == pytest.approx(t - 0.025)


# -- profiles and the recorder ----------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _step(recorder: BackwardRecorder, clock: FakeClock, events: list[tuple[float, int]],
          total: float) -> None:  # fmt: skip
    start = clock.now
    recorder.start()
    for at, index in events:
        clock.now = start + at
        recorder.record(index, 4 * (index + 1))
    clock.now = start + total
    recorder.stop()
    clock.now += 1.0  # forward and update of the next step


def test_recorder_averages_kept_steps() -> None:
    clock = FakeClock()
    recorder = BackwardRecorder(num_steps=2, skip_steps=1, clock=clock)
    recorder.record(0, 4)  # not started: ignored
    _step(recorder, clock, [(0.5, 2), (0.9, 1)], total=1.0)  # skipped warm-up step
    assert not recorder.done
    _step(recorder, clock, [(0.001, 2), (0.004, 1), (0.006, 0)], total=0.010)
    _step(recorder, clock, [(0.003, 2), (0.002, 1), (0.008, 0)], total=0.020)
    assert recorder.done
    _step(recorder, clock, [(5.0, 0)], total=9.0)  # after done: ignored
    profile = recorder.profile()
    assert profile.num_steps == 2 and profile.num_layers == 3
    assert profile.backward_s == pytest.approx(0.015)
    assert profile.param_indices == (2, 1, 0)
    assert profile.ready_s == pytest.approx((0.002, 0.003, 0.007))
    assert profile.nbytes == (12, 8, 4) and profile.total_bytes == 24
    assert profile.bytes_per_layer == 8


def test_recorder_handles_parameters_seen_in_some_steps() -> None:
    clock = FakeClock()
    recorder = BackwardRecorder(num_steps=2, skip_steps=0, clock=clock)
    _step(recorder, clock, [(0.001, 0), (0.009, 5)], total=0.010)
    _step(recorder, clock, [(0.002, 0)], total=0.004)
    profile = recorder.profile()
    assert profile.param_indices == (0, 5)
    assert profile.ready_s == pytest.approx((0.0015, 0.007))  # 5: its one step, below E_b
    assert profile.backward_s == pytest.approx(0.007)
    with pytest.raises(ValueError, match="no profiled step"):
        BackwardRecorder(num_steps=1).profile()
    with pytest.raises(ValueError, match="num_steps >= 1"):
        BackwardRecorder(num_steps=0)


def test_recorder_on_a_real_backward() -> None:
    """Hooked like the Engine hooks its buckets: every gradient recorded once, in ready order."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    params = list(model.parameters())
    recorder = BackwardRecorder(num_steps=2, skip_steps=1)
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(
            lambda p, i=i: recorder.record(i, p.numel() * p.element_size())
        )
    while not recorder.done:
        model.zero_grad()
        loss = model(torch.randn(8, 16)).square().mean()
        recorder.start()
        loss.backward()
        recorder.stop()
    profile = recorder.profile()
    assert sorted(profile.param_indices) == [0, 1, 2, 3]
    assert set(profile.param_indices[:2]) == {2, 3}  # the last layer's gradients come first
    assert profile.total_bytes == sum(p.numel() * 4 for p in params)
    assert 0 <= profile.ready_s[0] and profile.ready_s[-1] <= profile.backward_s


def test_profile_checks_and_round_trip() -> None:
    profile = BackwardProfile.uniform(1000, 3, 0.01)
    assert profile.nbytes == (333, 333, 334) and profile.ready_s[-1] == 0.01
    assert BackwardProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    with pytest.raises(ValueError, match="ascending"):
        BackwardProfile(ready_s=(0.2, 0.1), nbytes=(1, 1), backward_s=1.0)
    with pytest.raises(ValueError, match=r"within \[0, backward_s\]"):
        BackwardProfile(ready_s=(0.1, 2.0), nbytes=(1, 1), backward_s=1.0)
    with pytest.raises(ValueError, match="one ready time and one size"):
        BackwardProfile(ready_s=(), nbytes=(), backward_s=1.0)


# -- phalanx bench link (report and bad input; the real run is in docs/benchmarks.md) ---------
def test_bench_link_report_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    from phalanx.bench import link as bench
    from phalanx.cli import main

    samples = ((1e-4, 1.2e-4, 3e-4), (2e-4, 2.1e-4, 2.2e-4))
    link = model_from_fit(1e-4, 1e-9, 2, sizes=(4096, 16384), samples_s=samples, backend="gloo")
    profile = BackwardProfile.uniform(G, 8, 0.02)
    result = {
        "meta": bench._meta(bench.LinkBenchConfig(), "gloo", 1.0),
        "rounds": [{"link": link.to_dict(), "seconds": 0.1}],
        "median": link.to_dict(),
        "representative_round": 0,
        "thresholds": [bench._threshold("mlp", profile.to_dict(), link, 2)],
    }
    json.dumps(result)
    text = bench.format_report(result)
    assert "4 KiB" in text and "16 KiB" in text and "fitted ms" in text
    assert f"{link.alpha_s * 1e6:.1f}" in text and "median" in text
    assert "mlp: fusion threshold" in text and "whole model" in text
    for argv, message in (
        (["--nproc", "0"], "--nproc: must be >= 1"),
        (["--models", "resnet"], "--models: unknown model 'resnet'"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "link", *argv])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_the_threshold_reads_layer_costs_from_either_producer():
    """The recorder's profile and the per-layer cost type convert both ways; the choice from the
    profiler's layers (no gradients in some, several in others) is the choice from the replay."""
    profile = BackwardProfile(
        ready_s=(0.001, 0.001, 0.004),
        nbytes=(MIB, 2 * MIB, 3 * MIB),
        backward_s=0.006,
        param_indices=(2, 0, 1),
    )
    layers = profile.layer_costs(forward_s=0.003)
    assert [x.name for x in layers] == ["grad2", "grad0", "grad1", "tail"]
    assert sum(x.forward_s for x in layers) == pytest.approx(0.003)
    again = BackwardProfile.from_layers(layers)
    assert again.ready_s == pytest.approx(profile.ready_s)
    assert again.nbytes == profile.nbytes and again.backward_s == pytest.approx(0.006)
    grouped = [
        LayerCost(name="loss", backward_s=0.001),
        LayerCost(name="head", backward_s=0.002, grad_bytes=(MIB, 2 * MIB)),
        LayerCost(name="body", backward_s=0.003, grad_bytes=(3 * MIB,)),
    ]
    replay = BackwardProfile.from_layers(grouped)
    assert replay.ready_s == pytest.approx((0.003, 0.003, 0.006))
    link = LinkModel(45e-6, 1.2e9, 2)
    assert choose_bucket_bytes(grouped, link, 2) == choose_bucket_bytes(
        replay.layer_costs(), link, 2
    )
    with pytest.raises(ConfigError, match="no layer has gradients"):
        choose_bucket_bytes([LayerCost(name="x", backward_s=1.0)], link, 2)
