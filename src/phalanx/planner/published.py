"""Published scaling results, modelled from each paper's own figures, to validate the planner:
cluster, model (layer by layer, ``ARCHITECTURES``), per-device throughput, exchange, reported
points, assumptions and error bounds (tests/unit/test_planner_published.py). ``python -m
phalanx.planner.published`` prints the table of docs/planner.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from phalanx.planner.cluster import ClusterConfig, LinkConfig
from phalanx.planner.sim import ExchangeSetup, Simulator, StepResult
from phalanx.planner.step import StepProfile

MIB = 2**20
Layer = tuple[str, float, float]  # (name, parameters, multiply-adds per sample), forward order


# -- architectures ----------------------------------------------------------------------------
def _conv(cin: int, cout: int, k: int | tuple[int, int], hw: int, bias: bool = False,
          bn: bool = True) -> tuple[float, float]:  # fmt: skip
    """(parameters, multiply-adds) of a convolution with a square ``hw`` x ``hw`` output."""
    kh, kw = (k, k) if isinstance(k, int) else k
    params = kh * kw * cin * cout + (cout if bias else 0) + (2 * cout if bn else 0)
    return params, kh * kw * cin * cout * hw * hw


def _block(name: str, parts: list[tuple[float, float]]) -> Layer:
    return name, sum(p for p, _ in parts), sum(m for _, m in parts)


def _fc(name: str, fan_in: int, fan_out: int) -> Layer:
    return name, fan_in * fan_out + fan_out, fan_in * fan_out


def vgg16() -> list[Layer]:
    """VGG-16 (Simonyan & Zisserman): 13 convolutions with biases, 3 fully connected layers."""
    convs = [(3, 64, 224), (64, 64, 224), (64, 128, 112), (128, 128, 112), (128, 256, 56),
             (256, 256, 56), (256, 256, 56), (256, 512, 28), (512, 512, 28), (512, 512, 28),
             (512, 512, 14), (512, 512, 14), (512, 512, 14)]  # fmt: skip
    layers = [_block(f"conv{i + 1}", [_conv(a, b, 3, hw, bias=True, bn=False)])
              for i, (a, b, hw) in enumerate(convs)]  # fmt: skip
    return layers + [_fc("fc6", 25088, 4096), _fc("fc7", 4096, 4096), _fc("fc8", 4096, 1000)]


def resnet(blocks: tuple[int, int, int, int]) -> list[Layer]:
    """ResNet-50/101 (He et al.): bottleneck blocks (one layer each), batch norm."""
    layers = [_block("conv1", [_conv(3, 64, 7, 112)])]
    inplanes = 64
    for stage, (count, planes, hw) in enumerate(zip(blocks, (64, 128, 256, 512), (56, 28, 14, 7))):
        for i in range(count):
            parts = [_conv(inplanes, planes, 1, hw), _conv(planes, planes, 3, hw),
                     _conv(planes, 4 * planes, 1, hw)]  # fmt: skip
            if i == 0:
                parts.append(_conv(inplanes, 4 * planes, 1, hw))  # the projection shortcut
            layers.append(_block(f"layer{stage + 1}.{i}", parts))
            inplanes = 4 * planes
    return layers + [_fc("fc", 2048, 1000)]


def inception_v3() -> list[Layer]:
    """Inception V3 (Szegedy et al. 2016) without the auxiliary head: stem convolutions, then
    one layer per Mixed module (torchvision's layout: 23.8 M parameters, 5.7 G multiply-adds)."""
    layers = [_block(n, [_conv(a, b, k, hw)]) for n, a, b, k, hw in (
        ("Conv2d_1a", 3, 32, 3, 149), ("Conv2d_2a", 32, 32, 3, 147),
        ("Conv2d_2b", 32, 64, 3, 147), ("Conv2d_3b", 64, 80, 1, 73),
        ("Conv2d_4a", 80, 192, 3, 71))]  # fmt: skip

    def mixed_a(cin: int, pool: int) -> list[tuple[float, float]]:
        return [_conv(cin, 64, 1, 35), _conv(cin, 48, 1, 35), _conv(48, 64, 5, 35),
                _conv(cin, 64, 1, 35), _conv(64, 96, 3, 35), _conv(96, 96, 3, 35),
                _conv(cin, pool, 1, 35)]  # fmt: skip

    def mixed_c(c7: int) -> list[tuple[float, float]]:
        return [_conv(768, 192, 1, 17), _conv(768, c7, 1, 17), _conv(c7, c7, (1, 7), 17),
                _conv(c7, 192, (7, 1), 17), _conv(768, c7, 1, 17), _conv(c7, c7, (7, 1), 17),
                _conv(c7, c7, (1, 7), 17), _conv(c7, c7, (7, 1), 17),
                _conv(c7, 192, (1, 7), 17), _conv(768, 192, 1, 17)]  # fmt: skip

    def mixed_e(cin: int) -> list[tuple[float, float]]:
        return [_conv(cin, 320, 1, 8), _conv(cin, 384, 1, 8), _conv(384, 384, (1, 3), 8),
                _conv(384, 384, (3, 1), 8), _conv(cin, 448, 1, 8), _conv(448, 384, 3, 8),
                _conv(384, 384, (1, 3), 8), _conv(384, 384, (3, 1), 8),
                _conv(cin, 192, 1, 8)]  # fmt: skip

    layers += [_block("Mixed_5b", mixed_a(192, 32)), _block("Mixed_5c", mixed_a(256, 64)),
               _block("Mixed_5d", mixed_a(288, 64)),
               _block("Mixed_6a", [_conv(288, 384, 3, 17), _conv(288, 64, 1, 35),
                                   _conv(64, 96, 3, 35), _conv(96, 96, 3, 17)]),
               _block("Mixed_6b", mixed_c(128)), _block("Mixed_6c", mixed_c(160)),
               _block("Mixed_6d", mixed_c(160)), _block("Mixed_6e", mixed_c(192)),
               _block("Mixed_7a", [_conv(768, 192, 1, 17), _conv(192, 320, 3, 8),
                                   _conv(768, 192, 1, 17), _conv(192, 192, (1, 7), 17),
                                   _conv(192, 192, (7, 1), 17), _conv(192, 192, 3, 8)]),
               _block("Mixed_7b", mixed_e(1280)), _block("Mixed_7c", mixed_e(2048))]  # fmt: skip
    return layers + [_fc("fc", 2048, 1000)]


def googlenet() -> list[Layer]:
    """GoogLeNet (Szegedy et al. 2015, Table 1's module widths) with the two auxiliary
    classifiers it trains with (13.4 M parameters, as Caffe's bvlc_googlenet); an auxiliary
    head follows its module, as in Caffe's layer order, so backward reaches it first."""

    def conv(cin: int, cout: int, k: int, hw: int) -> tuple[float, float]:
        return _conv(cin, cout, k, hw, bias=True, bn=False)

    layers = [_block("conv1", [conv(3, 64, 7, 112)]),
              _block("conv2", [conv(64, 64, 1, 56), conv(64, 192, 3, 56)])]  # fmt: skip
    # (module, input channels, output size, (1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj))
    modules = [
        ("3a", 192, 28, (64, 96, 128, 16, 32, 32)),
        ("3b", 256, 28, (128, 128, 192, 32, 96, 64)),
        ("4a", 480, 14, (192, 96, 208, 16, 48, 64)),
        ("4b", 512, 14, (160, 112, 224, 24, 64, 64)),
        ("4c", 512, 14, (128, 128, 256, 24, 64, 64)),
        ("4d", 512, 14, (112, 144, 288, 32, 64, 64)),
        ("4e", 528, 14, (256, 160, 320, 32, 128, 128)),
        ("5a", 832, 7, (256, 160, 320, 32, 128, 128)),
        ("5b", 832, 7, (384, 192, 384, 48, 128, 128)),
    ]
    for name, cin, hw, (a, b_in, b, c_in, c, d) in modules:
        layers.append(_block(f"inception_{name}", [
            conv(cin, a, 1, hw), conv(cin, b_in, 1, hw), conv(b_in, b, 3, hw),
            conv(cin, c_in, 1, hw), conv(c_in, c, 5, hw), conv(cin, d, 1, hw)]))  # fmt: skip
        if name in ("4a", "4d"):
            out = a + b + c + d
            layers.append(_block(f"aux_{name}", [conv(out, 128, 1, 4), _fc("", 2048, 1024)[1:],
                                                 _fc("", 1024, 1000)[1:]]))  # fmt: skip
    return layers + [_fc("fc", 1024, 1000)]


def bert_large() -> list[Layer]:
    """BERT-large (Devlin et al.): embeddings, 24 encoder layers of hidden 1024, pooler and
    masked-LM head. The word embedding is tied to the head's decoder, so its gradient is
    complete only when backward reaches the embeddings: it is in the first layer here.
    Multiply-adds per token are nominal weights (encoder layers equal), not counted FLOPs."""
    hidden, vocab = 1024, 30522
    embeddings = vocab * hidden + 512 * hidden + 2 * hidden + 2 * hidden
    encoder = 4 * (hidden * hidden + hidden) + 2 * hidden * 4 * hidden + 4 * hidden + hidden
    encoder += 4 * hidden  # two layer norms
    layers: list[Layer] = [("embeddings", embeddings, 0.01 * encoder)]
    layers += [(f"encoder{i}", encoder, encoder) for i in range(24)]
    head = 2 * (hidden * hidden + hidden) + 2 * hidden + vocab
    return layers + [("pooler+mlm_head", head, 0.3 * encoder)]


ARCHITECTURES: dict[str, Callable[[], list[Layer]]] = {
    "googlenet": googlenet,
    "inception_v3": inception_v3,
    "resnet50": lambda: resnet((3, 4, 6, 3)),
    "resnet101": lambda: resnet((3, 4, 23, 3)),
    "vgg16": vgg16,
    "bert_large": bert_large,
}


# -- clusters ---------------------------------------------------------------------------------
def _sgd_s_per_byte(memory_bytes_per_s: float) -> float:
    """SGD with momentum is memory-bound: per gradient byte it reads the gradient, parameter
    and momentum and writes parameter and momentum, 5 bytes at the device's bandwidth."""
    return 5.0 / memory_bytes_per_s


Link = tuple[float, float]  # (alpha seconds, beta bytes per second)


def _cluster(name: str, nodes: int, per_node: int, intra: Link, inter: Link, codec_s: float,
             description: str) -> ClusterConfig:  # fmt: skip
    """``per_node`` devices on each of ``nodes`` nodes, one network card each."""
    return ClusterConfig(
        name=name,
        nodes=nodes,
        devices_per_node=per_node,
        intra=LinkConfig(alpha_s=intra[0], beta_bytes_per_s=intra[1]),
        inter=LinkConfig(alpha_s=inter[0], beta_bytes_per_s=inter[1]),
        shared_nic=True,
        codec_s_per_byte=codec_s,
        description=description,
    )


# fmt: off
CLUSTERS: dict[str, ClusterConfig] = {
    "parallel_cnn_titanx_fdr": _cluster(
        "parallel-CNN paper: 4 x Titan X per node, 56 Gb/s FDR InfiniBand",
        4, 4, (10e-6, 8e9), (25e-6, 6e9), 1.5e-11,
        "seed 001: GTX Titan X (Maxwell, 12 GB), 4 per server (2 x Xeon E5-2630), "
        "InfiniBand switch up to 56 Gb/s. Assumed: PCIe 3.0 within a node at 8 GB/s effective "
        "(peer to peer or through host memory); FDR 4x carries 6.8 GB/s of data, 6 GB/s "
        "effective with GeForce cards staging through host memory (no GPUDirect RDMA), hence "
        "the 25 us latency; one network card per node.",
    ),
    "horovod_p100_25gbe": _cluster(
        "Horovod benchmark: 4 x P100 per node, 25 GbE RoCE",
        128, 4, (5e-6, 10e9), (10e-6, 2.8e9), 7e-12,
        "Sergeev & Del Balso 2018 / horovod docs/benchmarks.rst: 128 servers with 4 "
        "Pascal GPUs each, RoCE-capable 25 Gbit/s network, NCCL 2 ring allreduce. Assumed: "
        "PCIe within a node at 10 GB/s; 25 GbE = 3.125 GB/s on the wire, 2.8 GB/s effective "
        "with RoCE; 10 us per ring step between nodes; one network card per node.",
    ),
    "ddp_v100_100g": _cluster(
        "PyTorch DDP paper: 8 x V100 (NVLink) per node, 100 Gb/s",
        32, 8, (5e-6, 100e9), (10e-6, 10e9), 5.5e-12,
        "Li et al., VLDB 2020: servers of 8 V100 GPUs joined by NVLink, Mellanox "
        "ConnectX-4 100 Gb/s NICs (as we recall the paper; its text was not available here); "
        "256 GPUs on a shared cluster whose network is not described. Assumed: NCCL's NVLink "
        "rings move 100 GB/s per direction; 100 Gb/s = 12.5 GB/s, 10 GB/s effective; one "
        "network card per server.",
    ),
}
# fmt: on


# -- the published setups ---------------------------------------------------------------------
@dataclass(frozen=True)
class Reported:
    """One published point: speed-up (or efficiency) at ``devices``; ``at_least``: the paper
    only claims a bound ("near-linear")."""

    devices: int
    metric: str  # "speedup" or "efficiency"
    value: float
    source: str
    at_least: bool = False


@dataclass(frozen=True)
class Published:
    """A published setup modelled from its own figures."""

    key: str
    title: str
    cluster: str  # key of CLUSTERS
    architecture: str  # key of ARCHITECTURES
    samples_per_s: float  # per device, at batch_size, on one device
    batch_size: int
    throughput_source: str
    setup: dict[str, Any]  # ExchangeSetup fields
    reported: tuple[Reported, ...]
    tolerance: float  # |predicted / reported - 1| stays within this (the unit test's bound)
    assumptions: tuple[str, ...]
    discrepancy: str  # where the model is off and why
    backward_per_forward: float = 2.0
    memory_bytes_per_s: float = 500e9  # the device's memory bandwidth (optimizer cost)
    extra: dict[str, Any] = field(default_factory=dict)

    def profile(self) -> StepProfile:
        layers = ARCHITECTURES[self.architecture]()
        return StepProfile.synthesize(
            samples_per_s=self.samples_per_s,
            batch_size=self.batch_size,
            layer_params=[p for _, p, _ in layers],
            layer_compute=[m for _, _, m in layers],
            backward_per_forward=self.backward_per_forward,
            optimizer_s_per_byte=_sgd_s_per_byte(self.memory_bytes_per_s),
            layer_names=[n for n, _, _ in layers],
            source=f"{self.title}: {self.samples_per_s:g} samples/s at batch {self.batch_size}",
        )


# per benchmark series: (the title's tail, cluster, memory bandwidth, exchange)
_SERIES = {
    # Horovod's docs/benchmarks.rst: its tensor fusion (5 ms cycle, 64 MB), NCCL's ring
    "horovod": ("512 P100, 25 GbE RoCE (Horovod)", "horovod_p100_25gbe", 732e9,
                {"strategy": "allreduce", "bucket_bytes": 64 * MIB, "fusion_cycle_s": 0.005}),
    # the PyTorch DDP paper (Li et al., VLDB 2020): DDP's 25 MB buckets over NCCL
    "ddp": ("256 V100, DDP with NCCL (PyTorch DDP paper)", "ddp_v100_100g", 900e9,
            {"strategy": "allreduce", "bucket_bytes": 25 * MIB}),
}  # fmt: skip


def _point(series: str, architecture: str, model: str, samples_per_s: float, batch: int,
           source: str, **rest: Any) -> Published:  # fmt: skip
    """A setup of one of the ``_SERIES`` benchmarks."""
    title, cluster, memory, setup = _SERIES[series]
    return Published(key=f"{series}_{architecture}", title=f"{model}, {title}", cluster=cluster,
                     architecture=architecture, samples_per_s=samples_per_s, batch_size=batch,
                     memory_bytes_per_s=memory, throughput_source=source, setup=setup,
                     **rest)  # fmt: skip


_GOOGLENET = Published(
    key="googlenet_titanx",
    title="GoogLeNet, Titan X, 56 Gb/s InfiniBand (parallel-CNN paper)",
    cluster="parallel_cnn_titanx_fdr",
    architecture="googlenet",
    samples_per_s=128 / 0.470,
    batch_size=128,
    backward_per_forward=340 / 130,
    memory_bytes_per_s=336e9,
    throughput_source="the paper's Table 1 (its per-iteration times) is not in the text we "
    "have; we take GoogLeNet at batch 128 on a Titan X from soumith/convnet-benchmarks: "
    "470 ms per step with cuDNN R4 (forward 130, backward 340)",
    setup={"strategy": "tree_ps", "bucket_bytes": 1},
    reported=(
        Reported(4, "speedup", 3.9, "seed 001, Fig. 5 and text"),
        Reported(16, "speedup", 13.5, "seed 001, Fig. 5 and text"),
    ),
    tolerance=0.10,
    assumptions=(
        "per-GPU step 470 ms at batch 128 (convnet-benchmarks, cuDNN R4 on Titan X), "
        "backward/forward = 340/130",
        "13.4 M parameters (GoogLeNet with its two auxiliary classifiers, as trained in "
        "the GoogLeNet paper and Caffe's bvlc_googlenet), float32 gradients",
        "the paper's scheme as it describes it (Fig. 1, sections 2.1-2.2): each layer's "
        "gradients summed up a binary tree to the parameter server (on rank 0's node) "
        "while backward runs, the server updates the layer, and every replica fetches "
        "the parameters from the server before its next iteration (schedule tree_ps)",
        "gradients exchanged layer by layer as backward produces them (bucket = one "
        "layer), as the paper overlaps them",
        "links: see the cluster (8 GB/s PCIe, 6 GB/s FDR with 25 us latency, one NIC)",
        "input fully hidden by the paper's multi-buffer preloading; SGD memory-bound",
    ),
    discrepancy="The tree reduction hides behind the 340 ms backward; what costs is the "
    "fetch: 15 copies of 53 MB leave the server, 12 of them through its node's one "
    "network card (about 0.11 s at 16 GPUs, 0.02 s over PCIe at 4). The model is "
    "slightly pessimistic at both points: how much of the fetch the paper overlaps, "
    "and its own per-iteration times (Table 1, missing from our copy), are unknown; "
    "the paper also names GPUs' differing compute times, which the model leaves out.",
)
# fmt: off
PUBLISHED: tuple[Published, ...] = (
    _GOOGLENET,
    replace(
        _GOOGLENET,
        key="googlenet_titanx_tree",
        title="GoogLeNet, Titan X, 56 Gb/s InfiniBand: phalanx's tree instead",
        throughput_source="as above",
        setup={"strategy": "tree", "bucket_bytes": 1},
        reported=(),
        tolerance=0.0,
        assumptions=(
            "as above, with phalanx's tree: the sum goes back down the tree, "
            "overlapped with backward, and every replica updates",
        ),
        discrepancy="A prediction, not a validation: what the paper's cluster would give "
        "with phalanx's tree (the sum returns down the tree during backward, no fetch).",
    ),
    _point(
        "horovod", "inception_v3", "Inception V3", 142.0, 64,
        "tf_cnn_benchmarks on a P100, batch 64, synthetic data: 142 images/s (TensorFlow's "
        "published benchmarks, DGX-1, May 2017)",
        reported=(Reported(512, "efficiency", 0.90, "horovod docs/benchmarks.rst"),),
        tolerance=0.10,
        assumptions=(
            "142 images/s per P100 at batch 64 (TensorFlow's benchmark of the same script)",
            "backward = 2 x forward; 23.8 M parameters, float32 gradients",
            "Horovod's tensor fusion: a 5 ms cycle, up to 64 MB per fused allreduce "
            "(its defaults), NCCL ring allreduce over all 512 GPUs",
            "links: see the cluster (10 GB/s PCIe, 2.8 GB/s RoCE with 10 us per step)",
        ),
        discrepancy="Optimistic: with a 300 ms backward and 95 MB of gradients the ring "
        "keeps up, so only the last fused message is exposed. Not modelled: Horovod's "
        "coordinator negotiates every cycle over MPI with all 512 ranks, TensorFlow's "
        "per-op overheads, and the slowest of 512 GPUs setting each step's pace.",
    ),
    _point(
        "horovod", "resnet101", "ResNet-101", 129.0, 64,
        "not published for ResNet-101 on a P100; interpolated between TensorFlow's ResNet-50 "
        "(219 images/s) and ResNet-152 (91.8) by time per image: ResNet-101's 33 bottleneck "
        "blocks sit midway between 16 and 50",
        reported=(Reported(512, "efficiency", 0.90, "horovod docs/benchmarks.rst"),),
        tolerance=0.10,
        assumptions=(
            "129 images/s per P100 at batch 64 (interpolated, see the source)",
            "backward = 2 x forward; 44.5 M parameters, float32 gradients",
            "Horovod's tensor fusion: 5 ms cycle, 64 MB buffer; NCCL ring over 512 GPUs",
            "links: see the cluster",
        ),
        discrepancy="As for Inception V3: the coordinator's negotiation, framework "
        "overheads and stragglers are not modelled.",
    ),
    _point(
        "horovod", "vgg16", "VGG-16", 154.0, 64,
        "tf_cnn_benchmarks on a P100, batch 64, synthetic data: 154 images/s (TensorFlow's "
        "published benchmarks)",
        reported=(Reported(512, "efficiency", 0.68, "horovod docs/benchmarks.rst"),),
        tolerance=0.15,
        assumptions=(
            "154 images/s per P100 at batch 64",
            "backward = 2 x forward; 138 M parameters (fc6 alone 103 M), float32 gradients",
            "Horovod's tensor fusion: 5 ms cycle, 64 MB buffer; NCCL ring over 512 GPUs",
            "links: see the cluster",
        ),
        discrepancy="VGG-16 is bandwidth-bound: 553 MB of gradients need 2 x 553 MB / "
        "2.8 GB/s = 0.39 s on the wire against a 0.28 s backward, so the result depends "
        "directly on the assumed effective RoCE bandwidth (and on how much of the fc "
        "layers' exchange overlaps the convolutions' backward).",
    ),
    _point(
        "ddp", "resnet50", "ResNet-50", 330.0, 32,
        "assumed: ResNet-50 in float32 at batch 32 on a V100 in PyTorch, about 330 images/s "
        "(the paper's own per-iteration latencies were not available)",
        reported=(Reported(256, "efficiency", 0.90, "abstract: 'near-linear scalability using "
                           "256 GPUs' (taken as at least 90%)", at_least=True),),
        tolerance=0.05,
        assumptions=(
            "330 images/s per V100 at batch 32, float32, backward = 2 x forward",
            "DDP's buckets: 25 MB, the first 1 MB (phalanx forms them the same way)",
            "256 GPUs as 32 servers like the 32-GPU cluster (the shared cluster's network is "
            "not described); links: see the cluster",
        ),
        discrepancy="The paper's figures (per-iteration latency at 1 to 256 GPUs) were not "
        "available offline, so only the abstract's claim is checked; a quantitative "
        "comparison needs Fig. 9/10's numbers.",
    ),
    _point(
        "ddp", "bert_large", "BERT-large", 50.0, 16,
        "assumed: BERT-large, sequence 128, float32, batch 16: about 50 sequences/s on a V100",
        reported=(),
        tolerance=0.0,
        assumptions=(
            "which BERT the paper trained, and how fast, is not known to us: BERT-large "
            "(336 M parameters) at 50 sequences/s per V100, batch 16, float32",
            "the tied word embedding (125 MB) is ready only at the end of backward",
        ),
        discrepancy="No reported number to compare with (prediction only).",
    ),
)
# fmt: on


# -- validation -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Validation:
    """One reported point next to its prediction."""

    published: Published
    reported: Reported
    predicted_speedup: float
    predicted_efficiency: float
    result: StepResult

    @property
    def predicted(self) -> float:
        if self.reported.metric == "speedup":
            return self.predicted_speedup
        return self.predicted_efficiency

    @property
    def error(self) -> float:
        """predicted / reported - 1 (for an 'at least' claim: 0 when the claim holds)."""
        ratio = self.predicted / self.reported.value - 1
        return min(0.0, ratio) if self.reported.at_least else ratio

    @property
    def within(self) -> bool:
        return abs(self.error) <= self.published.tolerance


def predict(published: Published, devices: int) -> tuple[StepResult, float]:
    """The simulated step at ``devices`` and its speed-up over one device."""
    profile = published.profile()
    cluster = CLUSTERS[published.cluster]
    setup = ExchangeSetup(**published.setup)
    result = Simulator(profile, cluster).run(devices, setup)
    speedup = result.samples_per_s * profile.compute_s / profile.batch_size
    return result, speedup


def validate(published: Published) -> list[Validation]:
    out = []
    for point in published.reported:
        result, speedup = predict(published, point.devices)
        out.append(Validation(published, point, speedup, speedup / point.devices, result))
    return out


def validation_table(extra_devices: dict[str, list[int]] | None = None) -> str:
    """The markdown table of docs/planner.md: reported next to predicted, for every point."""
    rows = ["| setup | N | reported | predicted | error | bound |", "|---|---|---|---|---|---|"]
    for published in PUBLISHED:
        for v in validate(published):
            fmt = _format_value(v.reported.metric)
            claim = ("≥ " if v.reported.at_least else "") + fmt(v.reported.value)
            rows.append(
                f"| {published.title} | {v.reported.devices} | {claim} | {fmt(v.predicted)} "
                f"| {v.error:+.0%} | ±{published.tolerance:.0%} |"
            )
        for n in (extra_devices or {}).get(published.key, []):
            _, speedup = predict(published, n)
            rows.append(
                f"| {published.title} | {n} | — | {speedup:.1f}x ({speedup / n:.0%}) | — | — |"
            )
    return "\n".join(rows)


def _format_value(metric: str) -> Callable[[float], str]:
    return (lambda x: f"{x:.1f}x") if metric == "speedup" else (lambda x: f"{x:.0%}")


EXTRA_DEVICES = {
    "googlenet_titanx_tree": [4, 16],
    "ddp_resnet50": [8, 32],
    "ddp_bert_large": [8, 32, 256],
}


def main() -> None:
    print(validation_table(EXTRA_DEVICES))


if __name__ == "__main__":
    main()
