"""Owner-side updates over flat parameter shards (F4, F5, F19): the machinery that
``partitioned`` and ``ps`` share.

Each bucket gets a flat *parameter* buffer with the bucket's layout; the model's parameters
become views of it (``p.data``), so updating a contiguous range of the buffer updates the
parameters that overlap it. A partition is a contiguous range of the bucket; the rank that owns
it keeps the only optimizer state for that range (``torch.nn.Parameter`` views of the buffer,
handed to any elementwise optimizer). Checkpoints use a canonical per-parameter optimizer state
(the format a plain optimizer over the full parameters would have), so a run saved with one
world size and strategy resumes under another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phalanx.exchange.buckets import Bucket
from phalanx.optim.state import load_into


def bounds(length: int, num_parts: int) -> list[tuple[int, int]]:
    """Split [0, length) into num_parts contiguous near-equal ranges (earlier ones longer)."""
    base, extra = divmod(length, num_parts)
    out, start = [], 0
    for i in range(num_parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


@dataclass
class Shard:
    """One owned range of one bucket whose elements all belong to one of the user's optimizer
    parameter groups (``group``): ``param`` views the parameter buffer (1-D, the bucket's dtype
    and device)."""

    bucket: int
    start: int
    end: int
    param: torch.nn.Parameter
    group: int = 0


class ShardedParameters:
    """Flat parameter buffers for the buckets, partition ranges, and this rank's shards."""

    def __init__(
        self,
        buckets: list[Bucket],
        ranges: list[list[tuple[int, int]]],
        owners: list[list[int]],
        rank: int,
        host_master: bool = False,
        group_of: dict[int, int] | None = None,
    ) -> None:
        assert len(buckets) == len(ranges) == len(owners)
        self.buckets = buckets
        self.ranges = ranges  # per bucket: partition -> [start, end) in the bucket's flat
        self.owners = owners  # per bucket: partition -> owning rank
        self.rank = rank
        self.host_master = host_master  # keep owned ranges (and their state) in CPU memory
        # id(parameter) -> index of the user's optimizer group holding it (None: one group);
        # a parameter in no group is never updated, as in one process.
        self.group_of = group_of
        self.flats = [self._adopt(bucket) for bucket in buckets]
        self.shards = self._make_shards()

    @staticmethod
    def _adopt(bucket: Bucket) -> torch.Tensor:
        """A flat buffer holding the bucket's parameters; the parameters become its views."""
        flat = torch.zeros_like(bucket.flat)
        with torch.no_grad():
            for p, offset in zip(bucket.params, bucket.offsets):
                view = flat[offset : offset + p.numel()].view_as(p)
                view.copy_(p.data)
                p.data = view
        return flat

    def _make_shards(self) -> list[Shard]:
        shards = []
        for b, bucket in enumerate(self.buckets):
            num_grads = bucket.grads.numel()
            for (start, end), owner in zip(self.ranges[b], self.owners[b]):
                end = min(end, num_grads)  # usage flags and padding are not parameters
                if owner != self.rank or start >= end:
                    continue
                for lo, hi, group in self._group_runs(bucket, start, end):
                    data = self.flats[b][lo:hi]
                    if self.host_master and data.device.type != "cpu":
                        data = data.detach().to("cpu", copy=True)
                    shards.append(Shard(b, lo, hi, torch.nn.Parameter(data), group))
        return shards

    def _group_runs(self, bucket: Bucket, start: int, end: int) -> list[tuple[int, int, int]]:
        """[start, end) of ``bucket`` cut where the optimizer group changes: (lo, hi, group)
        runs, leaving out parameters in no group (a run starting in alignment padding takes
        the group of the parameter before it)."""
        if self.group_of is None:
            return [(start, end, 0)]
        runs: list[tuple[int, int, int]] = []
        for p, offset in sorted(zip(bucket.params, bucket.offsets), key=lambda po: po[1]):
            lo, hi = max(start, offset), min(end, offset + p.numel())
            if lo >= hi:
                continue
            group = self.group_of.get(id(p), -1)
            if runs and runs[-1][2] == group:
                runs[-1] = (runs[-1][0], hi, group)
            else:
                runs.append((lo, hi, group))
        return [run for run in runs if run[2] >= 0]

    def group_params(self, num_groups: int) -> list[list[torch.nn.Parameter]]:
        """This rank's shard Parameters per optimizer group; a group with nothing here gets
        one empty placeholder, so every group keeps its place (and steps nothing)."""
        out: list[list[torch.nn.Parameter]] = [[] for _ in range(num_groups)]
        for shard in self.shards:
            out[shard.group].append(shard.param)
        return [params or [torch.nn.Parameter(torch.empty(0))] for params in out]

    def groups_of(self, params: list[torch.nn.Parameter], num_groups: int) -> list[list[int]]:
        """Per optimizer group: the indices in ``params`` of the parameters it holds (the
        canonical format's ``param_groups``, as an optimizer over ``params`` would have)."""
        if self.group_of is None:
            return [list(range(len(params)))] + [[] for _ in range(num_groups - 1)]
        out: list[list[int]] = [[] for _ in range(num_groups)]
        for i, p in enumerate(params):
            if self.group_of.get(id(p), -1) >= 0:
                out[self.group_of[id(p)]].append(i)
        return out

    def write_back(self, shard: Shard) -> None:
        """Copy a host master's values into the device buffer (no-op when it is a view)."""
        target = self.flats[shard.bucket][shard.start : shard.end]
        if shard.param.data_ptr() != target.data_ptr():
            with torch.no_grad():
                target.copy_(shard.param, non_blocking=True)

    def shard_params(self) -> list[torch.nn.Parameter]:
        """This rank's shard Parameters; a rank that owns nothing gets one empty placeholder,
        so any torch optimizer can be built (and steps nothing)."""
        return [s.param for s in self.shards] or [torch.nn.Parameter(torch.empty(0))]

    def attach_grads(self, grads_of: dict[int, torch.Tensor], offset_of: dict[int, int]) -> None:
        """Point each shard's ``.grad`` at its reduced gradients: ``grads_of[b]`` holds bucket b's
        range starting at flat index ``offset_of[b]``."""
        for shard in self.shards:
            source = grads_of[shard.bucket]
            lo = shard.start - offset_of[shard.bucket]
            shard.param.grad = source[lo : lo + shard.end - shard.start]

    # -- canonical optimizer state ------------------------------------------------------------
    def canonical_state(
        self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], group: Any
    ) -> dict[str, Any]:
        """Gather every owner's shard state into per-parameter state keyed by index in
        ``params`` (collective: every rank calls it and gets the same result)."""
        local = {}
        for shard in self.shards:
            shard_state = optimizer.state.get(shard.param, {})
            local[(shard.bucket, shard.start)] = {k: _cpu(v) for k, v in shard_state.items()}
        gathered: list[dict] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
        dist.all_gather_object(gathered, local, group=group)
        pieces = {key: value for part in gathered for key, value in part.items()}
        index = {id(p): i for i, p in enumerate(params)}
        state: dict[int, dict[str, Any]] = {}
        for b, bucket in enumerate(self.buckets):
            for p, offset in zip(bucket.params, bucket.offsets):
                entry = _assemble(pieces, b, offset, p)
                if entry:
                    state[index[id(p)]] = entry
        return {"state": state, "param_groups": hyperparameters(self, optimizer, params)}

    def load_canonical_state(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        canonical: dict[str, Any],
    ) -> None:
        """Load per-parameter state into this rank's shards."""
        index = {id(p): i for i, p in enumerate(params)}
        position = optimizer_positions(optimizer)
        shard_state = {}
        for shard in self.shards:
            bucket = self.buckets[shard.bucket]
            entry = _slice_state(canonical["state"], bucket, index, shard.start, shard.end)
            if entry:
                shard_state[position[id(shard.param)]] = entry
        groups = merged_groups(optimizer, canonical["param_groups"])
        load_into(optimizer, {"state": shard_state, "param_groups": groups})

    # -- this rank's part, for checkpoints that every rank writes ------------------------------
    def _overlaps(self, params: list[torch.nn.Parameter]) -> Any:
        """(shard, parameter index, flat start and end within the parameter) for each part
        of a parameter a shard of this rank holds."""
        index = {id(p): i for i, p in enumerate(params)}
        for shard in self.shards:
            bucket = self.buckets[shard.bucket]
            for p, offset in zip(bucket.params, bucket.offsets):
                lo, hi = max(shard.start, offset), min(shard.end, offset + p.numel())
                if lo < hi:
                    yield shard, index[id(p)], lo - offset, hi - offset, offset

    def owned_ranges(self, params: list[torch.nn.Parameter]) -> dict[int, list[tuple[int, int]]]:
        ranges: dict[int, list[tuple[int, int]]] = {}
        for _, i, lo, hi, _ in self._overlaps(params):
            ranges.setdefault(i, []).append((lo, hi))
        return ranges

    def local_state(
        self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], group: Any
    ) -> dict[int, dict[str, Any]]:
        """This rank's shards' state per parameter: per-element values as ``(flat start within
        the parameter, 1-D view)`` pieces, no copy, no gathering. The ranks agree (one small
        message) on the per-element keys, so a shard without state yet (a ps partition whose
        updates were all skipped) contributes zeros and the pieces cover every parameter."""
        out: dict[int, dict[str, Any]] = {}
        kinds: dict[str, torch.dtype] = {}
        for shard, i, lo, hi, offset in self._overlaps(params):
            entry = out.setdefault(i, {})
            for key, value in optimizer.state.get(shard.param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() == 1:
                    start = offset + lo - shard.start
                    entry.setdefault(key, []).append((lo, value[start : start + hi - lo]))
                    kinds[key] = value.dtype
                else:
                    entry.setdefault(key, value)
        if dist.get_world_size(group) > 1:
            everyone: list[dict] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
            dist.all_gather_object(everyone, kinds, group=group)
            kinds = {k: v for part in everyone for k, v in part.items()}
        for _, i, lo, hi, _ in self._overlaps(params):
            for key, dtype in kinds.items():
                pieces = out[i].setdefault(key, [])
                if not any(start == lo for start, _ in pieces):
                    pieces.append((lo, torch.zeros(hi - lo, dtype=dtype)))
        return out

    def load_local_state(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        state: dict[int, dict[str, Any]],
        groups: list[dict[str, Any]],
    ) -> None:
        """Load per-parameter pieces covering this rank's shards (``owned_ranges``), and
        refresh host master copies from the (just loaded) parameter buffers."""
        shard_state: dict[int, dict[str, Any]] = {}
        number = optimizer_positions(optimizer)
        for shard, i, lo, hi, offset in self._overlaps(params):
            entry = shard_state.setdefault(number[id(shard.param)], {})
            for key, value in state.get(i, {}).items():
                if isinstance(value, list):
                    full = entry.get(key)
                    if full is None:
                        dtype, device = value[0][1].dtype, self.buckets[shard.bucket].flat.device
                        full = torch.zeros(shard.end - shard.start, dtype=dtype, device=device)
                        entry[key] = full
                    start = offset + lo - shard.start
                    if copy_pieces(value, lo, full[start : start + hi - lo]) != hi - lo:
                        raise ValueError(
                            f"optimizer state {key!r} of parameter {i} lacks part of this "
                            f"rank's range [{lo}, {hi}): load through phalanx.checkpoint.restore"
                        )
                elif key not in entry:
                    entry[key] = _own(value)
        for shard in self.shards:
            target = self.flats[shard.bucket][shard.start : shard.end]
            if shard.param.data_ptr() != target.data_ptr():
                with torch.no_grad():
                    shard.param.copy_(target)
        load_into(
            optimizer,
            {
                "state": {n: e for n, e in shard_state.items() if e},
                "param_groups": merged_groups(optimizer, groups),
            },
        )


def hyperparameters(
    sharded: ShardedParameters, optimizer: torch.optim.Optimizer, params: list
) -> list[dict[str, Any]]:
    """The optimizer's groups in the canonical format: each group's hyperparameters, and as
    ``params`` the indices in ``params`` of the model parameters the user put in it."""
    members = sharded.groups_of(params, len(optimizer.param_groups))
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": members[n]}
        for n, g in enumerate(optimizer.param_groups)
    ]


def optimizer_positions(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(tensor) -> its index in the optimizer's state dict (groups in order)."""
    order = [p for g in optimizer.param_groups for p in g["params"]]
    return {id(p): n for n, p in enumerate(order)}


def merged_groups(optimizer: torch.optim.Optimizer, saved: list[dict]) -> list[dict[str, Any]]:
    """``param_groups`` for ``load_state_dict``: group k's hyperparameters from saved group k
    (or the first, when fewer were saved) over the current ones; ``params`` numbered in order."""
    groups, start = [], 0
    for k, g in enumerate(optimizer.param_groups):
        stored = saved[k] if k < len(saved) else (saved[0] if saved else {})
        hyper = {a: b for a, b in {**g, **stored}.items() if a != "params"}
        groups.append({**hyper, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    return groups


def copy_pieces(pieces: list[tuple[int, torch.Tensor]], lo: int, out: torch.Tensor) -> int:
    """Copy into ``out`` (a flat range starting at ``lo``) what ``(start, 1-D tensor)`` pieces
    of the same flat index space hold of it; returns how many elements they covered."""
    hi, covered = lo + out.numel(), 0
    for start, flat in pieces:
        a, b = max(lo, start), min(hi, start + flat.numel())
        if a < b:
            out[a - lo : b - lo].copy_(flat[a - start : b - start])
            covered += b - a
    return covered


def _cpu(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def _own(value: Any) -> Any:
    """A private copy of a per-parameter scalar state (e.g. Adam's ``step`` tensor): optimizers
    update it in place, so it must never be shared between parameters or shards."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def _assemble(pieces: dict, bucket: int, offset: int, p: torch.Tensor) -> dict[str, Any]:
    """Per-parameter state for the parameter at ``offset`` in ``bucket`` from shard pieces."""
    end = offset + p.numel()
    parts = sorted((start, s) for (b, start), s in pieces.items() if b == bucket)
    entry: dict[str, Any] = {}
    for start, state in parts:
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() == 1:
                lo, hi = max(start, offset), min(start + value.numel(), end)
                if lo < hi:
                    full = entry.setdefault(key, torch.zeros(p.numel(), dtype=value.dtype))
                    full[lo - offset : hi - offset] = value[lo - start : hi - start]
            elif key not in entry:
                entry[key] = _own(value)
    return {k: (v.view(p.shape) if isinstance(v, torch.Tensor) and v.dim() == 1 else v)
            for k, v in entry.items()}  # fmt: skip


def _slice_state(
    state: dict, bucket: Bucket, index: dict[int, int], start: int, end: int
) -> dict[str, Any]:
    """The flat range [start, end) of the bucket's per-parameter state, as one shard's state."""
    entry: dict[str, Any] = {}
    for p, offset in zip(bucket.params, bucket.offsets):
        lo, hi = max(start, offset), min(end, offset + p.numel())
        param_state = state.get(index[id(p)], state.get(str(index[id(p)]), {}))
        if lo >= hi or not param_state:
            continue
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor) and value.numel() == p.numel() and value.dim() > 0:
                device = bucket.flat.device
                full = entry.setdefault(
                    key, torch.zeros(end - start, dtype=value.dtype, device=device)
                )
                full[lo - start : hi - start] = value.reshape(-1)[lo - offset : hi - offset]
            elif key not in entry:
                entry[key] = _own(value)
    return entry
