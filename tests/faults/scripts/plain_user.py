"""The shortest script a user writes: no sync(), no close(), no shutdown(); it just ends.

Usage: python plain_user.py OUT_DIR SPEC [SPEC ...], each SPEC "strategy:compress:bucket_mb"
(e.g. "ps:none:auto"), with ":host" or ":mirror" appended for ``[memory] optimizer``. Run one copy
per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set (as torchrun does).
Each rank trains one model per SPEC on its share of the same global batches, with Adam and a
StepLR scheduler, then saves ``model.state_dict()`` and the optimizer's learning rate straight
after the last step. An atexit hook registered before phalanx is imported runs last and
records whether anything was left behind.
"""

import atexit
import json
import sys
import threading
from pathlib import Path

OUT = Path(sys.argv[1])


def _leftovers() -> None:
    import os

    import torch.distributed as dist

    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    record = {"process_group": dist.is_initialized(), "threads": threads}
    rank = os.environ["RANK"]
    (OUT / f"exit-rank{rank}.json").write_text(json.dumps(record))


atexit.register(_leftovers)  # registered first, so it runs after phalanx's teardown

import functools  # noqa: E402

import torch  # noqa: E402

import phalanx as px  # noqa: E402
from phalanx.memory.manager import MemoryConfig, MemoryManager  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from plain_model import STEPS, batches, build_model  # noqa: E402


class DDPStep:
    """A user's DDP training step, shaped like ``engine.step``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        self.optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(self.ddp(x), y).backward()
        self.optimizer.step()


ctx = px.init()
engines, schedulers = [], []
for spec in sys.argv[2:]:
    strategy, compress, bucket, *host = spec.split(":")
    torch.manual_seed(0)
    model = build_model()
    if strategy == "ddp":  # torch's DDP in the same process (it once made ps abort at exit)
        engine = DDPStep(model)
        engines.append((spec, model, engine))
        schedulers.append(torch.optim.lr_scheduler.StepLR(engine.optimizer, 2, gamma=0.5))
        continue
    memory = None
    if host:  # "...:host": state in a spill file between steps; "...:mirror": on the host
        config = MemoryConfig(optimizer=host[0], optimizer_chunk_mb=0.01)
        memory = MemoryManager.build([], config, ctx.device)
    engine = px.Engine(
        model,
        torch.nn.functional.cross_entropy,
        optimizer=functools.partial(torch.optim.Adam, lr=0.01),
        exchange=strategy,
        compress=None if compress == "none" else compress,
        bucket_mb=bucket if bucket == "auto" else float(bucket),
        memory=memory,
    )
    engines.append((spec, model, engine))
    schedulers.append(torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=2, gamma=0.5))
for step in range(STEPS):
    for (_, _, engine), scheduler in zip(engines, schedulers):
        x, y = batches(step, ctx.rank, ctx.world_size)
        engine.step(x, y)
        scheduler.step()
for spec, model, engine in engines:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    lr = engine.optimizer.param_groups[0]["lr"]
    torch.save({"state": state, "lr": lr}, OUT / f"{spec.replace(':', '_')}-rank{ctx.rank}.pt")
