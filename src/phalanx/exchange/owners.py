"""What strategies that update parameter shards at their owners share (``partitioned``, ``ps``).

Updated parameters travel back in the background after each step; every submodule waits, in a
forward pre-hook, only for the bucket(s) holding its own parameters, so the next forward
overlaps the send-back. Optimizer state is checkpointed in the canonical per-parameter format
(phalanx.exchange.sharding), whatever the world size.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from phalanx.exchange.base import Strategy
from phalanx.exchange.comm import CommThread, wait
from phalanx.exchange.sharding import ShardedParameters, hyperparameters


class OwnerUpdateStrategy(Strategy):
    """Base of owner-update strategies: pending parameter arrivals, hooks, state, counters.

    Subclasses build ``self.sharded`` in ``setup`` and put each bucket's background send-back
    (a Work or a CommThread Future) in ``self._pending_params[bucket index]``.
    """

    optimizer_follows_layout = True  # the optimizer steps this layout's shard Parameters

    def __init__(self) -> None:
        super().__init__()
        self.sharded: ShardedParameters | None = None
        self.comm: CommThread | None = None
        self._pending_params: dict[int, Any] = {}
        self._hooks: list = []

    def _ensure_comm(self, device: torch.device, group: Any) -> CommThread:
        if self.comm is None:
            self.comm = CommThread(device, group)
        return self.comm

    # -- parameters arriving while the next forward runs --------------------------------------
    def register_module(self, module: torch.nn.Module) -> None:
        """Make each submodule that holds parameters wait, before its forward, for those of
        its subtree only (containers wait for nothing: their children do)."""
        assert self.sharded is not None
        for handle in self._hooks:  # a rebuilt layout replaces the previous hooks
            handle.remove()
        self._hooks = []
        bucket_of = {id(p): b.index for b in self.sharded.buckets for p in b.params}
        for sub in module.modules():
            if next(sub.parameters(recurse=False), None) is None:
                continue  # a container: its children wait for their own
            # A module that holds parameters may also read its children's without calling
            # them (MultiheadAttention reads out_proj.weight): it waits for its whole subtree.
            indices = sorted({bucket_of[id(p)] for p in sub.parameters() if id(p) in bucket_of})
            if indices:
                waiter = self._waiter(indices)
                self._hooks.append(sub.register_forward_pre_hook(waiter))
                # state_dict() of this submodule (or any parent) reads the updated values too.
                self._hooks.append(sub.register_state_dict_pre_hook(waiter))

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

    # -- the optimizer across bucket rebuilds ---------------------------------------------------
    def carry_optimizer_state(self, optimizer: torch.optim.Optimizer, params: list) -> Any:
        """The canonical per-parameter state (collective: every rank rebuilds at one step)."""
        return self.optimizer_state_dict(optimizer, params)

    def adopt_optimizer(
        self, optimizer: torch.optim.Optimizer, params: list
    ) -> torch.optim.Optimizer:
        """Point the user's optimizer (built over the model's parameters) at this rank's
        shards, group by group: each shard keeps the hyperparameters of the group its
        elements came from. The object stays the user's (schedulers attached to it act)."""
        del params
        self._point_at_shards(optimizer)
        return optimizer

    def rebind_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        params: list,
        carried: Any,
    ) -> None:
        """Point the optimizer's groups at this layout's shard Parameters, then load the
        carried state into them (hyperparameters a scheduler changed travel in ``carried``)."""
        self._point_at_shards(optimizer)
        self.load_optimizer_state_dict(optimizer, params, carried)

    def _point_at_shards(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.sharded is not None
        per_group = self.sharded.group_params(len(optimizer.param_groups))
        for group, shards in zip(optimizer.param_groups, per_group):
            group["params"] = shards
        optimizer.state.clear()

    # -- accounting and state -----------------------------------------------------------------
    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer, params: list) -> dict:
        assert self.sharded is not None and self.ctx is not None
        self.sync()
        return self.sharded.canonical_state(optimizer, params, self.ctx.group)

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, params: list, state: dict
    ) -> None:
        assert self.sharded is not None
        self.sharded.load_canonical_state(optimizer, params, state)

    def optimizer_shards(self, optimizer: torch.optim.Optimizer, params: list) -> tuple:
        """Only this rank's shards' state (checkpoints: no rank gathers the others')."""
        assert self.sharded is not None and self.ctx is not None
        self.sync()
        state = self.sharded.local_state(optimizer, params, self.ctx.group)
        return state, hyperparameters(self.sharded, optimizer, params)

    def owned_ranges(self, params: list) -> dict[int, list[tuple[int, int]]]:
        assert self.sharded is not None
        return self.sharded.owned_ranges(params)

    def load_optimizer_shards(
        self, optimizer: torch.optim.Optimizer, params: list, state: dict, groups: list
    ) -> None:
        assert self.sharded is not None
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
            if self.comm is not None:
                self.comm.close()
