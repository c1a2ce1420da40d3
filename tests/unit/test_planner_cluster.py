"""Cluster files: loading, one-line errors naming the file and key, link.json, round trips."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from phalanx.errors import ConfigError
from phalanx.exchange.link import LinkModel
from phalanx.planner.cluster import (
    ClusterConfig,
    LinkConfig,
    cluster_to_toml,
    from_link,
    load_cluster,
)

ROOT = Path(__file__).resolve().parents[2]
GOOD = """
name = "two nodes"
devices_per_node = 4
nodes = 2
[intra]
alpha_s = 1e-5
beta_bytes_per_s = 8e9
[inter]
alpha_s = 2e-5
beta_bytes_per_s = 3e9
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def one_line(error: pytest.ExceptionInfo, *fragments: str) -> str:
    message = str(error.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_good_file_loads(tmp_path):
    cluster = load_cluster(write(tmp_path, GOOD))
    assert cluster.devices_per_node == 4 and cluster.nodes == 2 and cluster.capacity == 8
    assert cluster.inter == LinkConfig(alpha_s=2e-5, beta_bytes_per_s=3e9)
    assert cluster.shared_nic and cluster.compute_speed == 1.0
    assert [cluster.node_of(r) for r in (0, 3, 4, 7)] == [0, 0, 1, 1]
    assert cluster.ring_link(4) == (1e-5, 8e9)  # one node: the intra link
    assert cluster.ring_link(8) == (2e-5, 3e9)  # the ring waits for its slowest link


@pytest.mark.parametrize(
    "edit, fragments",
    [
        (("beta_bytes_per_s = 3e9", "beta_bytes_per_s = -1.0"), ("inter.beta_bytes_per_s",)),
        (("alpha_s = 1e-5", 'alpha_s = "fast"'), ("intra.alpha_s", "expected float")),
        (("devices_per_node = 4", "devices_per_node = 0"), ("devices_per_node", ">= 1")),
        (("nodes = 2", "nodes = 2\ngpus = 3"), ("gpus", "unknown key")),
        (("[inter]\nalpha_s = 2e-5\nbeta_bytes_per_s = 3e9", ""), ("inter", "missing")),
        (('name = "two nodes"', ""), ("name",)),
        (("nodes = 2", "nodes = 2\nhandoff_s = -1e-4"), ("handoff_s", ">= 0")),
        (("nodes = 2", "nodes = 2\nadd_s_per_byte = -1.0"), ("add_s_per_byte", ">= 0")),
        (("nodes = 2", "nodes = 2\nhost_cores_per_node = -2"), ("host_cores_per_node", ">= 0")),
        (("[intra]", "[intra\n"), ("invalid TOML",)),
    ],
)
def test_mistakes_are_one_line_naming_file_and_key(tmp_path, edit, fragments):
    path = write(tmp_path, GOOD.replace(*edit))
    with pytest.raises(ConfigError) as error:
        load_cluster(path)
    one_line(error, str(path), *fragments)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_cluster(tmp_path / "nope.toml")
    one_line(error, "not found", "nope.toml")


def test_devices_must_fit(tmp_path):
    cluster = load_cluster(write(tmp_path, GOOD))
    cluster.check_devices(8)
    with pytest.raises(ConfigError) as error:
        cluster.check_devices(9)
    one_line(error, "--devices", "9", "8")
    single = ClusterConfig(
        name="one", nodes=1, devices_per_node=2, intra=LinkConfig(alpha_s=0, beta_bytes_per_s=1e9)
    )
    with pytest.raises(ConfigError):
        single.check_devices(3)


def test_toml_round_trip_and_shipped_files():
    for path in sorted((ROOT / "configs" / "clusters").glob("*.toml")):
        cluster = load_cluster(path)
        text = cluster_to_toml(cluster, "a comment")
        assert text.startswith("# a comment\n")
        again = path.with_name("_roundtrip.toml")
        try:
            again.write_text(text)
            assert load_cluster(again) == cluster, path.name
        finally:
            again.unlink()


def test_from_link_json(tmp_path):
    link = LinkModel(alpha_s=1e-4, beta_bytes_per_s=1.2e9, world_size=2, backend="gloo")
    saved = link.save(tmp_path)
    cluster = from_link(saved)
    assert cluster.nodes == 1 and cluster.devices_per_node == 2
    # Gloo: the ring's 2 concurrent messages per step share one medium of 2 x beta
    assert cluster.shared_intra
    assert cluster.intra == LinkConfig(alpha_s=0.5e-4, beta_bytes_per_s=2.4e9)
    assert from_link(tmp_path).intra == cluster.intra  # a directory means its link.json
    nccl = from_link(LinkModel(alpha_s=1e-5, beta_bytes_per_s=1e11, world_size=8, backend="nccl"))
    assert not nccl.shared_intra and nccl.intra == LinkConfig(alpha_s=1e-5, beta_bytes_per_s=1e11)
    solo = LinkModel(alpha_s=0.0, beta_bytes_per_s=float("inf"), world_size=1)
    with pytest.raises(ConfigError) as error:
        from_link(solo)
    one_line(error, "bench link")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError):
        from_link(tmp_path / "bad.json")


def test_from_link_charges_the_message_probe_beyond_the_link(tmp_path):
    """A link.json with the message probe (phalanx bench link) gives the cluster the mean
    one-way time beyond what the link model gives the same 4 KiB message; without a probe, or
    with a probe faster than the model, nothing."""
    link = LinkModel(alpha_s=1e-4, beta_bytes_per_s=1.2e9, world_size=2, backend="gloo")
    assert from_link(link).message_overhead_s == 0.0
    probed = dataclasses.replace(link, message_samples_s=(2e-4, 4e-4, 9e-4))
    modelled = 0.5e-4 + 4096 / 2.4e9  # the cluster's intra link: alpha / 2, 2 x beta
    assert from_link(probed).message_overhead_s == pytest.approx(5e-4 - modelled)
    fast = dataclasses.replace(link, message_samples_s=(1e-5,))
    assert from_link(fast).message_overhead_s == 0.0
    saved = LinkModel.load(probed.save(tmp_path))  # the samples survive link.json
    assert saved.message_samples_s == probed.message_samples_s
    # the --json of `phalanx bench link` holds the median model: --cluster reads that
    bench = {"meta": {}, "rounds": [], "median": probed.to_dict()}
    (tmp_path / "bench_link.json").write_text(json.dumps(bench))
    assert from_link(tmp_path / "bench_link.json") == from_link(probed)


def test_from_link_takes_the_hand_over_probe_and_the_probe_measures(tmp_path):
    """A link.json with hand-over samples gives the cluster their median as ``handoff_s``
    (none: 0); the probe returns two latencies per hand-over, real and below a second, and
    leaves no thread behind."""
    import threading

    from phalanx.exchange.comm import measure_handoff_s

    link = LinkModel(alpha_s=1e-4, beta_bytes_per_s=1.2e9, world_size=2, backend="gloo")
    assert from_link(link).handoff_s == 0.0
    probed = dataclasses.replace(link, handoff_samples_s=(1e-4, 2e-4, 6e-3))
    assert from_link(probed).handoff_s == pytest.approx(2e-4)
    assert LinkModel.load(probed.save(tmp_path)).handoff_samples_s == probed.handoff_samples_s
    samples = measure_handoff_s(repeats=5, work_s=2e-4, pause_s=1e-4)
    assert len(samples) == 10 and all(0 < t < 1.0 for t in samples)
    assert not [t for t in threading.enumerate() if t.name == "phalanx-handoff-probe"]


def test_median_of_calibrations_keeps_one_round_of_slow_wake_ups_out():
    """``LinkModel.median_of``: median alpha and beta, and each probe's samples from the
    round whose statistic is the median: one round's burst (a mean of 10 ms) is not the
    model's."""
    rounds = [
        LinkModel(
            alpha_s=a,
            beta_bytes_per_s=b,
            world_size=2,
            backend="gloo",
            message_samples_s=m,
            handoff_samples_s=h,
        )  # fmt: skip
        for a, b, m, h in [
            (1e-4, 3e9, (1e-4, 1e-4), (3e-5,)),
            (9e-4, 1e9, (1e-2, 1e-2), (9e-3,)),
            (2e-4, 2e9, (2e-4, 2e-4), (4e-5,)),
        ]
    ]
    median = LinkModel.median_of(rounds)
    assert (median.alpha_s, median.beta_bytes_per_s) == (2e-4, 2e9)
    assert median.message_samples_s == (2e-4, 2e-4)
    assert median.handoff_samples_s == (4e-5,)
    unprobed = [dataclasses.replace(r, message_samples_s=(), handoff_samples_s=()) for r in rounds]
    assert LinkModel.median_of(unprobed).message_s is None
