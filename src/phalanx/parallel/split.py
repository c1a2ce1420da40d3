"""Where the stage boundaries go: given by hand, even, or balanced (``auto``) by the per-layer
profiler's forward + backward times so the slowest stage is fastest (docs/parallel.md)."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from phalanx.costs import LayerCost

PROFILE_REPEATS = 3  # timed steps after one warm-up


def even_split(num_layers: int, num_stages: int) -> list[int]:
    """Stage of each layer: equal counts, the first stages one layer longer when uneven."""
    base, extra = divmod(num_layers, num_stages)
    return [s for s in range(num_stages) for _ in range(base + (s < extra))]


def balanced_split(costs: list[float], num_stages: int) -> list[int]:
    """Stage of each layer: contiguous, non-empty stages minimising the largest stage cost
    (dynamic programming over cut points, O(layers^2 x stages))."""
    n = len(costs)
    assert 1 <= num_stages <= n, "more stages than layers is checked by the caller"
    prefix = [0.0, *itertools.accumulate(costs)]
    inf = float("inf")
    # best[k][i]: the smallest max-stage cost of the first i layers cut into k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    stages, i = [0] * n, n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        stages[j:i] = [k - 1] * (i - j)
        i = j
    return stages


def profile_layers(layers: list[nn.Module], sample: torch.Tensor) -> list[LayerCost]:
    """Each layer's cost on ``sample`` (one micro-batch of inputs, any device) from
    ``profile_model`` where the layers are: no targets, so backward starts from ones and no
    optimizer step (parameters untouched, gradients None), no allocator peak."""
    from phalanx.memory.profile import profile_model

    batches = [(sample, None)] * (PROFILE_REPEATS + 1)
    device = _device_of(layers, sample)
    profile = profile_model(layers, None, None, batches, device, warmup=1, measure_peak=False)
    return profile.layer_costs()


def _device_of(layers: list[nn.Module], sample: torch.Tensor) -> torch.device:
    """Where the layers are, or the sample's device when they hold no tensors."""
    for layer in layers:
        for t in itertools.chain(layer.parameters(), layer.buffers()):
            return t.device
    return sample.device


def describe_split(stages: list[int], costs: list[LayerCost] | None) -> str:
    """'stage 0: layers 0-3 (12.1 ms, 1.2 MB params) | stage 1: ...' for logs and --dry-run."""
    parts = []
    for s in range(max(stages) + 1):
        members = [i for i, k in enumerate(stages) if k == s]
        text = f"stage {s}: layers {members[0]}-{members[-1]}"
        if costs is not None:
            ms = sum(costs[i].seconds for i in members) * 1e3
            mb = sum(costs[i].param_bytes for i in members) / 1e6
            text += f" ({ms:.2f} ms fwd+bwd, {mb:.2f} MB params)"
        parts.append(text)
    return " | ".join(parts)
