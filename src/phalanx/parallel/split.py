"""Where the stage boundaries go: given by hand, even, or balanced by measured cost.

``auto`` profiles each layer on one process (forward and backward of one sample micro-batch,
a few times after a warm-up, median) and cuts the layer sequence into contiguous stages so
that the slowest stage is as fast as possible; parameter memory is reported per stage.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from phalanx.costs import LayerCost

PROFILE_REPEATS = 3  # timed passes after one warm-up


def even_split(num_layers: int, num_stages: int) -> list[int]:
    """Stage of each layer: equal counts, the first stages one layer longer when uneven."""
    base, extra = divmod(num_layers, num_stages)
    stages = []
    for s in range(num_stages):
        stages += [s] * (base + (1 if s < extra else 0))
    return stages


def balanced_split(costs: list[float], num_stages: int) -> list[int]:
    """Stage of each layer: contiguous, non-empty stages minimising the largest stage cost
    (dynamic programming over cut points, O(layers^2 x stages))."""
    n = len(costs)
    assert 1 <= num_stages <= n, "more stages than layers is checked by the caller"
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
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
    """Each layer's forward + backward time on ``sample`` (one micro-batch, on the layers'
    device), measured layer by layer: a layer's input is a detached leaf, so its backward is
    timed alone with the output gradient the next layer produced."""
    times: list[list[float]] = [[] for _ in layers]
    outputs: list[torch.Tensor] = []
    for repeat in range(PROFILE_REPEATS + 1):
        x, inputs, outputs, fwd = sample, [], [], []
        for layer in layers:
            leaf = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(leaf)
            _sync(out)
            fwd.append(time.perf_counter() - start)
            inputs.append(leaf)
            outputs.append(out)
            x = out
        grad = torch.ones_like(outputs[-1])
        for i in reversed(range(len(layers))):
            start = time.perf_counter()
            if outputs[i].requires_grad:
                torch.autograd.backward(outputs[i], grad)
            _sync(outputs[i])
            elapsed = time.perf_counter() - start
            if repeat > 0:  # the first pass warms up allocators and kernels
                times[i].append(fwd[i] + elapsed)
            leaf = inputs[i]
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        for layer in layers:
            layer.zero_grad(set_to_none=True)
    return [
        LayerCost(
            name=str(i),
            forward_s=statistics.median(times[i]),  # forward and backward timed together
            param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
            output_bytes=outputs[i].numel() * outputs[i].element_size(),
        )
        for i, layer in enumerate(layers)
    ]


def _sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)


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
