"""A step's batch as users pass it: ``step(inputs, targets)`` with a loss function, or the
model's own arguments (``step(idx, targets)``, ``step(**batch)``) when the model computes its
loss; moved to the device, cut into micro-batches, and the loss found in the model's output."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from phalanx.errors import ConfigError
from phalanx.faults import fault_at
from phalanx.precision import Precision

Batch = tuple[tuple[Any, ...], dict[str, Any]]  # a step's (args, kwargs), on the device


def loss_of(output: Any) -> torch.Tensor:
    """The loss in a model's output: a 0-dim tensor, ``output["loss"]`` / ``output.loss``
    (Hugging Face's outputs), or the one 0-dim tensor in a tuple (``(logits, loss)``)."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    if isinstance(output, tuple | list):
        scalars = [o for o in output if isinstance(o, torch.Tensor) and o.dim() == 0]
        if len(scalars) == 1:
            return scalars[0]
    what = type(output).__name__
    if isinstance(output, torch.Tensor):
        what = f"a tensor of shape {tuple(output.shape)}"
    raise ConfigError(
        f"loss_fn is None, so the model's output must be its loss (a 0-dim tensor, a `loss` "
        f"field or key, or one 0-dim tensor in a tuple); got {what}: pass the targets the model "
        "needs to compute it, or give a loss_fn"
    )


def step_batch(
    args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device, *, with_loss_fn: bool
) -> Batch:
    """``step``'s arguments on ``device`` (tensors moved without blocking, other values as they
    are), checked against how the loss is made (one line naming the fix)."""
    if with_loss_fn and (len(args) != 2 or kwargs):
        raise ConfigError(
            "step: with a loss_fn, call step(inputs, targets); to pass the model's own "
            "arguments (step(**batch)), build the Engine with loss_fn=None"
        )
    if not args and not kwargs:
        raise ConfigError("step: got no batch; pass the model's inputs")
    return (
        tuple(_to_device(a, device) for a in args),
        {k: _to_device(v, device) for k, v in kwargs.items()},
    )


def split_batch(batch: Batch, k: int) -> list[Batch]:
    """``k`` micro-batches: every tensor argument cut along dim 0 into equal parts (other
    values passed to each as they are)."""
    if k == 1:
        return [batch]
    args, kwargs = batch
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if any(t.shape[0] % k for t in tensors):
        raise ConfigError(
            f"step: a batch of {tensors[0].shape[0]} does not split into "
            f"accumulate_steps={k} equal parts"
        )

    def part(value: Any, i: int) -> Any:
        return value.chunk(k)[i] if isinstance(value, torch.Tensor) else value

    return [
        (tuple(part(a, i) for a in args), {n: part(v, i) for n, v in kwargs.items()})
        for i in range(k)
    ]


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor) and x.device != device:
        return x.to(device, non_blocking=True)
    return x


def detached(output: Any) -> Any:
    """A model's output without its graph (``return_outputs``): tensors detached inside
    tuples, lists and dicts (Hugging Face's outputs are dicts); other values as they are."""
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, tuple | list):
        items = [detached(o) for o in output]
        return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
    if isinstance(output, dict):
        values = {k: detached(v) for k, v in output.items()}
        try:
            return type(output)(**values)
        except TypeError:  # a dict type that is not built from keywords
            return values
    return output


class Accumulated(NamedTuple):
    """Micro-batches ``Engine.no_sync`` ran since the last update: how many, and the sum of
    their losses (0-dim, on the device)."""

    micro: int
    loss_sum: torch.Tensor


class MicroBatches:
    """What ``no_sync``'s steps have accumulated for the next update (taken by it)."""

    def __init__(self, device: torch.device) -> None:
        self._zero = torch.zeros((), device=device)
        self.count, self._loss_sum = 0, self._zero

    def add(self, loss_sum: torch.Tensor, count: int) -> None:
        self.count += count
        self._loss_sum = self._loss_sum + loss_sum

    def take(self) -> Accumulated:
        taken = Accumulated(self.count, self._loss_sum)
        self.count, self._loss_sum = 0, self._zero
        return taken


class ForwardPass:
    """Phase 2's forward of one micro-batch under the precision's autocast: ``loss_fn(
    module(inputs), targets)``, or the model's own loss from its arguments (``loss_fn`` None).
    With ``keep_outputs`` (``Engine(return_outputs=True)``) each output, detached, is kept for
    ``result``."""

    def __init__(
        self, module: torch.nn.Module, loss_fn: Any, precision: Precision, keep_outputs: bool
    ) -> None:
        self.module, self.loss_fn, self.precision = module, loss_fn, precision
        self.keep_outputs = keep_outputs
        self._outputs: list[Any] = []  # this step's micro-batches' outputs

    def __call__(self, batch: Batch, step: int) -> torch.Tensor:
        """The micro-batch's loss (0-dim); ``step``: the step's number, for fault points."""
        args, kwargs = batch
        with self.precision.autocast():
            if self.loss_fn is not None:
                inputs, targets = args
                output = self.module(inputs)
                loss = self.loss_fn(output, targets)
            else:
                output = self.module(*args, **kwargs)
                loss = loss_of(output)
        if self.keep_outputs:
            self._outputs.append(detached(output))
        if fault_at("forward", step) == "nan":
            loss = loss * float("nan")
        return loss

    def result(self, loss: torch.Tensor) -> Any:
        """``step``'s value: the loss, or (loss, outputs) with ``keep_outputs`` (one output, or
        a list of each micro-batch's)."""
        if not self.keep_outputs:
            return loss
        outputs, self._outputs = self._outputs, []
        return loss, outputs[0] if len(outputs) == 1 else outputs


def accumulation_scales(pending: int, count: int, buckets: Any) -> tuple[float, float]:
    """Phase 1: (what this step's loss scale is divided by, a factor for the exchanged
    gradient) so the update's gradient is the mean over its ``count`` micro-batches, of
    which ``no_sync`` ran ``pending`` at the full scale. Where ``buckets`` (GradientBuckets)
    hold those, they are scaled now; where none does (fsdp), everything is scaled after the
    exchange."""
    if not pending:
        return max(1, count), 1.0
    if not buckets.buckets:
        return 1.0, 1.0 / count
    for bucket in buckets.buckets:
        bucket.grads.mul_(1.0 / count)
    return count, 1.0
