"""Fusion buckets filled by backward hooks (F8, F11); why and how: docs/exchange.md, "Buckets
and overlap". Phases of one step, as seen from here:
  Phase 1 (arm): clear the per-step flags; gradients start as None (copied into the view).
  Phase 2 (backward): the hook marks a parameter ready; full buckets launch strictly in order.
  Phase 3 (flush): after backward, buckets held back by unused parameters launch with zeros.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from phalanx.errors import ConfigError

FIRST_BUCKET_BYTES = 1 << 20  # a small first bucket starts communication early, as DDP does


@dataclass
class Bucket:
    """One fusion buffer ``flat`` (1-D, its parameters' dtype and device): ``grads``, then
    ``flags``."""

    index: int
    params: list[torch.nn.Parameter]
    flat: torch.Tensor
    grads: torch.Tensor
    flags: torch.Tensor
    views: list[torch.Tensor]
    offsets: list[int]
    num_pending: int = 0
    ready: bool = False
    launched: bool = False
    launch_time: float = 0.0
    ready_time: float = 0.0  # perf_counter when its last gradient arrived this step
    done_time: float = 0.0  # perf_counter when its exchange completed (stamped by strategies)
    pending_grads_at_launch: int = 0  # parameters of the model still waiting for backward
    riders: torch.Tensor | None = None  # the last bucket's slots after flags (the global loss)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def plan_buckets(
    params: Sequence[torch.Tensor], bucket_bytes: int, first_bucket_bytes: int
) -> list[list[int]]:
    """Indices of ``params`` in buckets of about ``bucket_bytes`` (the first capped)."""
    groups: list[list[int]] = []
    size = 0
    cap = min(first_bucket_bytes, bucket_bytes)
    for i, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        same_kind = bool(groups) and _kind(params[groups[-1][0]]) == _kind(p)
        if groups and same_kind and size + nbytes <= cap:
            groups[-1].append(i)
            size += nbytes
            continue
        if groups:
            cap = bucket_bytes
        groups.append([i])
        size = nbytes
    return groups


def _kind(p: torch.Tensor) -> tuple[torch.dtype, torch.device]:
    return (p.dtype, p.device)


class GradientBuckets:
    """Owns the buckets of a model's trainable parameters and the hooks that fill them."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        bucket_bytes: int,
        launch: Callable[[Bucket], None],
        first_bucket_bytes: int = FIRST_BUCKET_BYTES,
        align: int = 1,
        riders: int = 0,
    ) -> None:
        """``riders``: slots the last bucket carries after its flags (``Bucket.riders``)."""
        # Hooks fire in backward order, which is roughly the reverse of registration order.
        self.params = list(params)
        self.riders = riders
        self.bucket_bytes = bucket_bytes
        self.first_bucket_bytes = first_bucket_bytes
        self.align = align
        self.on_ready: Callable[[int, int], None] | None = None  # (param index, bytes) observer
        self.launch = launch  # the strategy's; re-pointed when the Engine rebuilds it
        self._position = {id(p): i for i, p in enumerate(self.params)}
        self.used = bytearray(len(self.params))
        self.ready_order: list[int] = []
        self.launch_enabled = False
        self.poison = False  # this rank's loss was inf/NaN: every bucket says so to the others
        self._next_launch = 0
        self._num_pending_total = 0
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, tuple[int, int, int]] = {}
        self.build(list(reversed(range(len(self.params)))))
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def build(self, order: list[int]) -> None:
        """(Re)build buckets with parameters in ``order`` (indices into self.params)."""
        assert sorted(order) == list(range(len(self.params))), "order must be a permutation"
        ordered = [self.params[i] for i in order]
        self.buckets = []
        self._bucket_of = {}
        groups = plan_buckets(ordered, self.bucket_bytes, self.first_bucket_bytes)
        for b, group in enumerate(groups):
            members = [ordered[i] for i in group]
            riders = self.riders if b == len(groups) - 1 else 0  # buckets launch in order
            self.buckets.append(self._make_bucket(b, members, riders))
            for slot, p in enumerate(members):
                self._bucket_of[id(p)] = (b, slot, self._position[id(p)])

    def _make_bucket(self, index: int, members: list[torch.nn.Parameter], riders: int) -> Bucket:
        total = sum(p.numel() for p in members)
        tail = total + len(members)  # gradients, flags, then the riders' slots
        padded = -(-(tail + riders) // self.align) * self.align
        flat = torch.zeros(padded, dtype=members[0].dtype, device=members[0].device)
        views, offsets, offset = [], [], 0
        for p in members:
            view = flat[offset : offset + p.numel()].view_as(p)
            if p.grad is not None:  # keep gradients across a rebuild
                view.copy_(p.grad)
                p.grad = view
            views.append(view)
            offsets.append(offset)
            offset += p.numel()
        return Bucket(
            index=index,
            params=members,
            flat=flat,
            grads=flat[:total],
            flags=flat[total:tail],
            views=views,
            offsets=offsets,
            riders=flat[tail : tail + riders] if riders else None,
        )

    def order(self) -> list[int]:
        """The current layout's parameter order (indices into ``params``)."""
        return [self._bucket_of[id(p)][2] for bucket in self.buckets for p in bucket.params]

    def zero(self) -> None:
        """Phase 1: clear usage flags and set ``grad = None`` (not zeroed: docs/exchange.md)."""
        for bucket in self.buckets:
            bucket.flat[bucket.grads.numel() :].zero_()  # flags and alignment padding
            for p in bucket.params:
                p.grad = None
        self.used = bytearray(len(self.params))
        self.poison = False

    def arm(self, launch: bool) -> None:
        """Before a micro-step's backward: whether completed buckets launch their exchange."""
        self.launch_enabled = launch
        self.ready_order = []
        self._next_launch = 0
        self._num_pending_total = len(self.params)
        for bucket in self.buckets:
            bucket.num_pending = len(bucket.params)
            bucket.ready = bucket.launched = False
            bucket.ready_time = bucket.done_time = 0.0

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        """Phase 2: runs inside backward, right after autograd accumulated ``p.grad``."""
        b, slot, position = self._bucket_of[id(p)]
        bucket = self.buckets[b]
        view = bucket.views[slot]
        grad = p.grad
        if grad is not view:  # first accumulation after grad was None, or a user reset it
            assert grad is not None  # autograd has just accumulated it
            if grad.layout != torch.strided:  # (sparse Embeddings are refused at construction)
                raise ConfigError(
                    f"a parameter of shape {tuple(p.shape)} got a {grad.layout} gradient; "
                    "phalanx exchanges dense gradients only: make the layer produce dense ones"
                )
            if grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
            p.grad = view
        self.used[position] = 1
        self.ready_order.append(position)
        if self.on_ready is not None:
            self.on_ready(position, view.numel() * view.element_size())
        self._num_pending_total -= 1
        bucket.num_pending -= 1
        if bucket.num_pending == 0:
            bucket.ready = True
            bucket.ready_time = time.perf_counter()
            if self.launch_enabled:
                self._launch_ready()

    def written(self, params: list[torch.nn.Parameter]) -> None:
        """Phase 2 for gradients written past autograd (zero-bubble pipelines' weight pass)."""
        fired = set(self.ready_order)
        for p in params:
            entry = self._bucket_of.get(id(p))
            if entry is not None and entry[2] not in fired:
                self._on_grad(p)

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].ready:
            self._launch_bucket(self.buckets[self._next_launch])

    def _launch_bucket(self, bucket: Bucket) -> None:
        bucket.launched = True
        if bucket.num_pending == 0:
            bucket.flags.fill_(1)
        else:  # flushed with unused parameters: flag only those that got a gradient
            used = [float(self.used[self._bucket_of[id(p)][2]]) for p in bucket.params]
            bucket.flags.copy_(torch.tensor(used, dtype=bucket.flags.dtype))
            for p, view, flag in zip(bucket.params, bucket.views, used):
                if not flag:  # never written this step: it sends zeros, and receives the
                    view.zero_()  # other ranks' gradient like every parameter
                    p.grad = view
        if self.poison:  # the summed flags turn NaN on every rank: one verdict, no message
            bucket.flags.fill_(float("nan"))
        bucket.launch_time = time.perf_counter()
        bucket.pending_grads_at_launch = self._num_pending_total
        self._next_launch += 1
        self.launch(bucket)

    def flush(self) -> None:
        """Phase 3: after backward, launch the buckets that unused parameters held back."""
        while self._next_launch < len(self.buckets):
            self._launch_bucket(self.buckets[self._next_launch])

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
