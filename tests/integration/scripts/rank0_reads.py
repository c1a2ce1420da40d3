"""A user's script where only rank 0 reads the trained weights, as people write them.

Usage (under torchrun): rank0_reads.py OUT_DIR SPEC [SPEC ...] [--raise-on RANK]
Each SPEC is "strategy:compress" (e.g. "ps:fp16"). For each, ``main`` builds a fresh model and
Engine (so Engines are built one after another), trains on this rank's shard, and returns; only
rank 0 then saves -- ``engine.module.state_dict()`` for even-numbered specs, the plain
``model.state_dict()`` with ``torch.save`` for odd ones; under fsdp every rank calls
``engine.full_state_dict()`` and rank 0 saves it -- and runs an evaluation forward, so
ranks leave ``main`` at different times. No sync(), close() or shutdown(): the script just ends.
``--raise-on R``: rank R raises after its last step of the last spec.
"""

import functools
import os
import sys
from pathlib import Path

import torch

import phalanx as px

sys.path.insert(0, str(Path(__file__).parent))
from user_model import STEPS, build_model, shard  # noqa: E402


def main(out: Path, spec: str, index: int, raise_on: int | None) -> None:
    strategy, compress = spec.split(":")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = build_model()
    engine = px.Engine(
        model,
        torch.nn.functional.cross_entropy,
        optimizer=functools.partial(torch.optim.Adam, lr=0.01),
        exchange=strategy,
        compress=None if compress == "none" else compress,
    )
    for step in range(STEPS):
        engine.step(*shard(step, rank, world_size))
    if rank == raise_on:
        raise RuntimeError(f"user code failed on rank {rank} after training")
    # fsdp shards the model itself (as torch's fully_shard does): every rank gathers it
    whole = engine.full_state_dict() if strategy == "fsdp" else None
    if rank == 0:
        weights = whole or (model.state_dict() if index % 2 else engine.module.state_dict())
        torch.save(weights, out / f"{strategy}_{compress}.pt")
        evaluated = model if whole is None else build_model()
        if whole is not None:
            evaluated.load_state_dict(whole)
        evaluated.eval()
        with torch.no_grad():
            evaluated(shard(0, 0, 1)[0])  # an evaluation only rank 0 runs


if __name__ == "__main__":
    args = sys.argv[1:]
    raise_on = None
    if "--raise-on" in args:
        at = args.index("--raise-on")
        raise_on = int(args[at + 1])
        del args[at : at + 2]
    out, specs = Path(args[0]), args[1:]
    for index, spec in enumerate(specs):
        last = index == len(specs) - 1
        main(out, spec, index, raise_on if last else None)
