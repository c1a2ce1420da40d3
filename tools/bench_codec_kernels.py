"""Time the elementwise choices behind phalanx's fp16 codec (docs/benchmarks.md).

One process, one intra-op thread, N float32 elements (default 8.4M, the bench MLP's gradients).
Each row times one way to do one codec operation; the codec uses the first of each group:
    python tools/bench_codec_kernels.py [--numel N] [--reps R]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch

from phalanx.exchange.compression import make_codec


def median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: allocations and caches
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def rows(numel: int) -> list[tuple[str, str, Callable[[], object]]]:
    g = torch.randn(numel)
    half = torch.empty(numel, dtype=torch.float16)
    work, acc = torch.empty(numel), torch.randn(numel)
    codec = make_codec("fp16")
    message = codec.empty_message(g)
    return [
        ("largest magnitude", "torch.aminmax (one pass)", lambda: torch.aminmax(g)),
        ("largest magnitude", "abs().max()", lambda: g.abs().max()),
        ("largest magnitude", "vector_norm(inf)", lambda: torch.linalg.vector_norm(g, math.inf)),
        (
            "scale and cast",
            "mul into float32 buffer, then cast",
            lambda: (torch.mul(g, 2.0, out=work), half.copy_(work)),
        ),
        ("scale and cast", "mul(out=float16), mixed dtypes", lambda: torch.mul(g, 2.0, out=half)),
        (
            "cast and add",
            "cast into float32 buffer, then add",
            lambda: (work.copy_(half), acc.add_(work, alpha=0.5)),
        ),
        ("cast and add", "add_(float16), mixed dtypes", lambda: acc.add_(half, alpha=0.5)),
        (
            "encode a message",
            "codec.encode into a reused buffer",
            lambda: codec.encode(g, out=message),
        ),
        ("encode a message", "codec.encode into a fresh buffer", lambda: codec.encode(g)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=8_400_000)
    parser.add_argument("--reps", type=int, default=11)
    args = parser.parse_args()
    torch.set_num_threads(1)
    setup = f"torch {torch.__version__}, 1 thread, median of {args.reps}"
    print(f"{args.numel:,} float32 elements, {setup}")
    for operation, way, fn in rows(args.numel):
        print(f"{operation:18s} {way:38s} {median_ms(fn, args.reps):8.2f} ms")


if __name__ == "__main__":
    main()
