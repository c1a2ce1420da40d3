"""The cluster a plan is for: nodes x devices, and the two levels of links between devices
(alpha + bytes / beta per message and direction; rank r lives on node r // devices_per_node).
Sources: a TOML file (``load_cluster``) or a ``link.json`` (``from_link``); every mistake is a
one-line ConfigError naming the file and the key. Keys: docs/planner.md, "Inputs"."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from phalanx.errors import ConfigError
from phalanx.exchange.compression import make_codec
from phalanx.exchange.link import MESSAGE_PROBE_BYTES, LinkModel
from phalanx.fields import ConfigValueError, from_dict, option, require

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

INTRA, INTER = "intra", "inter"  # link levels: within a node, between nodes
LEVELS = (INTRA, INTER)


@dataclass(kw_only=True)
class LinkConfig:
    """One level of links: a message of n bytes takes alpha_s + n / beta_bytes_per_s."""

    alpha_s: float = option(doc="latency per message in seconds (software and wire)")
    beta_bytes_per_s: float = option(doc="bandwidth per direction in bytes per second")

    def __post_init__(self) -> None:
        require(
            math.isfinite(self.alpha_s) and self.alpha_s >= 0,
            "alpha_s",
            f"must be a finite number >= 0 seconds, got {self.alpha_s!r}",
        )
        require(
            self.beta_bytes_per_s > 0,
            "beta_bytes_per_s",
            f"must be > 0 bytes per second, got {self.beta_bytes_per_s!r}",
        )

    def message_s(self, nbytes: float) -> float:
        """Seconds one message of ``nbytes`` bytes occupies this link."""
        return self.alpha_s + nbytes / self.beta_bytes_per_s


@dataclass(kw_only=True)
class ClusterConfig:
    """Devices, their placement on nodes and the links between them (see the module doc)."""

    name: str = option(doc="a short name for tables and plots")
    devices_per_node: int = option(doc="devices (ranks) on each node")
    intra: LinkConfig = option(doc="links between devices of one node ([intra])")
    inter: LinkConfig | None = option(
        None, "links between nodes ([inter]); needed unless the cluster is one node"
    )
    nodes: int = option(0, "nodes available (0: as many as a plan asks for)")
    shared_nic: bool = option(
        True, "the devices of a node share one network card for inter-node messages"
    )
    shared_intra: bool = option(
        False,
        "messages within a node share one medium and take turns at the intra link's bandwidth "
        "(processes on one machine's CPUs over loopback: every byte is copied by the same "
        "cores and memory); False: each device has its own full-duplex ports (NVLink, PCIe)",
    )
    compute_speed: float = option(
        1.0, "how many times faster a device computes than the one the step profile came from"
    )
    codec_s_per_byte: float = option(
        0.0, "compression cost: seconds per uncompressed gradient byte to encode and decode a hop"
    )
    add_s_per_byte: float = option(
        0.0,
        "seconds per byte to add an uncompressed gradient message into a buffer (phalanx's "
        "point-to-point reductions; the backend's allreduce has it in its alpha and beta)",
    )
    message_overhead_s: float = option(
        0.0,
        "seconds every message costs beyond its link's alpha + n / beta: the hosts' software "
        "path of a message sent from a communication thread after a pause (the wake-ups of "
        "both ranks' threads), as a mean; from_link measures it "
        "(exchange.link.measure_message_s); hand-overs within a rank: handoff_s",
    )
    host_cores_per_node: int = option(
        0,
        "CPU ranks: the cores a node's processes share (0: devices compute on their own). "
        "While the compute stream is busy, communication then runs at cores / (2 x ranks on "
        "the node, at most the cores) of its speed (each rank's compute and communication "
        "thread want a core) and compute loses the rest",
    )
    handoff_s: float = option(
        0.0,
        "seconds one thread of a rank takes to act on another's signal: a job handed to the "
        "sleeping communication thread starts that much later, and a compute thread waiting "
        "for that thread's job resumes that much after it ends (from_link takes the median of "
        "exchange.comm.measure_handoff_s)",
    )
    collective_call_s: float = option(
        0.0,
        "seconds a per-unit collective of torch's fully_shard costs the rank's compute thread "
        "per ring step beyond its transfer (the call, FSDP2's hooks and copies, waking up for "
        "its result); measured once per cluster on a tiny fully_shard model at 2 ranks "
        "(calibrate.measure_collective_call_s); 0: not charged",
    )
    collective_call_cpu_s: float = option(
        0.0,
        "CPU seconds the same collective costs its rank per ring step when a node's CPU ranks "
        "outnumber its cores (all of the rank's threads: the call, the hooks, Gloo's), charged "
        "there instead of collective_call_s: a rank's wait in the call is then another rank's "
        "turn on the core, its CPU work is not; measured once per cluster on the same tiny "
        "model at 3 ranks pinned to 2 cores (calibrate.measure_collective_call_cpu_s); "
        "0: not charged",
    )
    compute_slowdown: tuple[float, ...] = option(
        (),
        "the step's compute time with k ranks on a node over its time alone, for k = 1, 2, "
        "...: ranks sharing a node's cores, caches and memory bandwidth (CPU ranks; measured "
        "once per cluster on a reference step); empty: devices compute on their own (1)",
    )
    description: str = option("", "where the numbers come from")
    assumed: tuple[str, ...] = option(
        (),
        "terms that were not measured and the default each stands on ('key: why: value'); "
        "phalanx plan prints them",
    )

    def __post_init__(self) -> None:
        require(bool(self.name.strip()), "name", "must not be empty")
        require(
            self.devices_per_node >= 1,
            "devices_per_node",
            f"must be >= 1, got {self.devices_per_node}",
        )
        require(self.nodes >= 0, "nodes", f"must be >= 0 (0: unlimited), got {self.nodes}")
        require(
            self.host_cores_per_node >= 0,
            "host_cores_per_node",
            f"must be >= 0 (0: devices compute on their own), got {self.host_cores_per_node}",
        )
        require(
            math.isfinite(self.compute_speed) and self.compute_speed > 0,
            "compute_speed",
            f"must be > 0, got {self.compute_speed!r}",
        )
        require(
            all(math.isfinite(f) and f > 0 for f in self.compute_slowdown),
            "compute_slowdown",
            f"factors must be > 0, got {list(self.compute_slowdown)}",
        )
        for key in ("codec_s_per_byte", "add_s_per_byte", "message_overhead_s", "handoff_s",
                    "collective_call_s", "collective_call_cpu_s"):  # fmt: skip
            value = getattr(self, key)
            require(math.isfinite(value) and value >= 0, key, f"must be >= 0, got {value!r}")

    # -- placement ------------------------------------------------------------------------------
    @property
    def capacity(self) -> int | None:
        """Devices in the cluster (None: unlimited)."""
        return self.nodes * self.devices_per_node if self.nodes else None

    def check_devices(self, num_devices: int) -> None:
        """One-line ConfigError when ``num_devices`` ranks do not fit this cluster."""
        if num_devices < 1:
            raise ConfigError(f"--devices: counts must be >= 1, got {num_devices}")
        if self.capacity is not None and num_devices > self.capacity:
            raise ConfigError(
                f"--devices: {num_devices} devices do not fit cluster {self.name!r} "
                f"({self.nodes} nodes x {self.devices_per_node} devices = {self.capacity})"
            )
        if self.inter is None and num_devices > self.devices_per_node:
            raise ConfigError(
                f"--devices: {num_devices} devices need more than one node of cluster "
                f"{self.name!r}, which has no [inter] link"
            )

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def link(self, level: str) -> LinkConfig:
        """The link of ``level`` (``INTRA`` or ``INTER``)."""
        if level == INTER:
            assert self.inter is not None, "check_devices() refuses inter-node plans without it"
            return self.inter
        return self.intra

    def ring_link(self, num_devices: int) -> tuple[float, float]:
        """(alpha, beta) that ``phalanx.exchange.link.calibrate`` would fit for a ring allreduce
        over ``num_devices`` ranks: each ring step waits for its slowest link, so the ring is
        paced by the inter-node link as soon as the ranks span two nodes."""
        if num_devices <= self.devices_per_node:
            return self.intra.alpha_s, self.intra.beta_bytes_per_s
        inter = self.link(INTER)
        return (
            max(self.intra.alpha_s, inter.alpha_s),
            min(self.intra.beta_bytes_per_s, inter.beta_bytes_per_s),
        )

    def compute_slowdown_at(self, world: int) -> float:
        """How many times longer a rank's compute takes at ``world`` ranks than alone: the
        measured factor for the ranks sharing one node (the last one past what was measured)."""
        ranks = min(world, self.devices_per_node)
        measured = self.compute_slowdown or (1.0,)
        factor = measured[min(ranks, len(measured)) - 1]
        cores = self.host_cores_per_node
        if cores > 0 and ranks > cores:  # more CPU ranks than cores: they take turns
            factor = max(factor, measured[min(cores, len(measured)) - 1] * ranks / cores)
        return factor

    def collective_call_s_at(self, world: int) -> float:
        """A fully_shard collective's cost to its rank's compute thread per ring step at
        ``world`` ranks: ``collective_call_s``; with more CPU ranks than cores, its CPU work
        only (``collective_call_cpu_s``: a rank waiting in the call is another's turn)."""
        cores, ranks = self.host_cores_per_node, min(world, self.devices_per_node)
        if world < 2:
            return 0.0
        per_step = self.collective_call_cpu_s if 0 < cores < ranks else self.collective_call_s
        return per_step * (world - 1)

    def on_one_host(self, world: int) -> ClusterConfig:
        """This cluster with ``world`` ranks started on one of its nodes (``phalanx train
        --nproc N`` on this machine; N above its devices oversubscribes the cores)."""
        if world <= self.devices_per_node:
            return self
        return replace(self, devices_per_node=world)

    def comm_rate_beside_compute(self, world: int) -> float:
        """Communication's speed while the compute stream is busy, a fraction of its calibrated
        speed: 1 for devices; CPU ranks: cores / (2 x ranks), ranks counted up to the cores
        (docs/planner.md, "CPU ranks"). Compute beside it loses (1 - this rate) of the overlap."""
        if self.host_cores_per_node <= 0:
            return 1.0
        ranks = min(world, self.devices_per_node, self.host_cores_per_node)
        return min(1.0, self.host_cores_per_node / (2 * ranks))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cluster_from_dict(data: dict[str, Any], where: str = "cluster") -> ClusterConfig:
    """A ClusterConfig from parsed TOML; errors are one line: '<where>: <key>: <reason>'."""
    for key in ("name", "devices_per_node", "intra"):
        if key not in data:
            raise ConfigError(f"{where}: {key}: missing (a cluster needs name, "
                              "devices_per_node and an [intra] table)")  # fmt: skip
    for level in LEVELS:
        table = data.get(level)
        for key in ("alpha_s", "beta_bytes_per_s"):
            if isinstance(table, dict) and key not in table:
                raise ConfigError(f"{where}: {level}.{key}: missing")
    try:
        data = dict(data)
        inter = data.pop("inter", None)
        cluster = from_dict(ClusterConfig, data, "")
        if inter is not None:
            cluster = replace(cluster, inter=from_dict(LinkConfig, inter, "inter"))
    except ConfigValueError as e:
        raise ConfigError(f"{where}: {e.key}: {e.reason}") from None
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if cluster.inter is None and cluster.nodes != 1:
        raise ConfigError(f"{where}: inter: missing; a cluster of more than one node needs it")
    return cluster


def load_cluster(path: str | Path) -> ClusterConfig:
    """Read a cluster TOML file (configs/clusters/*.toml); one-line ConfigError on any mistake."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"cluster file not found: {path}")
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    return cluster_from_dict(data, str(path))


def from_link(
    link: Any,
    *,
    name: str = "this machine",
    devices_per_node: int | None = None,
    codec_s_per_byte: float | None = None,
    add_s_per_byte: float | None = None,
    host_cores: int | None = None,
) -> ClusterConfig:
    """The one-node cluster that a ``phalanx bench link`` calibration measured.

    ``link``: a ``LinkModel``, or the path of its ``link.json`` (or of its directory); its ring
    fit's alpha and beta are this model's intra-node link. ``host_cores``: the cores the
    calibrated processes shared (CPU ranks). A term given as None, or a probe the link lacks,
    is 0 and named in the cluster's ``assumed`` (never a silent 0)."""

    if not isinstance(link, LinkModel):
        try:
            link = LinkModel.load(link)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if link.world_size < 2 or math.isinf(link.beta_bytes_per_s):
        raise ConfigError(
            "link model: calibrated on one process, it measured no link; run "
            "`phalanx bench link --nproc 2 --json link.json` (or more processes)"
        )
    # Gloo moves every byte with the CPUs' copies, which the processes share: a ring step's p
    # concurrent messages of n/p take as long as one message of n. Its fitted (alpha, beta) per
    # message then mean a shared medium of p x beta, with alpha / p per message.
    shared = link.backend == "gloo"
    p = link.world_size
    intra = LinkConfig(
        alpha_s=link.alpha_s / p if shared else link.alpha_s,
        beta_bytes_per_s=link.beta_bytes_per_s * p if shared else link.beta_bytes_per_s,
    )
    # The probe's mean one-way time beyond what the link model gives the same message: the
    # software's per-message cost that back-to-back allreduces (the sweep) do not pay.
    probe = link.message_s
    overhead = 0.0 if probe is None else max(0.0, probe - intra.message_s(MESSAGE_PROBE_BYTES))
    missing = {
        "codec_s_per_byte": "not measured" if codec_s_per_byte is None else "",
        "add_s_per_byte": "not measured" if add_s_per_byte is None else "",
        # devices (NCCL) compute on their own: 0 is their value, not a default
        "host_cores_per_node": "not known" if shared and host_cores is None else "",
        "message_overhead_s": "the link has no message probe" if probe is None else "",
        "handoff_s": "the link has no hand-over probe" if link.handoff_s is None else "",
    }
    return ClusterConfig(
        name=name,
        nodes=1,
        devices_per_node=devices_per_node or link.world_size,
        intra=intra,
        shared_intra=shared,
        codec_s_per_byte=codec_s_per_byte or 0.0,
        add_s_per_byte=add_s_per_byte or 0.0,
        host_cores_per_node=(host_cores or 0) if shared else 0,
        message_overhead_s=overhead,
        handoff_s=link.handoff_s or 0.0,
        assumed=tuple(f"{key}: {why}: 0 assumed" for key, why in missing.items() if why),
        description=f"calibrated by phalanx bench link ({link.backend or 'unknown'} backend, "
        f"{link.world_size} ranks)",
    )


def _median_s_per_byte(work: Any, nbytes: int, repeats: int, device: Any) -> float:
    """Median seconds of ``work()`` over ``repeats`` runs after one warm-up (the device's
    queued work included), per byte of ``nbytes``."""
    import statistics
    import time

    import torch

    def sync() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for _ in range(repeats + 1):
        sync()
        start = time.perf_counter()
        work()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / nbytes


def measure_codec_s_per_byte(
    name: str = "fp16", nbytes: int = 8 * 2**20, repeats: int = 7, device: str = "cpu"
) -> float:
    """A cluster file's ``codec_s_per_byte``: encode + decode-add seconds per uncompressed
    gradient byte on this process (median of ``repeats`` after one warm-up)."""
    import torch

    codec = make_codec(name)
    if codec.wire_dtype is None:
        return 0.0
    values = torch.randn(nbytes // 4, device=device)
    target = torch.zeros_like(values)
    return _median_s_per_byte(
        lambda: codec.decode_add(codec.encode(values), target), 4 * values.numel(), repeats, device
    )


def measure_add_s_per_byte(
    nbytes: int = 25 * 2**20, repeats: int = 7, device: str = "cpu"
) -> float:
    """A cluster file's ``add_s_per_byte``: seconds per byte of ``t += message`` on float32 on
    this process, at the default bucket's 25 MiB (past the caches an add costs ~2x per byte)."""
    import torch

    total = torch.zeros(nbytes // 4, device=device)
    message = torch.ones_like(total)
    return _median_s_per_byte(lambda: total.add_(message), 4 * total.numel(), repeats, device)


def cluster_to_toml(cluster: ClusterConfig, comment: str = "") -> str:
    """The TOML text of ``cluster`` (``load_cluster`` reads it back unchanged); ``comment``
    lines go first, each prefixed with '# '."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)  # a TOML basic string: JSON's escapes are TOML's
        if isinstance(v, tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    lines = [f"# {line}".rstrip() for line in comment.splitlines()]
    for key in ("name", "description", "nodes", "devices_per_node", "shared_nic", "shared_intra",
                "compute_speed", "codec_s_per_byte", "add_s_per_byte", "message_overhead_s",
                "handoff_s", "host_cores_per_node", "collective_call_s", "collective_call_cpu_s",
                "compute_slowdown",
                "assumed"):  # fmt: skip
        lines.append(f"{key} = {value(getattr(cluster, key))}")
    for level in LEVELS:
        link = getattr(cluster, level)
        if link is not None:
            lines += ["", f"[{level}]", f"alpha_s = {value(link.alpha_s)}",
                      f"beta_bytes_per_s = {value(link.beta_bytes_per_s)}"]  # fmt: skip
    return "\n".join(lines) + "\n"
