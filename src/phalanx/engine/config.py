"""StepConfig: how the Engine runs one step (micro-batches, precision, buffers, the guard).

``[train]`` (phalanx.config.TrainConfig) extends it with the loop's keys, so a config run hands
its ``train`` table to the Engine as it is; the Python API's keyword shorthand
(``Engine(..., accumulate_steps=4)``) builds the same object with the same checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from phalanx.engine.guard import GuardConfig
from phalanx.errors import ConfigError
from phalanx.exchange.base import STRATEGIES, ExchangeConfig, StrategyFactory, strategy_factory
from phalanx.fields import option, require, with_options


@dataclass(kw_only=True)
class StepConfig(GuardConfig):
    """The step's options; the non-finite guard's come from GuardConfig."""

    accumulate_steps: int = option(1, "micro-batches per step; exchange only after the last")
    precision: Literal["fp32", "bf16", "fp16"] = option(
        "fp32", "forward under torch.autocast: bf16, or fp16 with a dynamic loss scale"
    )
    broadcast_buffers: bool = option(
        True,
        "rank 0's buffers (BatchNorm statistics) to every rank at the end of each update, so "
        "the next forward (training or evaluation) and any checkpoint see rank 0's, as DDP",
    )
    compile: bool = option(
        False,
        "torch.compile each layer's forward (the strategy's hooks stay outside the compiled "
        "code); compiles in the first step, whose compile time is reported once (compile_s)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.accumulate_steps >= 1,
            "accumulate_steps",
            f"must be >= 1, got {self.accumulate_steps}",
        )


# The keyword shorthand of Engine(...): each key's Config (the rest of ExchangeConfig's keys
# and the strategy's options come with ``exchange``).
STEP_OPTIONS = frozenset(StepConfig.__dataclass_fields__)
EXCHANGE_OPTIONS = frozenset({"bucket_mb", "compress", "first_bucket_mb"})


def resolve_configs(
    exchange: str | StrategyFactory | ExchangeConfig,
    step: StepConfig | None,
    options: dict[str, Any],
) -> tuple[StrategyFactory, ExchangeConfig, StepConfig]:
    """The strategy's factory and the two Configs from ``exchange``, ``step`` and the keyword
    shorthand (each key type-checked and validated by its Config; one line naming a bad one)."""
    unknown = sorted(set(options) - STEP_OPTIONS - EXCHANGE_OPTIONS)
    if unknown:
        allowed = ", ".join(sorted(STEP_OPTIONS | EXCHANGE_OPTIONS))
        raise ConfigError(f"{unknown[0]}: not an Engine argument; allowed: {allowed}")
    if options.get("max_grad_norm", 0.0) is None:
        options = {**options, "max_grad_norm": 0.0}  # None and 0: no clipping
    step_options = {k: v for k, v in options.items() if k in STEP_OPTIONS}
    exchange_options = {k: v for k, v in options.items() if k in EXCHANGE_OPTIONS}
    config = with_options(step if step is not None else StepConfig(), step_options)
    if isinstance(exchange, str):
        STRATEGIES.get(exchange)  # one line naming the known strategies
        exchange = ExchangeConfig(strategy=exchange)
    if isinstance(exchange, ExchangeConfig):
        exchange_config = with_options(exchange, exchange_options)
        factory = strategy_factory(exchange_config.strategy, exchange_config.options)
        return factory, exchange_config, config
    if not isinstance(exchange, StrategyFactory):
        raise ConfigError(
            "exchange: pass a strategy name, an ExchangeConfig or a phalanx.exchange."
            f"strategy_factory(name, options); got {type(exchange).__name__}"
        )
    return exchange, with_options(ExchangeConfig(), exchange_options), config
