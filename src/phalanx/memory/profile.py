"""The one per-layer profiler (F16): per layer, time and memory; every saved tensor's lifetime
(the pack hook wrapper's ``__del__`` is its release); docs/memory.md describes what it records."""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence, Sized
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.costs import LayerCost
from phalanx.errors import ConfigError, DataError, PhalanxError
from phalanx.fileio import atomic_write_text
from phalanx.memory import measure
from phalanx.metrics import HINT

FORMAT_VERSION = 1
MIB = float(1 << 20)
CATEGORIES = ("parameters", "gradients", "optimizer", "activations")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
Autocast = Callable[[], contextlib.AbstractContextManager]
# (inputs, targets) of one step; targets None when there is no loss function
Batch = tuple[torch.Tensor, torch.Tensor | None]


# -- the data model -----------------------------------------------------------------------------
@dataclass(kw_only=True)
class LayerProfile:
    """One layer of the sequence (``name`` is its index, as in the model's state dict)."""

    index: int
    name: str
    type: str  # the module's class name
    forward_s: float  # median over the timed steps
    backward_s: float  # from its output's gradient being ready to its input's
    saved_bytes: int  # distinct storages its autograd nodes keep for backward (may overlap a
    #                   neighbour's: a ReLU output that the next Linear saves as its input)
    output_bytes: int  # its output activation (what a pipeline boundary after it carries)
    param_bytes: int  # its own parameters (a tied parameter counts in its first layer)
    buffer_bytes: int  # its buffers (BatchNorm's running statistics)
    grad_bytes: int  # its parameters' gradients after backward
    optimizer_bytes: int  # its parameters' optimizer state after optimizer.step
    backward_work_bytes: int = 0  # measured (``measure_work``): see costs.LayerCost


# what a LayerCost takes from a LayerProfile as it is
_COST_FIELDS = ("name", "forward_s", "backward_s", "param_bytes", "output_bytes", "saved_bytes",
                "backward_work_bytes")  # fmt: skip


@dataclass(kw_only=True)
class SavedTensor:
    """One storage autograd saved in the traced step, in events ``created <= k < released``
    (None: it outlived the step)."""

    layer: int | None  # the layer whose forward saved it first; None: the loss function
    users: list[int | None]  # every layer whose backward needs it, in forward order (None: loss)
    refs: int  # saved references (autograd SavedVariables) to it: F17's reference count
    nbytes: int  # the storage's bytes
    shape: list[int]  # of the first saved view
    dtype: str
    created: int  # timeline index of the first event it is part of
    released: int | None  # timeline index of the first event after backward freed it
    created_s: float  # seconds since the step began
    released_s: float | None


@dataclass(kw_only=True)
class MemoryEvent:
    """Bytes by category right after one event of the traced step (phase start, forward,
    backward, optimizer; ``layer`` None: the loss, start, optimizer)."""

    phase: str
    layer: int | None
    time_s: float  # seconds since the step began
    parameters: int  # parameters and buffers
    gradients: int  # parameter gradients
    optimizer: int  # optimizer state
    activations: int  # storages autograd holds for backward
    allocated_bytes: int | None = None  # CUDA allocator's count (None on CPU)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations


@dataclass(kw_only=True)
class MemoryProfile:
    """What ``profile_model`` measured; JSON-ready with ``to_dict``/``from_dict``."""

    device: str
    batch_size: int
    steps: int  # steps run
    warmup: int  # of them, not timed
    layers: list[LayerProfile]
    loss_forward_s: float
    loss_backward_s: float
    optimizer_s: float
    loss_saved_bytes: int  # what the loss function saves (log-probabilities, targets)
    saved: list[SavedTensor]  # the traced (last) step's saved storages, in creation order
    timeline: list[MemoryEvent]  # the traced step, event by event
    # allocator's peak over the last step: CUDA's max_memory_allocated, or on the CPU the live
    # bytes at the step's start plus the growth torch.profiler's allocation events show
    measured_peak_bytes: int | None = None
    torch_version: str = field(default_factory=lambda: torch.__version__)
    # each timed step's forward + backward + optimizer seconds: the spread of the medians
    step_s: list[float] = field(default_factory=list)
    # median seconds a step waited for its batch (a run's input pipeline; 0: batches given)
    input_wait_s: float = 0.0

    @property
    def spread(self) -> float | None:
        """The timed steps' interquartile range as a fraction of their median (None: fewer
        than 4 timed steps, too few for quartiles)."""
        return step_spread(self.step_s)

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes + layer.buffer_bytes for layer in self.layers)

    @property
    def peak_index(self) -> int:
        """Index in ``timeline`` of the largest total (the first, if several are equal)."""
        totals = [event.total for event in self.timeline]
        return totals.index(max(totals))

    @property
    def peak(self) -> MemoryEvent:
        return self.timeline[self.peak_index]

    def describe_event(self, event: MemoryEvent) -> str:
        """'forward of layer 6 (Linear)', 'backward of the loss', 'optimizer step'."""
        if event.phase == "start":
            return "step start"
        if event.phase == "optimizer":
            return "optimizer step"
        if event.layer is None:
            return f"{event.phase} of the loss"
        layer = self.layers[event.layer]
        return f"{event.phase} of layer {layer.name} ({layer.type})"

    def layer_costs(self, input_bytes: int = 0) -> list[LayerCost]:
        """Each layer's cost, in forward order; ``input_bytes``: the first layer's input (each
        later one's is the output before it); a layer's gradients are one tensor here."""
        inputs = [input_bytes, *(layer.output_bytes for layer in self.layers[:-1])]
        return [
            LayerCost(
                **{key: getattr(layer, key) for key in _COST_FIELDS},
                input_bytes=inputs[i],
                grad_bytes=(layer.grad_bytes,) if layer.grad_bytes else (),
            )
            for i, layer in enumerate(self.layers)
        ]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["format"] = FORMAT_VERSION
        data["peak"] = {"index": self.peak_index, "bytes": self.peak.total}  # for readers
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryProfile:
        if data.get("format") != FORMAT_VERSION:
            raise DataError(f"memory profile: format {data.get('format')!r}, expected 1")
        try:
            values = _known(cls, data)
            values["layers"] = [LayerProfile(**_known(LayerProfile, x)) for x in data["layers"]]
            values["saved"] = [SavedTensor(**_known(SavedTensor, x)) for x in data["saved"]]
            values["timeline"] = [MemoryEvent(**_known(MemoryEvent, x)) for x in data["timeline"]]
            return cls(**values)
        except (KeyError, TypeError) as e:
            raise DataError(f"memory profile: malformed ({type(e).__name__}: {e})") from None

    def save(self, path: Path) -> None:
        """Write as JSON, atomically (a reader never sees half a file)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> MemoryProfile:
        try:
            return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as e:
            if isinstance(e, DataError):
                raise DataError(f"{path}: {e}") from None
            raise DataError(f"{path}: not a memory profile ({e})") from None


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``data`` that are fields of ``cls`` (newer files may carry more)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


# -- tracing one step ---------------------------------------------------------------------------
class _Record:
    """A saved storage while the step runs (becomes a SavedTensor)."""

    __slots__ = ("key", "saved", "live")

    def __init__(self, key: tuple[int, int], saved: SavedTensor) -> None:
        self.key, self.saved = key, saved
        self.live = 0  # saved references not yet released


class _Packed:
    """What autograd stores instead of the tensor; ``__del__`` reports its release. A detached
    alias: the tensor itself would be a cycle for saved outputs (tensor -> grad_fn -> saved)."""

    __slots__ = ("tensor", "record", "trace")

    def __init__(self, tensor: torch.Tensor, record: _Record, trace: _StepTrace) -> None:
        self.tensor, self.record, self.trace = tensor, record, trace

    def __del__(self) -> None:
        self.trace.release(self.record)


class _StepTrace:
    """Hooks and records of one step: events, saved storages, per-layer times."""

    def __init__(
        self,
        num_layers: int,
        model_storages: set[tuple[int, int]],
        snapshot: Callable[[], tuple[int, int, int, int | None]],
        device: torch.device,
        measure_work: bool = False,
    ) -> None:
        self.measure_work = measure_work
        self.backward_work = [0] * num_layers
        self.work_start = 0
        self.model_storages = model_storages
        self.snapshot = snapshot  # -> bytes of (gradients, optimizer, parameters, allocated)
        self.device = device
        self.current: int | None = None  # the layer whose forward runs; None: the loss
        self.live: dict[tuple[int, int], _Record] = {}
        self.saved: list[SavedTensor] = []
        self.layer_saved: list[dict[tuple[int, int], int]] = [{} for _ in range(num_layers)]
        self.loss_saved: dict[tuple[int, int], int] = {}
        self.events: list[MemoryEvent] = []
        self.live_bytes = 0
        self.forward_s = [0.0] * num_layers
        self.backward_s = [0.0] * num_layers
        self.output_bytes = [0] * num_layers
        self.loss_forward_s = self.loss_backward_s = self.optimizer_s = 0.0
        self.pending: int | None = None  # the layer whose backward runs; None: the loss
        self.t0 = self.mark = 0.0

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.t0

    def start(self) -> None:
        self.t0 = 0.0
        self.t0 = self.now()  # after the device's queued work
        self.event("start", None)

    def event(self, phase: str, layer: int | None) -> None:
        gradients, optimizer, parameters, allocated = self.snapshot()
        self.events.append(
            MemoryEvent(
                phase=phase, layer=layer, time_s=self.now(), parameters=parameters,
                gradients=gradients, optimizer=optimizer, activations=self.live_bytes,
                allocated_bytes=allocated,
            )
        )  # fmt: skip

    # saved_tensors_hooks
    def pack(self, tensor: torch.Tensor) -> Any:
        key, nbytes = _storage(tensor)
        if nbytes == 0 or key in self.model_storages:
            return tensor  # model state (a weight) or nothing held: not an activation
        record = self.live.get(key)
        if record is None:
            record = _Record(
                key,
                SavedTensor(
                    layer=self.current, users=[], refs=0, nbytes=nbytes,
                    shape=list(tensor.shape), dtype=str(tensor.dtype).replace("torch.", ""),
                    created=len(self.events), released=None, released_s=None,
                    created_s=time.perf_counter() - self.t0,  # no CUDA sync per saved tensor
                ),
            )  # fmt: skip
            self.live[key] = record
            self.saved.append(record.saved)
            self.live_bytes += nbytes
        saved = record.saved
        saved.refs += 1
        if self.current not in saved.users:
            saved.users.append(self.current)
        owner = self.loss_saved if self.current is None else self.layer_saved[self.current]
        owner[key] = nbytes
        record.live += 1
        return _Packed(tensor.detach(), record, self)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Packed) else packed

    def release(self, record: _Record) -> None:
        record.live -= 1
        if record.live > 0:
            return
        saved = record.saved
        saved.released, saved.released_s = len(self.events), time.perf_counter() - self.t0
        self.live_bytes -= saved.nbytes
        if self.live.get(record.key) is record:
            del self.live[record.key]

    # backward boundaries
    def begin_backward(self) -> None:
        self.pending, self.mark = None, self.now()
        self.start_work()

    def start_work(self) -> None:
        """The next layer's backward starts: a new high-water mark from what is held now."""
        if self.measure_work:
            self.work_start = measure.current_bytes(self.device)
            measure.reset_peak(self.device)

    def gradient_ready(self, layer: int) -> Callable[[torch.Tensor], None]:
        """Hook for layer ``layer``'s output: its backward starts, the pending one has ended."""

        def hook(grad: torch.Tensor) -> None:
            self.close_pending()
            self.pending, self.mark = layer, self.now()
            self.start_work()

        return hook

    def close_pending(self) -> None:
        elapsed = self.now() - self.mark
        if self.pending is None:
            self.loss_backward_s = elapsed
        else:
            self.backward_s[self.pending] = elapsed
            if self.measure_work:
                high = measure.peak_bytes(self.device)
                self.backward_work[self.pending] = max(0, high - self.work_start)
        self.event("backward", self.pending)


def _storage(tensor: torch.Tensor) -> tuple[tuple[int, int], int]:
    """((data pointer, bytes), bytes) of the storage under ``tensor``; tensors without a plain
    storage (wrapper subclasses) count their own elements, keyed by identity."""
    try:
        storage = tensor.untyped_storage()
        return (storage.data_ptr(), storage.nbytes()), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        nbytes = tensor.numel() * tensor.element_size()
        return (id(tensor), -1), nbytes


def _distinct_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        key, nbytes = _storage(t)
        seen[key] = nbytes
    return sum(seen.values())


def _state_tensors(optimizer: torch.optim.Optimizer | None, params: Iterable[nn.Parameter]) -> list:
    if optimizer is None:
        return []
    return [
        value
        for p in params
        for value in optimizer.state.get(p, {}).values()
        if isinstance(value, torch.Tensor)
    ]


# -- profiling ----------------------------------------------------------------------------------
def profile_model(
    layers: Sequence[nn.Module],
    loss_fn: LossFn | None,
    optimizer_factory: OptimizerFactory | None,
    batches: Iterable[Batch],
    device: torch.device | str = "cpu",
    *,
    names: Sequence[str] | None = None,
    autocast: Autocast | None = None,
    warmup: int = 1,
    measure_peak: bool = True,
    measure_work: bool = False,
    until: Callable[[list[float]], bool] | None = None,
) -> MemoryProfile:
    """Train ``layers`` (in order, on ``device``) one step per batch and profile it.

    ``loss_fn`` None: backward from the output's sum; ``optimizer_factory`` None: no optimizer
    step, gradients None afterwards. Times are medians after ``warmup`` steps, bytes the last
    step's. ``measure_peak``: the allocator's peak over the last step (on a CPU under
    torch.profiler, untimed); ``measure_work``: each layer's backward high-water mark;
    ``until(step_s)`` True after a timed step: one more (traced) step ends the profile."""
    device = torch.device(device)
    layers = list(layers)
    names = [str(i) for i in range(len(layers))] if names is None else list(names)
    if len(names) != len(layers):
        raise ValueError(f"{len(names)} names for {len(layers)} layers")
    for layer in layers:  # in the modes training runs them in (a frozen BatchNorm stays so)
        layer.to(device)
    owned = _owned_parameters(layers)
    params = [p for group in owned for p in group]
    model_storages = {
        _storage(t)[0] for layer in layers for t in [*layer.parameters(), *layer.buffers()]
    }
    param_bytes = _distinct_bytes([*params, *(b for layer in layers for b in layer.buffers())])
    trainable = [p for p in params if p.requires_grad]
    optimizer = None if optimizer_factory is None else optimizer_factory(trainable)

    def snapshot() -> tuple[int, int, int, int | None]:
        grads = _distinct_bytes(p.grad for p in params if p.grad is not None)
        state = _distinct_bytes(_state_tensors(optimizer, params))
        allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        return grads, state, param_bytes, allocated

    traces: list[_StepTrace] = []
    measured_peak: int | None = None
    batch_size = 0
    if not isinstance(batches, Sized):  # a sized feed (build._Feed) is taken step by step
        batches = list(batches)
    stopping = False
    for k, (x, y) in enumerate(batches):
        final = stopping or k == len(batches) - 1
        if y is None and loss_fn is not None:
            raise ConfigError("profile: a loss function needs (inputs, targets) batches")
        # Own storages, as a training batch has: a slice of a data set saved by the first
        # layer would otherwise count as the whole data set's storage.
        x = x.to(device, copy=True)
        y = None if y is None else y.to(device, copy=True)
        batch_size = int(x.shape[0]) if x.dim() else 1
        _zero_grad(optimizer, trainable)  # before the peak's baseline (_run_step's too)
        cuda_peak = measure_peak and device.type == "cuda"
        if cuda_peak:
            torch.cuda.reset_peak_memory_stats(device)
        work = measure_work and final
        trace = _StepTrace(len(layers), model_storages, snapshot, device, work)
        last_on_cpu = device.type == "cpu" and final
        if measure_peak and last_on_cpu and not measure.profiler_running():
            with measure.AllocatorPeak() as allocated:
                _run_step(layers, names, loss_fn, optimizer, x, y, trace, autocast)
            # the batch was allocated before the block and lives through the step
            measured_peak = trace.events[0].total + allocated.peak_bytes + _distinct_bytes([x])
        else:
            _run_step(layers, names, loss_fn, optimizer, x, y, trace, autocast)
        traces.append(trace)
        if cuda_peak:
            measured_peak = int(torch.cuda.max_memory_allocated(device))
        if final:
            break
        stopping = until is not None and k >= warmup and until(_totals(traces[warmup:]))
    if not traces:
        raise DataError("profile: no batches to run")
    timed = traces[warmup:] or traces
    warm = len(traces) - len(timed)
    if measured_peak is not None and device.type == "cpu" and len(timed) > 1:
        timed = timed[:-1]  # the step under torch.profiler runs ~10% slower: not timed
    last = traces[-1]
    profiles = [
        LayerProfile(
            index=i,
            name=names[i],
            type=type(layer).__name__,
            forward_s=statistics.median(t.forward_s[i] for t in timed),
            backward_s=statistics.median(t.backward_s[i] for t in timed),
            saved_bytes=sum(last.layer_saved[i].values()),
            output_bytes=last.output_bytes[i],
            param_bytes=_distinct_bytes(owned[i]),
            buffer_bytes=_distinct_bytes(layer.buffers()),
            grad_bytes=_distinct_bytes(p.grad for p in owned[i] if p.grad is not None),
            optimizer_bytes=_distinct_bytes(_state_tensors(optimizer, owned[i])),
            backward_work_bytes=last.backward_work[i],
        )
        for i, layer in enumerate(layers)
    ]
    if optimizer is None:  # no step uses them: a split's model then trains from none
        _zero_grad(optimizer, trainable)
    return MemoryProfile(
        device=str(device),
        batch_size=batch_size,
        steps=len(traces),
        warmup=warm,
        layers=profiles,
        loss_forward_s=statistics.median(t.loss_forward_s for t in timed),
        loss_backward_s=statistics.median(t.loss_backward_s for t in timed),
        optimizer_s=statistics.median(t.optimizer_s for t in timed),
        loss_saved_bytes=sum(last.loss_saved.values()),
        saved=last.saved,
        timeline=last.events,
        measured_peak_bytes=measured_peak,
        step_s=_totals(timed),
    )


def _totals(traces: Sequence[_StepTrace]) -> list[float]:
    """Each step's forward + backward + optimizer seconds (layers and loss)."""
    return [
        sum(t.forward_s) + sum(t.backward_s) + t.loss_forward_s + t.loss_backward_s
        + t.optimizer_s
        for t in traces
    ]  # fmt: skip


def step_spread(step_s: Sequence[float]) -> float | None:
    """Interquartile range of ``step_s`` over its median (None: fewer than 4 values)."""
    if len(step_s) < 4:
        return None
    q1, median, q3 = statistics.quantiles(step_s, n=4)
    return (q3 - q1) / median if median > 0 else None


SPREAD_WARNING = 0.10  # a profile whose steps' IQR is over 10% of their median is flagged


def spread_line(profile: MemoryProfile) -> str:
    """'step: median 5.61 ms over 12 steps, spread (IQR) 4.2% of the median' and, when that is
    wide, a warning on the next line."""
    spread = profile.spread
    median = statistics.median(profile.step_s) if profile.step_s else 0.0
    text = f"step: median {median * 1e3:.3f} ms over {len(profile.step_s)} timed step(s)"
    if spread is None:
        return text + ", spread not known (fewer than 4 timed steps)"
    text += f", spread (IQR) {spread:.1%} of the median"
    if spread > SPREAD_WARNING:
        text += (
            f"\nwarning: the steps' spread is {spread:.0%} (> {SPREAD_WARNING:.0%}): the machine "
            "is busy or the model too small for a stable median; profile again when it is quiet"
        )
    return text


def _zero_grad(optimizer: torch.optim.Optimizer | None, params: list[nn.Parameter]) -> None:
    """Gradients to None: the optimizer's own ``zero_grad`` where there is one (a user's
    optimizer may hold more than ``params``), else each of ``params``'."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
        return
    for p in params:
        p.grad = None


def _owned_parameters(layers: list[nn.Module]) -> list[list[nn.Parameter]]:
    """Each layer's parameters; a parameter shared by several layers belongs to the first."""
    seen: set[int] = set()
    owned = []
    for layer in layers:
        mine = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in mine)
        owned.append(mine)
    return owned


def _run_step(
    layers: list[nn.Module],
    names: list[str],
    loss_fn: LossFn | None,
    optimizer: torch.optim.Optimizer | None,
    x: torch.Tensor,
    y: torch.Tensor | None,
    trace: _StepTrace,
    autocast: Autocast | None,
) -> None:
    """One training step (gradients already None) under the trace's hooks: forward layer by
    layer, loss (the output's sum without one), backward, optimizer step; an event after each."""
    context = autocast or contextlib.nullcontext
    trace.start()
    with torch.autograd.graph.saved_tensors_hooks(trace.pack, trace.unpack):
        h = x
        for i, layer in enumerate(layers):
            trace.current = i
            start = trace.now()
            try:
                with context():
                    h = layer(h)
            except (RuntimeError, ValueError, IndexError) as e:
                shape = tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
                raise PhalanxError(
                    f"profile: layer {names[i]} ({type(layer).__name__}) failed on input "
                    f"{shape}: {_first_line(e)}"
                ) from e
            trace.forward_s[i] = trace.now() - start
            if not isinstance(h, torch.Tensor):
                raise ConfigError(
                    f"profile: layer {names[i]} ({type(layer).__name__}) returned "
                    f"{type(h).__name__}; a layer sequence passes one tensor along"
                )
            trace.output_bytes[i] = h.numel() * h.element_size()
            trace.event("forward", i)
            if h.requires_grad:
                h.register_hook(trace.gradient_ready(i))
        trace.current = None
        start = trace.now()
        try:
            with context():
                loss = h.sum() if loss_fn is None or y is None else loss_fn(h, y)
        except (RuntimeError, ValueError, IndexError) as e:
            target = "none" if y is None else tuple(y.shape)
            raise PhalanxError(
                f"profile: the loss failed on output {tuple(h.shape)} and target "
                f"{target}: {_first_line(e)}"
            ) from e
        trace.loss_forward_s = trace.now() - start
        trace.event("forward", None)
    del h
    trace.begin_backward()
    if loss.requires_grad:  # nothing to differentiate when no layer trains (and no loss)
        loss.backward()
    trace.close_pending()
    del loss  # the graph: anything autograd still held goes now
    if optimizer is None:
        return
    start = trace.now()
    optimizer.step()
    trace.optimizer_s = trace.now() - start
    trace.event("optimizer", None)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# -- from a config ------------------------------------------------------------------------------
def pick_device(name: str = "auto") -> torch.device:
    """'auto': the first CUDA device if there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available here")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device: unknown device {name!r}; use auto, cpu or cuda") from None


# -- reporting ----------------------------------------------------------------------------------
def format_profile(profile: MemoryProfile) -> str:
    """The per-layer table and the peak line, as ``phalanx profile`` prints them."""
    # the last step on a CPU ran under the allocator's profiler, untimed
    timed = len(profile.step_s) or profile.steps - profile.warmup
    lines = [
        f"{profile.steps} step(s) on {profile.device}, batch {profile.batch_size}; times: median "
        f"of {timed} step(s) after {profile.warmup} warm-up; bytes: the last step",
        f"{'layer':<7}{'type':<18}{'fwd ms':>9}{'bwd ms':>9}{'saved MiB':>11}{'params MiB':>12}"
        f"{'grads MiB':>11}{'optim MiB':>11}{'output MiB':>12}",
    ]

    def row(name: str, kind: str, fwd: float, bwd: float, *sizes: int | None) -> str:
        cells = "".join(
            f"{'':>{w}}" if b is None else f"{b / MIB:>{w}.3f}"
            for b, w in zip(sizes, (11, 12, 11, 11, 12))
        )
        return f"{name:<7}{kind[:17]:<18}{fwd * 1e3:>9.3f}{bwd * 1e3:>9.3f}{cells}".rstrip()

    lines += [
        row(x.name, x.type, x.forward_s, x.backward_s, x.saved_bytes,
            x.param_bytes + x.buffer_bytes, x.grad_bytes, x.optimizer_bytes, x.output_bytes)
        for x in profile.layers
    ]  # fmt: skip
    lines.append(row("loss", "", profile.loss_forward_s, profile.loss_backward_s,
                     profile.loss_saved_bytes, None, None, None, None))  # fmt: skip
    layers = profile.layers
    forward_s = sum(x.forward_s for x in layers) + profile.loss_forward_s
    backward_s = sum(x.backward_s for x in layers) + profile.loss_backward_s
    lines.append(row("total", "", forward_s, backward_s, sum(s.nbytes for s in profile.saved),
                     profile.param_bytes, sum(x.grad_bytes for x in layers),
                     sum(x.optimizer_bytes for x in layers), None))  # fmt: skip
    lines.append(
        f"step {(forward_s + backward_s + profile.optimizer_s) * 1e3:.3f} ms: forward "
        f"{forward_s * 1e3:.3f}, backward {backward_s * 1e3:.3f}, optimizer "
        f"{profile.optimizer_s * 1e3:.3f}"
    )
    lines.append(spread_line(profile))
    if profile.input_wait_s:
        lines.append(f"input wait: median {profile.input_wait_s * 1e3:.3f} ms per step")
    peak = profile.peak
    text = (
        f"peak {peak.total / MIB:.3f} MiB after {profile.describe_event(peak)}: "
        + ", ".join(f"{c} {getattr(peak, c) / MIB:.3f}" for c in CATEGORIES)
        + " MiB"
    )
    if profile.measured_peak_bytes is not None:
        text += (
            f" (allocator peak {profile.measured_peak_bytes / MIB:.3f} MiB: every tensor, "
            "kernels' workspaces included)"
        )
    lines.append(text)
    lines.append(
        "saved: what autograd keeps for the layer's backward; a storage two layers save (a ReLU\n"
        "output the next Linear saves as its input) is in both rows and once in the total"
    )
    return "\n".join(lines)


def plot_profile(profile: MemoryProfile, output: Path) -> None:
    """A PNG of the traced step's memory by category, one stacked bar per event, peak marked."""
    pyplot = require_matplotlib()
    events = profile.timeline
    labels = [_short_label(e) for e in events]
    fig, ax = pyplot.subplots(figsize=(max(8.0, 0.32 * len(events) + 2), 4.8))
    bottom = [0.0] * len(events)
    colors = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868",
              "activations": "#c44e52"}  # fmt: skip
    positions = list(range(len(events)))
    for category in CATEGORIES:
        heights = [getattr(e, category) / MIB for e in events]
        ax.bar(positions, heights, bottom=bottom, width=0.85, label=category,
               color=colors[category])  # fmt: skip
        bottom = [b + h for b, h in zip(bottom, heights)]
    if any(e.allocated_bytes is not None for e in events):
        allocated = [(e.allocated_bytes or 0) / MIB for e in events]
        ax.plot(positions, allocated, color="black", linewidth=1, marker=".",
                label="CUDA allocated")  # fmt: skip
    k = profile.peak_index
    ax.annotate(
        f"peak {events[k].total / MIB:.2f} MiB", xy=(k, bottom[k]), ha="center", va="bottom",
        xytext=(0, 4), textcoords="offset points", fontsize=8,
    )  # fmt: skip
    ax.set_xticks(positions)
    ax.set_xticklabels(labels, rotation=90, fontsize=7)
    ax.set_ylabel("MiB")
    ax.set_title(
        f"memory over one step by category ({profile.device}, batch {profile.batch_size}); "
        "F: forward, B: backward of layer"
    )
    ax.margins(y=0.12)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    pyplot.close(fig)


def _short_label(event: MemoryEvent) -> str:
    if event.phase in ("start", "optimizer"):
        return event.phase.replace("optimizer", "opt")
    prefix = "F" if event.phase == "forward" else "B"
    return f"{prefix} loss" if event.layer is None else f"{prefix}{event.layer}"


def require_matplotlib() -> Any:
    """matplotlib.pyplot (Agg backend), or a one-line error naming the ``viz`` extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        raise PhalanxError(f"phalanx profile --plot {HINT}") from None
    return pyplot
