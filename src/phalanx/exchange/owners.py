"""What owner-update strategies (``partitioned``, ``ps``) share (docs/exchange.md)."""

from __future__ import annotations

import time
from typing import Any

import torch

from phalanx.compile import forward_waiters
from phalanx.exchange.base import Strategy, StrategyParts
from phalanx.exchange.buckets import Bucket
from phalanx.exchange.comm import wait
from phalanx.exchange.sharding import Optimizer, ShardedParameters, hyperparameters
from phalanx.memory import measure
from phalanx.runtime.context import Context


class OwnerUpdateStrategy(Strategy):
    """Base of owner-update strategies: subclasses build ``self.sharded``."""

    optimizer_follows_layout = True  # the optimizer steps this layout's shard Parameters
    sharded: ShardedParameters  # set by the subclass's constructor

    def __init__(self, ctx: Context, buckets: list[Bucket], parts: StrategyParts) -> None:
        super().__init__(ctx, buckets, parts)
        self.comm_thread()
        self._pending_params: dict[int, Any] = {}
        self._hooks: list = []

    def register_module(self, module: torch.nn.Module) -> None:
        """Each submodule holding parameters waits before its forward for its subtree's."""
        bucket_of = {id(p): b.index for b in self.sharded.buckets for p in b.params}

        def waiter(params: list) -> Any:
            indices = sorted({bucket_of[id(p)] for p in params if id(p) in bucket_of})
            return self._waiter(indices) if indices else None

        # A module that holds parameters may also read its children's without calling
        # them (MultiheadAttention reads out_proj.weight): it waits for its whole subtree.
        for sub, params in forward_waiters(module):
            if (hook := waiter(params)) is not None:
                self._hooks.append(sub.register_forward_pre_hook(hook))
        # state_dict() of any submodule reads the updated values; load_state_dict() writes only
        # after they arrived (else the send-back would overwrite what it loaded)
        for sub in module.modules():
            if next(sub.parameters(recurse=False), None) is not None:
                if (hook := waiter(list(sub.parameters()))) is not None:
                    self._hooks.append(sub.register_state_dict_pre_hook(hook))
                    self._hooks.append(sub.register_load_state_dict_pre_hook(hook))

    def _waiter(self, indices: list[int]) -> Any:
        def hook(module: torch.nn.Module, *args: Any) -> None:
            for b in indices:
                self._wait_params(b)

        return hook

    def _wait_params(self, b: int) -> None:
        pending = self._pending_params.pop(b, None)
        if pending is not None:
            start = time.perf_counter()
            wait(pending)
            self.param_waits.append((b, start, time.perf_counter()))

    def sync(self) -> None:
        for b in list(self._pending_params):
            self._wait_params(b)

    def carry_optimizer_state(self, optimizer: Optimizer, params: list) -> Any:
        """This rank's shards' state; the spent gradient buffers freed and the heap trimmed now."""
        self.sync()
        carried = self.sharded.carry(optimizer, params)
        _free_gradients(self.sharded.buckets)
        measure.trim()
        return carried

    def adopt_optimizer(self, optimizer: Optimizer, params: list) -> Optimizer:
        """Point the user's optimizer at this rank's shards, group by group."""
        del params
        self._point_at_shards(optimizer)
        measure.trim()  # the parameters' own storages, freed when this layout's buffers took over
        return optimizer

    def rebind_optimizer(self, optimizer: Optimizer, params: list, carried: Any) -> None:
        """Point the optimizer at this layout's shards, then load ``carried`` (collective)."""
        self._point_at_shards(optimizer)
        self.sharded.load_carried(optimizer, params, carried, self.ctx.group)
        measure.trim()  # the previous layout's parameter buffers and optimizer state

    def _point_at_shards(self, optimizer: Optimizer) -> None:
        per_group = self.sharded.group_params(len(optimizer.param_groups))
        for group, shards in zip(optimizer.param_groups, per_group):
            group["params"] = shards
        optimizer.state.clear()

    def optimizer_state_dict(self, optimizer: Optimizer, params: list) -> dict:
        self.sync()
        return self.sharded.canonical_state(optimizer, params, self.ctx.group)

    def load_optimizer_state_dict(self, optimizer: Optimizer, params: list, state: dict) -> None:
        self.sharded.load_canonical_state(optimizer, params, state)

    def optimizer_shards(self, optimizer: Optimizer, params: list) -> tuple:
        """Only this rank's shards' state (checkpoints: no rank gathers the others')."""
        self.sync()
        state = self.sharded.local_state(optimizer, params, self.ctx.group)
        return state, hyperparameters(self.sharded, optimizer, params)

    def owned_ranges(self, params: list) -> dict[int, list[tuple[int, int]]]:
        return self.sharded.owned_ranges(params)

    def load_optimizer_shards(
        self, optimizer: Optimizer, params: list, state: dict, groups: list
    ) -> None:
        self.sync()
        self.sharded.load_local_state(optimizer, params, state, groups)

    def close(self) -> None:
        try:
            self.sync()
        finally:  # a peer that died makes sync fail: still unhook and stop the thread
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self._pending_params.clear()
            super().close()


def _free_gradients(buckets: list[Bucket]) -> None:
    """Free the buckets' buffers and drop the parameters' ``.grad``, which viewed them."""
    for bucket in buckets:
        for p in bucket.params:
            p.grad = None
        bucket.flat.untyped_storage().resize_(0)
