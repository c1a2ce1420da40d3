"""Published scaling points stay within their stated error (docs/planner.md's table)."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.planner.cluster import load_cluster
from phalanx.planner.published import ARCHITECTURES, CLUSTERS, PUBLISHED, validate

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("published", [p for p in PUBLISHED if p.reported], ids=lambda p: p.key)
def test_reported_points_within_stated_error(published):
    for v in validate(published):
        assert v.within, (
            f"{published.key} at {v.reported.devices}: predicted {v.predicted:.3f}, "
            f"reported {v.reported.value}, error {v.error:+.1%} > {published.tolerance:.0%}"
        )


def test_cluster_files_match_the_models():
    for key, cluster in CLUSTERS.items():
        assert load_cluster(ROOT / "configs" / "clusters" / f"{key}.toml") == cluster, key


@pytest.mark.parametrize(
    "name, params",
    [
        ("vgg16", 138.36e6),
        ("resnet50", 25.56e6),
        ("resnet101", 44.55e6),
        ("inception_v3", 23.83e6),
        ("googlenet", 13.37e6),
        ("bert_large", 336.2e6),
    ],
)
def test_architectures_have_their_published_sizes(name, params):
    layers = ARCHITECTURES[name]()
    assert sum(p for _, p, _ in layers) == pytest.approx(params, rel=0.005)


def test_every_assumption_is_written_down():
    for published in PUBLISHED:
        assert published.assumptions and published.discrepancy and published.throughput_source
        assert published.cluster in CLUSTERS and CLUSTERS[published.cluster].description
