"""Learning-rate schedules from ``[scheduler]``: torch.optim.lr_scheduler, registered by name.

A schedule spans the run's optimizer steps: ``warmup_steps`` of ``LinearLR`` warm-up, then the
named schedule, chained with ``SequentialLR``; its state is in checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch.optim import lr_scheduler

from phalanx.fields import option, require
from phalanx.registry import Registry

Optimizer: TypeAlias = torch.optim.Optimizer
Scheduler: TypeAlias = lr_scheduler.LRScheduler
SCHEDULES: Registry[Scheduler] = Registry("lr schedule")


@dataclass(kw_only=True)
class SchedulerConfig:
    """How the learning rate changes over the run's optimizer steps."""

    name: str = option("none", "none, constant, cosine, linear, step or onecycle")
    warmup_steps: int = option(0, "linear warm-up steps before the schedule (not with onecycle)")
    warmup_start: float = option(0.01, "warm-up starts at this fraction of the learning rate")
    min_lr: float = option(0.0, "cosine and linear: the learning rate at the last step")
    step_size: int = option(100, "step: decay every this many steps")
    gamma: float = option(0.1, "step: multiply the learning rate by this at each decay")
    max_lr: float = option(0.0, "onecycle: the peak learning rate (0: optimizer.lr)")

    def __post_init__(self) -> None:
        SCHEDULES.require_known(self.name, "name", "schedule", extra=["none"])
        require(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        start = self.warmup_start
        require(0 < start <= 1, "warmup_start", f"must be in (0, 1], got {start}")
        require(self.min_lr >= 0, "min_lr", f"must be >= 0, got {self.min_lr}")
        require(self.step_size >= 1, "step_size", f"must be >= 1, got {self.step_size}")
        require(0 < self.gamma <= 1, "gamma", f"must be in (0, 1], got {self.gamma}")
        require(self.max_lr >= 0, "max_lr", f"must be >= 0, got {self.max_lr}")
        require(
            not (self.name == "onecycle" and self.warmup_steps),
            "warmup_steps",
            "onecycle warms up by itself; set warmup_steps = 0",
        )
        require(
            not (self.name == "none" and self.warmup_steps),
            "warmup_steps",
            "a warm-up needs a schedule to hand over to; use name = 'constant'",
        )


def _base_lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0].get("initial_lr", optimizer.param_groups[0]["lr"]))


@SCHEDULES.register("constant")
def _constant(config: SchedulerConfig, optimizer: Optimizer, steps: int) -> Scheduler:
    return lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)


@SCHEDULES.register("cosine")
def _cosine(config: SchedulerConfig, optimizer: Optimizer, steps: int) -> Scheduler:
    return lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps, eta_min=config.min_lr)


@SCHEDULES.register("linear")
def _linear(config: SchedulerConfig, optimizer: Optimizer, steps: int) -> Scheduler:
    end = config.min_lr / _base_lr(optimizer)
    return lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=end, total_iters=steps)


@SCHEDULES.register("step")
def _step(config: SchedulerConfig, optimizer: Optimizer, steps: int) -> Scheduler:
    return lr_scheduler.StepLR(optimizer, step_size=config.step_size, gamma=config.gamma)


@SCHEDULES.register("onecycle")
def _onecycle(config: SchedulerConfig, optimizer: Optimizer, steps: int) -> Scheduler:
    peak = config.max_lr or _base_lr(optimizer)
    return lr_scheduler.OneCycleLR(optimizer, max_lr=peak, total_steps=steps)


def build_scheduler(
    config: SchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> lr_scheduler.LRScheduler | None:
    """The configured schedule over ``total_steps`` optimizer steps (None for ``none``)."""
    if config.name == "none":
        return None
    warmup = min(config.warmup_steps, max(0, total_steps - 1))
    main = SCHEDULES.get(config.name)(config, optimizer, max(1, total_steps - warmup))
    if not warmup:
        return main
    warm = lr_scheduler.LinearLR(
        optimizer, start_factor=config.warmup_start, end_factor=1.0, total_iters=warmup
    )
    return lr_scheduler.SequentialLR(optimizer, [warm, main], milestones=[warmup])
