"""A ResNet training script written for DDP first (pytorch/examples' ImageNet style), and its
phalanx port, which changes only the lines the port guide names (marked ``# port``).

Usage (under torchrun): ddp_resnet.py OUT_DIR RUN [RUN ...] [--epochs N] [--resume PATH]

Each RUN is ``ddp`` (torch's DistributedDataParallel; first, as it joins the process group
itself) or a phalanx strategy; each trains a fresh model for ``--epochs`` epochs (default 4) in
this one job, then the job ends with the script's own ``dist.destroy_process_group()``.

Per epoch: ``model.train()``, two micro-batches per update (the first under ``no_sync``),
train accuracy from the outputs, ``model.eval()`` and a validation under ``torch.no_grad()``
(accuracy all-reduced, as the ImageNet example does), ``scheduler.step()``, and rank 0 saves
``OUT_DIR/RUN/checkpoint_E.pt`` = {epoch, state_dict, optimizer, scheduler}; at the end rank 0
saves the weights to ``OUT_DIR/RUN/model_final.pt`` (under DDP reading them alone; the port
gathers them on every rank with ``engine.full_state_dict()``). Every rank records its losses and
accuracies in ``OUT_DIR/RUN/metrics_rank_R.json``. ``--resume PATH`` (``{run}`` in PATH is
replaced by the run's name): load such a checkpoint and train the epochs after it.
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import phalanx as px

CLASSES, SIZE = 4, 12  # 4 classes of 3 x 12 x 12 images
TRAIN, VAL = 72, 36  # samples; every rank gets a whole number of micro-batches at worlds 2, 3
BATCH, ACCUM = 6, 2  # per rank: micro-batch size, micro-batches per update


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):  # torchvision's
    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            conv = nn.Conv2d(inplanes, planes, kernel_size=1, stride=stride, bias=False)
            self.downsample = nn.Sequential(conv, nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv1 = conv3x3(3, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.fc = nn.Linear(2 * width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(torch.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def datasets() -> tuple[TensorDataset, TensorDataset]:
    """Synthetic images: one noisy pattern per class, the same in every process."""
    g = torch.Generator().manual_seed(1234)
    patterns = torch.randn(CLASSES, 3, SIZE, SIZE, generator=g)

    def make(n: int) -> TensorDataset:
        labels = torch.randint(0, CLASSES, (n,), generator=g)
        images = patterns[labels] + 1.5 * torch.randn(n, 3, SIZE, SIZE, generator=g)
        return TensorDataset(images, labels)

    return make(TRAIN), make(VAL)


def main(run: str, out: Path, epochs: int, resume: str | None) -> None:
    ddp = run == "ddp"
    if ddp:
        dist.init_process_group("gloo")
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        ctx = px.init()  # port
        rank, world_size = ctx.rank, ctx.world_size
    out.mkdir(parents=True, exist_ok=True)

    train_set, val_set = datasets()
    train_sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=0)
    val_sampler = DistributedSampler(val_set, world_size, rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=BATCH, sampler=train_sampler)
    val_loader = DataLoader(val_set, batch_size=BATCH, sampler=val_sampler)

    torch.manual_seed(0)
    model = ResNet()
    criterion = nn.CrossEntropyLoss()
    decay = [p for p in model.parameters() if p.dim() > 1]  # convolutions and fc weight
    no_decay = [p for p in model.parameters() if p.dim() <= 1]  # BatchNorm, biases
    groups = [{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[2, 3], gamma=0.5)
    start_epoch = 0
    if resume:
        checkpoint = torch.load(resume.format(run=run))
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        start_epoch = checkpoint["epoch"]
    if ddp:
        model = DDP(model)
    else:  # port
        engine = px.Engine(model, criterion, optimizer, exchange=run, return_outputs=True)

    metrics = []
    for epoch in range(start_epoch, epochs):
        train_sampler.set_epoch(epoch)
        (model if ddp else engine.module).train()  # port
        losses, correct, seen = [], 0, 0
        for i, (images, target) in enumerate(train_loader):
            update = (i + 1) % ACCUM == 0
            if ddp:
                with nullcontext() if update else model.no_sync():
                    output = model(images)
                    loss = criterion(output, target)
                    (loss / ACCUM).backward()
                if update:
                    optimizer.step()
                    optimizer.zero_grad()
            else:  # port
                with nullcontext() if update else engine.no_sync():
                    loss, output = engine.step(images, target)
            losses.append(loss.item())
            correct += int((output.argmax(1) == target).sum())
            seen += len(target)

        net = model if ddp else engine.module  # port
        net.eval()
        val_losses, val_correct, val_seen = [], 0, 0
        with torch.no_grad():
            for images, target in val_loader:
                output = net(images)
                val_losses.append(criterion(output, target).item())
                val_correct += int((output.argmax(1) == target).sum())
                val_seen += len(target)
        net.train()
        counts = torch.tensor([correct, seen, val_correct, val_seen], dtype=torch.float64)
        dist.all_reduce(counts)
        scheduler.step()
        if rank == 0:
            print(
                f"{run} epoch {epoch}: loss {sum(losses) / len(losses):.4f} "
                f"train acc {counts[0] / counts[1]:.3f} val acc {counts[2] / counts[3]:.3f}",
                flush=True,
            )
        metrics.append(
            {"epoch": epoch, "losses": losses, "train": [correct, seen], "val_losses": val_losses,
             "val": [val_correct, val_seen], "global": counts.tolist()}
        )  # fmt: skip

        state = {
            "epoch": epoch + 1,
            "state_dict": model.module.state_dict() if ddp else engine.full_state_dict(),  # port
            "optimizer": optimizer.state_dict() if ddp else engine.optimizer_state_dict(),  # port
            "scheduler": scheduler.state_dict(),
        }
        if rank == 0:
            torch.save(state, out / f"checkpoint_{epoch + 1}.pt")

    if ddp:
        if rank == 0:  # the final weights: rank 0 alone reads them
            torch.save(model.module.state_dict(), out / "model_final.pt")
    else:  # port: every rank gathers (under fsdp each holds rows), rank 0 saves
        weights = engine.full_state_dict()
        if rank == 0:
            torch.save(weights, out / "model_final.pt")
    (out / f"metrics_rank_{rank}.json").write_text(json.dumps(metrics))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    for run in args.runs:
        main(run, args.out / run, args.epochs, args.resume)
    dist.destroy_process_group()
