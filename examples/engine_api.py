"""The Engine from Python: run with `python examples/engine_api.py` (a world of one) or
`torchrun --nproc-per-node 2 examples/engine_api.py` (two processes: each takes 32 samples a
step, so the global batch is 64 and the result differs from one process's, as under DDP)."""

from __future__ import annotations

import functools

import torch

import phalanx as px
from phalanx.data import DataConfig, ShardedBatches, load_source
from phalanx.models.zoo import digits_cnn


def main() -> None:
    ctx = px.init()
    torch.manual_seed(0)
    data = load_source(DataConfig(source="digits"))
    batches = ShardedBatches(data.x_train, data.y_train, 32, ctx.rank, ctx.world_size)
    engine = px.Engine(
        digits_cnn(),
        torch.nn.functional.cross_entropy,
        optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    )
    for step in range(1, 201):
        loss = engine.step(*batches.next())
        if ctx.is_main and step % 50 == 0:
            s = engine.stats
            print(
                f"step {step}: loss {float(loss):.3f}, backward {s.backward_s * 1e3:.1f} ms, "
                f"exposed exchange {s.exchange_s * 1e3:.2f} ms, {s.bytes_sent} bytes sent"
            )
    engine.module.eval()
    with torch.no_grad():
        accuracy = (engine.module(data.x_val).argmax(1) == data.y_val).float().mean()
    if ctx.is_main:
        print(f"validation accuracy {accuracy:.3f}")
    px.shutdown()


if __name__ == "__main__":
    main()
