"""RunConfig: the per-component Config dataclasses of one run (each validated in its own
``__post_init__``), TOML loading and ``--set`` overrides; errors name the key path."""

from __future__ import annotations

import copy
import dataclasses
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.checkpoint import CheckpointConfig
from phalanx.data.sources import DataConfig
from phalanx.engine.config import StepConfig
from phalanx.engine.tracing import TraceConfig
from phalanx.errors import ConfigError
from phalanx.exchange.base import ExchangeConfig
from phalanx.fields import ConfigValueError, from_dict, join_key, option, require
from phalanx.memory.manager import MemoryConfig
from phalanx.metrics import LogConfig
from phalanx.models.config import ModelConfig, build_model
from phalanx.optim.factory import OptimizerConfig
from phalanx.optim.lr_schedule import SchedulerConfig
from phalanx.parallel.layout import ParallelConfig, check_stage_count, stages_from_layers
from phalanx.runtime.context import RuntimeConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib


@dataclass(kw_only=True)
class TrainConfig(StepConfig):
    """The loop: how long, how often to validate and log, the run directory; StepConfig's keys
    go to the Engine as they are."""

    steps: int = option(0, "optimizer steps to run (0: use epochs)")
    epochs: int = option(10, "epochs to run when steps = 0")
    val_every: int = option(0, "validate every this many steps (0: only at the end)")
    seed: int = option(0, "model initialisation and dropout seed")
    run_dir: str = option("", "run directory (default: runs/<config name>-<time>)")
    progress: bool = option(True, "show a progress bar on rank 0")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.steps >= 0, "steps", f"must be >= 0, got {self.steps}")
        require(self.epochs >= 0, "epochs", f"must be >= 0, got {self.epochs}")
        require(self.steps > 0 or self.epochs > 0, "steps", "set train.steps or train.epochs > 0")
        require(self.val_every >= 0, "val_every", f"must be >= 0, got {self.val_every}")


@dataclass(kw_only=True)
class RunConfig:
    """Everything one `phalanx train` run needs, one table per component."""

    model: ModelConfig = option(
        factory=lambda: ModelConfig(name="digits_cnn"), doc="the network ([model])"
    )
    data: DataConfig = option(factory=DataConfig, doc="the training data ([data])")
    train: TrainConfig = option(factory=TrainConfig, doc="the loop ([train])")
    optimizer: OptimizerConfig = option(factory=OptimizerConfig, doc="the optimizer")
    scheduler: SchedulerConfig = option(factory=SchedulerConfig, doc="learning-rate schedule")
    exchange: ExchangeConfig = option(factory=ExchangeConfig, doc="gradient exchange ([exchange])")
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig, doc="checkpoints")
    runtime: RuntimeConfig = option(factory=RuntimeConfig, doc="process group and devices")
    log: LogConfig = option(factory=LogConfig, doc="TensorBoard beside metrics.jsonl ([log])")
    parallel: ParallelConfig = option(
        factory=ParallelConfig, doc="data x pipeline layout, micro-batches, schedule"
    )
    memory: MemoryConfig = option(
        factory=MemoryConfig, doc="peak memory budget: offload or recompute activations"
    )
    trace: TraceConfig = option(
        factory=TraceConfig, doc="Chrome trace of a few steps ([trace]; --trace DIR)"
    )

    def __post_init__(self) -> None:
        """Checks that span tables: the stage keys of [[model.layers]] against [parallel]
        (with pipeline = 1 they are not used: a config cut for P stages also runs whole)."""
        parallel, layers = self.parallel, self.model.layers
        if parallel.enabled:
            if layers:
                stages_from_layers(layers, parallel.num_stages)
            check_stage_count(
                len(layers) if layers else _num_layers(self.model), parallel.num_stages
            )
            parallel.check_batch(self.data.batch_size // self.train.accumulate_steps)
        if self.memory.enabled and parallel.enabled:
            raise ConfigValueError(
                "memory", "the memory manager works on one stage per model copy: pipeline = 1"
            )

    def check_world(self, world_size: int) -> None:
        """One-line errors for a layout this many processes cannot run: P must divide the
        world; the exchange runs among the D replicas of each stage."""
        try:
            replicas = self.parallel.replicas(world_size)
        except ConfigValueError as e:
            raise ConfigError(f"parallel.{e.key}: {e.reason}") from None
        self.exchange.check_world(replicas)

    def stage_of_layers(self) -> list[int] | None:
        """Each layer's stage from the config's ``stage`` keys (None: split by [parallel],
        or no pipeline)."""
        if not (self.parallel.enabled and self.model.layers):
            return None
        return stages_from_layers(self.model.layers, self.parallel.num_stages)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _num_layers(model: ModelConfig) -> int:
    return len(list(build_model(model).children()))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a TOML file (or start from defaults) and apply ``section.key=value`` overrides."""
    return config_from_data(read_config(path), overrides)


def read_config(path: str | Path | None) -> dict[str, Any]:
    """A TOML config file's tables, unchecked ({} without a file)."""
    return _read_toml(Path(path)) if path is not None else {}


def config_from_data(data: dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """A RunConfig from already-parsed tables (e.g. a run directory's config.json)."""
    return from_dict(RunConfig, with_overrides(data, overrides), "")


def with_overrides(data: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """A copy of ``data`` with ``section.key=value`` overrides applied."""
    data = copy.deepcopy(data)
    for item in overrides or []:
        _apply_override(data, item)
    return data


def _read_toml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory; give a run config file (TOML)")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None


def _apply_override(data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    parts = key.strip().split(".")
    if len(parts) < 2:
        raise ConfigError(f"--set {item!r}: expected section.key=value (e.g. train.lr=0.1)")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word is a string: --set exchange.strategy=tree
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {part} is not a table")
        node = child
    node[parts[-1]] = value


def describe(config: Any = None, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key path, type, default, doc) of every config key, for docs and help text."""
    config = RunConfig() if config is None else config
    rows = []
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        key = join_key(prefix, f.name)
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(describe(value, key))
            continue
        hint = hints[f.name]
        type_name = getattr(hint, "__name__", None) or str(hint)
        if type_name == "Optional":  # Optional[X] names itself "Optional": show X | None
            type_name = str(hint)
        type_name = type_name.replace("typing.", "")
        rows.append((key, type_name, repr(value), f.metadata.get("doc", "")))
    return rows
