"""``[scheduler]``: each named schedule is torch's own, warm-up hands over to it, bad values are
one-line errors naming the key."""

from __future__ import annotations

import pytest
import torch
from torch.optim import lr_scheduler

from phalanx.config import load_config
from phalanx.errors import ConfigError
from phalanx.optim.lr_schedule import SchedulerConfig, build_scheduler

STEPS = 12


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


def _rates(scheduler: lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer) -> list[float]:
    rates = []
    for _ in range(STEPS):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize(
    ("config", "reference"),
    [
        (SchedulerConfig(name="cosine", min_lr=0.01),
         lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=STEPS, eta_min=0.01)),
        (SchedulerConfig(name="step", step_size=4, gamma=0.5),
         lambda o: lr_scheduler.StepLR(o, step_size=4, gamma=0.5)),
        (SchedulerConfig(name="linear", min_lr=0.02),
         lambda o: lr_scheduler.LinearLR(o, 1.0, 0.2, total_iters=STEPS)),
        (SchedulerConfig(name="onecycle", max_lr=0.5),
         lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=STEPS)),
    ],
)  # fmt: skip
def test_named_schedules_are_torchs(config: SchedulerConfig, reference) -> None:
    optimizer = _optimizer()
    ours = _rates(build_scheduler(config, optimizer, STEPS), optimizer)
    optimizer = _optimizer()
    assert ours == pytest.approx(_rates(reference(optimizer), optimizer))


def test_warmup_then_cosine() -> None:
    optimizer = _optimizer()
    config = SchedulerConfig(name="cosine", warmup_steps=4, warmup_start=0.25)
    rates = _rates(build_scheduler(config, optimizer, STEPS), optimizer)
    assert rates[:4] == pytest.approx([0.025, 0.04375, 0.0625, 0.08125])  # linear from 0.25x
    assert rates[4] == pytest.approx(0.1)  # the cosine starts at the full rate
    assert rates[4:] == sorted(rates[4:], reverse=True) and rates[-1] < 0.01


def test_none_is_no_scheduler_and_constant_keeps_the_rate() -> None:
    assert build_scheduler(SchedulerConfig(), _optimizer(), STEPS) is None
    optimizer = _optimizer()
    rates = _rates(build_scheduler(SchedulerConfig(name="constant"), optimizer, STEPS), optimizer)
    assert rates == [0.1] * STEPS


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("scheduler.name=poly", "scheduler.name: unknown schedule 'poly'"),
        ("scheduler.warmup_steps=-1", "scheduler.warmup_steps: must be >= 0"),
        ("scheduler.gamma=2.0", "scheduler.gamma: must be in (0, 1]"),
    ],
)
def test_bad_values_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("]", r"\]")):
        load_config(None, [override])


def test_onecycle_with_warmup_is_refused() -> None:
    with pytest.raises(ConfigError, match="onecycle warms up by itself"):
        load_config(None, ["scheduler.name=onecycle", "scheduler.warmup_steps=3"])
