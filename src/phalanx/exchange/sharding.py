"""Owner-side updates over flat parameter shards (F4, F5, F19), shared by ``partitioned`` and
``ps`` (docs/exchange.md, "Strategies").
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any

import torch
import torch.distributed as dist

from phalanx.exchange.buckets import Bucket
from phalanx.exchange.comm import global_rank
from phalanx.optim.state import load_into

Optimizer = torch.optim.Optimizer
Params = list[torch.nn.Parameter]  # the model's trainable parameters, in the Engine's order
ShardState = dict[int, dict[str, Any]]  # {index in params: {state key: value or pieces}}
Groups = list[dict[str, Any]]  # the optimizer's groups' hyperparameters


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
    """One owned range within one parameter (``slot``) of one bucket; ``param`` views it (1-D)."""

    bucket: int
    start: int
    end: int
    param: torch.nn.Parameter
    group: int = 0
    slot: int = 0

    @property
    def numel(self) -> int:
        return self.end - self.start


Piece = tuple[int, int, int]  # (lo, hi, rank): a rank's flat range [lo, hi) of a parameter


@dataclass
class Carried:
    """One rank's shards' state, every rank's ranges and the hyperparameters, across a rebuild."""

    state: ShardState
    owners: dict[int, list[Piece]]
    groups: Groups


class _Moves:
    """Copies of state pieces between ranks, posted at once in one order on every rank."""

    def __init__(self, group: Any, device: torch.device | None) -> None:
        self.group, self.device = group, device
        self.works: list[Any] = []
        self.keep: list[torch.Tensor] = []  # sent tensors live until their sends end
        self.arrivals: list[tuple[torch.Tensor, torch.Tensor]] = []  # (received, target)

    def move(self, src: int, dst: int, me: int, held: Any, target: Any) -> None:
        """``held`` (on ``src``) into ``target`` (on ``dst``); this rank is one of them."""
        if src == dst:
            if target.data_ptr() != held.data_ptr():  # else the same tensor, taken over
                target.copy_(held)
        elif src == me:
            wire = held if self.device is None else held.to(self.device)
            self.keep.append(wire)
            self.works.append(dist.isend(wire, global_rank(self.group, dst), group=self.group))
        else:
            wire = target if self.device in (None, target.device) else target.new_empty(
                target.shape, device=self.device
            )  # fmt: skip
            if wire is not target:
                self.arrivals.append((wire, target))
            self.works.append(dist.irecv(wire, global_rank(self.group, src), group=self.group))

    def finish(self) -> None:
        for work in self.works:
            work.wait()
        for wire, target in self.arrivals:
            target.copy_(wire)
        self.works, self.keep, self.arrivals = [], [], []


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
        self.group_of = group_of  # id(parameter) -> optimizer group (None: one; -1: none)
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
                for lo, hi, group, slot in self._param_runs(bucket, start, end):
                    data = self.flats[b][lo:hi]
                    if self.host_master and data.device.type != "cpu":
                        data = data.detach().to("cpu", copy=True)
                    shards.append(Shard(b, lo, hi, torch.nn.Parameter(data), group, slot))
        return shards

    def _param_runs(self, bucket: Bucket, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """[start, end) cut at every parameter: (lo, hi, group, slot), groupless ones left out."""
        runs = []
        for slot, (p, offset) in enumerate(zip(bucket.params, bucket.offsets)):
            lo, hi = max(start, offset), min(end, offset + p.numel())
            group = 0 if self.group_of is None else self.group_of.get(id(p), -1)
            if lo < hi and group >= 0:
                runs.append((lo, hi, group, slot))
        return runs

    def group_params(self, num_groups: int) -> list[Params]:
        """This rank's shard Parameters per group (an empty placeholder keeps a group's place)."""
        out: list[Params] = [[] for _ in range(num_groups)]
        for shard in self.shards:
            out[shard.group].append(shard.param)
        return [params or [torch.nn.Parameter(torch.empty(0))] for params in out]

    def groups_of(self, params: Params, num_groups: int) -> list[list[int]]:
        """Per optimizer group: the indices in ``params`` of the parameters it holds."""
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

    def attach_grads(
        self, grads_of: dict[int, torch.Tensor], offset_of: dict[int, int], used: list[list[bool]]
    ) -> None:
        """Point each shard's ``.grad`` at ``grads_of[b]`` (None where no rank used it)."""
        for shard in self.shards:
            if not used[shard.bucket][shard.slot]:
                shard.param.grad = None
                continue
            source = grads_of[shard.bucket]
            lo = shard.start - offset_of[shard.bucket]
            shard.param.grad = source[lo : lo + shard.end - shard.start]

    def canonical_state(self, optimizer: Optimizer, params: Params, group: Any) -> dict[str, Any]:
        """Every owner's shard state as per-parameter state by index in ``params`` (collective)."""
        local = {}
        for shard in self.shards:
            shard_state = optimizer.state.get(shard.param, {})
            key = (shard.bucket, shard.start, shard.end)
            local[key] = {k: _cpu(v) for k, v in shard_state.items()}
        gathered: list[dict] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
        dist.all_gather_object(gathered, local, group=group)
        pieces = {key: value for part in gathered for key, value in part.items()}
        index = {id(p): i for i, p in enumerate(params)}
        state: ShardState = {}
        for b, bucket in enumerate(self.buckets):
            for p, offset in zip(bucket.params, bucket.offsets):
                entry = _assemble(pieces, b, offset, p)
                if entry:
                    state[index[id(p)]] = entry
        return {"state": state, "param_groups": hyperparameters(self, optimizer, params)}

    def load_canonical_state(
        self, optimizer: Optimizer, params: Params, canonical: dict[str, Any]
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

    def _overlaps(self, params: Params) -> Any:
        """(shard, parameter index, start and end within it, its offset in the bucket)."""
        index = {id(p): i for i, p in enumerate(params)}
        for shard in self.shards:
            bucket = self.buckets[shard.bucket]
            p, offset = bucket.params[shard.slot], bucket.offsets[shard.slot]
            yield shard, index[id(p)], shard.start - offset, shard.end - offset, offset

    def owned_ranges(self, params: Params) -> dict[int, list[tuple[int, int]]]:
        ranges: dict[int, list[tuple[int, int]]] = {}
        for _, i, lo, hi, _ in self._overlaps(params):
            ranges.setdefault(i, []).append((lo, hi))
        return ranges

    def held_state(self, optimizer: Optimizer, params: Params) -> ShardState:
        """This rank's shards' state per parameter index, as ``(flat start, 1-D view)`` pieces."""
        out: ShardState = {}
        for shard, i, lo, hi, offset in self._overlaps(params):
            for key, value in optimizer.state.get(shard.param, {}).items():
                entry = out.setdefault(i, {})
                if isinstance(value, torch.Tensor) and value.dim() == 1:
                    start = offset + lo - shard.start
                    entry.setdefault(key, []).append((lo, value[start : start + hi - lo]))
                else:
                    entry.setdefault(key, value)
        return out

    def local_state(self, optimizer: Optimizer, params: Params, group: Any) -> ShardState:
        """``held_state``, with zeros for keys other ranks hold (one small message)."""
        out = self.held_state(optimizer, params)
        kinds = _agree(_kinds(out), group)
        for _, i, lo, hi, _ in self._overlaps(params):
            for key, kind in kinds.get(i, {}).items():
                pieces = out.setdefault(i, {}).setdefault(key, [])
                if isinstance(kind, torch.dtype) and not any(s == lo for s, _ in pieces):
                    pieces.append((lo, torch.zeros(hi - lo, dtype=kind)))
        return out

    def piece_owners(self, params: Params) -> dict[int, list[Piece]]:
        """Per parameter index, every rank's shards as ``(lo, hi, rank)`` (no message)."""
        position = {id(p): i for i, p in enumerate(params)}
        out: dict[int, list[Piece]] = {}
        for b, bucket in enumerate(self.buckets):
            num_grads = bucket.grads.numel()
            for (start, end), owner in zip(self.ranges[b], self.owners[b]):
                for lo, hi, _, slot in self._param_runs(bucket, start, min(end, num_grads)):
                    offset, i = bucket.offsets[slot], position[id(bucket.params[slot])]
                    out.setdefault(i, []).append((lo - offset, hi - offset, owner))
        return out

    def carry(self, optimizer: Optimizer, params: Params) -> Carried:
        """What this rank's shards hold, for another layout's ``load_carried`` (no copy)."""
        groups = hyperparameters(self, optimizer, params)
        return Carried(self.held_state(optimizer, params), self.piece_owners(params), groups)

    def load_carried(
        self, optimizer: Optimizer, params: Params, carried: Carried, group: Any
    ) -> None:
        """Load another layout's ``carry`` (collective), changed owners' ranges point to point:
        the transient is at most the old state (gathering it all cost several times that)."""
        kinds = _agree(_kinds(carried.state), group)
        fresh, targets = self._fresh_state(params, kinds, carried.state)
        moves = _Moves(group, self.buckets[0].flat.device if self.buckets else None)
        owners = self.piece_owners(params)
        for i in sorted(kinds):
            for key in sorted(k for k, kind in kinds[i].items() if isinstance(kind, torch.dtype)):
                for (a, b, src), (c, d, dst) in product(carried.owners[i], owners.get(i, [])):
                    lo, hi = max(a, c), min(b, d)
                    if lo >= hi or self.rank not in (src, dst):
                        continue
                    held = _slice_of(carried.state.get(i, {}).get(key, []), lo, hi)
                    if held is None and src == self.rank:  # this piece was never stepped here
                        held = torch.zeros(hi - lo, dtype=kinds[i][key])
                    pieces = [(lo_t, entry[key]) for lo_t, entry in targets.get(i, [])]
                    moves.move(src, dst, self.rank, held, _slice_of(pieces, lo, hi))
        moves.finish()
        carried.state.clear()  # consumed: the old state is freed now, not when the caller returns
        number = optimizer_positions(optimizer)
        state = {number[pid]: entry for pid, entry in fresh.items()}
        groups = merged_groups(optimizer, carried.groups)
        load_into(optimizer, {"state": state, "param_groups": groups})

    def _fresh_state(
        self, params: Params, kinds: ShardState, held: dict
    ) -> tuple[ShardState, dict[int, list[tuple[int, dict[str, Any]]]]]:
        """State to fill for this rank's shards: by id(shard param), and by parameter index."""
        position = {id(p): i for i, p in enumerate(params)}
        fresh: ShardState = {}
        targets: dict[int, list[tuple[int, dict[str, Any]]]] = {}
        for shard in self.shards:
            bucket = self.buckets[shard.bucket]
            i = position[id(bucket.params[shard.slot])]
            if i not in kinds:
                continue
            lo = shard.start - bucket.offsets[shard.slot]
            entry = {}
            for key, kind in kinds[i].items():
                mine = held.get(i, {}).get(key, kind)
                if not isinstance(kind, torch.dtype):
                    entry[key] = _own(mine)
                    continue
                whole = _slice_of(mine if isinstance(mine, list) else [], lo, lo + shard.numel)
                if whole is None or not _owns_storage(whole, shard.param.device):
                    whole = torch.zeros(shard.numel, dtype=kind, device=shard.param.device)
                entry[key] = whole
            fresh[id(shard.param)] = entry
            targets.setdefault(i, []).append((lo, entry))
        return fresh, targets

    def load_local_state(
        self, optimizer: Optimizer, params: Params, state: ShardState, groups: Groups
    ) -> None:
        """Load pieces covering ``owned_ranges``; refresh host masters from the buffers."""
        shard_state: ShardState = {}
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


def used_flags(summed: torch.Tensor) -> list[bool]:
    """Per parameter, from summed usage flags: whether any rank used it (NaN counts)."""
    return (summed < 0.5).logical_not().tolist()


def hyperparameters(sharded: ShardedParameters, optimizer: Optimizer, params: list) -> Groups:
    """The optimizer's groups: hyperparameters, ``params`` as indices in ``params``."""
    members = sharded.groups_of(params, len(optimizer.param_groups))
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": members[n]}
        for n, g in enumerate(optimizer.param_groups)
    ]


def optimizer_positions(optimizer: Optimizer) -> dict[int, int]:
    """id(tensor) -> its index in the optimizer's state dict (groups in order)."""
    order = [p for g in optimizer.param_groups for p in g["params"]]
    return {id(p): n for n, p in enumerate(order)}


def merged_groups(optimizer: Optimizer, saved: list[dict]) -> Groups:
    """``param_groups`` for ``load_state_dict``: group k's from saved group k (or the first)."""
    groups, start = [], 0
    for k, g in enumerate(optimizer.param_groups):
        stored = saved[k] if k < len(saved) else (saved[0] if saved else {})
        hyper = {a: b for a, b in {**g, **stored}.items() if a != "params"}
        groups.append({**hyper, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    return groups


def copy_pieces(pieces: list[tuple[int, torch.Tensor]], lo: int, out: torch.Tensor) -> int:
    """Copy into ``out`` (flat, from ``lo``) what the pieces hold of it; returns the count."""
    hi, covered = lo + out.numel(), 0
    for start, flat in pieces:
        a, b = max(lo, start), min(hi, start + flat.numel())
        if a < b:
            out[a - lo : b - lo].copy_(flat[a - start : b - start])
            covered += b - a
    return covered


def _slice_of(pieces: list[tuple[int, torch.Tensor]], lo: int, hi: int) -> Any:
    """The view of [lo, hi) in the piece that holds all of it, or None."""
    for start, flat in pieces:
        if start <= lo and hi <= start + flat.numel():
            return flat[lo - start : hi - start]
    return None


def _owns_storage(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` is on ``device`` and the whole of its storage (keeps nothing else alive)."""
    whole = t.storage_offset() == 0 and t.nbytes == t.untyped_storage().nbytes()
    return bool(whole and t.device == device)


def _kinds(held: ShardState) -> ShardState:
    """Per parameter and key: the dtype of per-element pieces, or the value (a step count)."""
    return {
        i: {k: v[0][1].dtype if isinstance(v, list) else v for k, v in entry.items()}
        for i, entry in held.items()
    }


def _agree(kinds: ShardState, group: Any) -> ShardState:
    """Every rank's ``_kinds`` merged (one small message; the first rank's value wins)."""
    if dist.get_world_size(group) == 1:
        return kinds
    everyone: list[dict] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(everyone, kinds, group=group)
    merged: ShardState = {}
    for part in everyone:
        for i, entry in part.items():
            for key, kind in entry.items():
                merged.setdefault(i, {}).setdefault(key, kind)
    return merged


def _cpu(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def _own(value: Any) -> Any:
    """A private copy of a scalar state (Adam's ``step``: updated in place, never shared)."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def _assemble(pieces: dict, bucket: int, offset: int, p: torch.Tensor) -> dict[str, Any]:
    """Per-parameter state for the parameter at ``offset`` in ``bucket`` from shard pieces."""
    end = offset + p.numel()
    parts = sorted(
        (start, s) for (b, start, stop), s in pieces.items() if b == bucket and start < end
        and stop > offset
    )  # fmt: skip
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
