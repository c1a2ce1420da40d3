"""The ``[parallel]`` layout: D data-parallel replicas of a P-stage pipeline (F6, F7); rank
``r`` is replica ``r // P``, pipeline rank ``r % P``, so a replica's transfers stay on a node's
links (docs/parallel.md: stages, splits, placements)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

from phalanx.fields import ConfigValueError, option, require, require_choice
from phalanx.parallel.pipeline_schedules import SCHEDULES, schedule_kind

SPLITS = ("layers", "auto", "even")


@dataclass(kw_only=True)
class ParallelConfig:
    """How the world is laid out: data-parallel replicas of a pipeline of stages."""

    data: int = option(0, "data-parallel replicas D (0: world size / pipeline)")
    pipeline: int = option(1, "pipeline ranks P per replica (1: no model parallelism)")
    microbatches: int = option(0, "micro-batches per step through the pipeline (0: 2 x P)")
    schedule: str = option(
        "1f1b",
        "pipeline schedule: gpipe, 1f1b, interleaved, looped_bfs, interleaved_zb, zbv, dualpipev",
    )
    virtual_stages: int = option(
        2, "stages per pipeline rank for multi-stage schedules (zbv and dualpipev: exactly 2)"
    )
    split: Literal["layers", "auto", "even"] = option(
        "layers",
        "stage boundaries: 'layers' (stage = k on each layer; 'auto' when none has one), "
        "'auto' (balance measured time), 'even' (equal layer counts)",
    )

    def __post_init__(self) -> None:
        require(self.data >= 0, "data", f"must be >= 0, got {self.data}")
        require(self.pipeline >= 1, "pipeline", f"must be >= 1, got {self.pipeline}")
        require(self.microbatches >= 0, "microbatches", f"must be >= 0, got {self.microbatches}")
        require_choice(self.schedule, "schedule", SCHEDULES.names())
        v = self.virtual_stages
        require(v >= 1, "virtual_stages", f"must be >= 1, got {v}")
        if self.enabled:  # pipeline = 1 runs no schedule (and skips importing torch's)
            schedule_kind(self.schedule).check(
                self.pipeline, self.num_microbatches, self.virtual_stages
            )

    @property
    def enabled(self) -> bool:
        return self.pipeline > 1

    @property
    def stages_per_rank(self) -> int:
        """Stages each pipeline rank runs: ``virtual_stages`` for multi-stage schedules."""
        return schedule_kind(self.schedule).num_local_stages(self.virtual_stages)

    @property
    def num_stages(self) -> int:
        return self.pipeline * self.stages_per_rank

    @property
    def num_microbatches(self) -> int:
        return self.microbatches or 2 * self.pipeline

    def rank_of_stage(self, stage: int) -> int:
        """The pipeline rank running ``stage`` (the schedule's placement)."""
        return schedule_kind(self.schedule).rank_of_stage(stage, self.pipeline)

    def replicas(self, world_size: int) -> int:
        """D for this world; ConfigValueError when P does not divide it or D disagrees."""
        require(
            world_size % self.pipeline == 0,
            "pipeline",
            f"{self.pipeline} does not divide the world size {world_size}",
        )
        replicas = world_size // self.pipeline
        require(
            self.data in (0, replicas),
            "data",
            f"data x pipeline = {self.data} x {self.pipeline} = {self.data * self.pipeline}, "
            f"but the world has {world_size} processes",
        )
        return replicas

    def check_batch(self, batch_size: int) -> None:
        """The replica's batch must split into equal micro-batches."""
        m = self.num_microbatches
        if batch_size % m:
            raise ConfigValueError(
                "parallel.microbatches",
                f"data.batch_size {batch_size} does not split into {m} equal micro-batches",
            )


def stages_from_layers(layers: list[dict], num_stages: int) -> list[int] | None:
    """Each layer's stage from its ``stage`` key (None when no layer has one); every layer has
    one, from 0 up without gaps, ``num_stages`` in all, or ConfigValueError."""
    given = [spec.get("stage") for spec in layers]
    if all(k is None for k in given):
        return None
    for i, k in enumerate(given):
        if k is None:
            raise ConfigValueError(
                f"model.layers[{i}].stage", "missing: give every layer a stage, or none"
            )
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ConfigValueError(
                f"model.layers[{i}].stage", f"must be an integer >= 0, got {k!r}"
            )
    keys = cast("list[int]", given)  # every key checked above
    for i in range(1, len(keys)):
        if keys[i] < keys[i - 1]:
            raise ConfigValueError(
                f"model.layers[{i}].stage",
                f"stage {keys[i]} after stage {keys[i - 1]}: stages must not decrease",
            )
        if keys[i] > keys[i - 1] + 1:
            raise ConfigValueError(
                f"model.layers[{i}].stage",
                f"stage {keys[i]} after stage {keys[i - 1]}: stage {keys[i - 1] + 1} is empty",
            )
    if keys[0] != 0:
        raise ConfigValueError("model.layers[0].stage", f"the first stage is 0, got {keys[0]}")
    found = keys[-1] + 1
    if found != num_stages:
        raise ConfigValueError(
            "model.layers",
            f"the stage keys give {found} stages, the layout needs {num_stages} "
            "(pipeline x virtual stages)",
        )
    return keys


def check_stage_count(num_layers: int, num_stages: int) -> None:
    if num_stages > num_layers:
        raise ConfigValueError(
            "parallel.pipeline",
            f"{num_stages} stages but the model has only {num_layers} layers",
        )
