"""The optimizer-state mirror (F19): state in the spill file between steps, stepped chunk by
chunk, bitwise the same parameters as the optimizer alone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from phalanx.memory.stream import OptimizerMirror
from phalanx.memory.tiers import SpillFileTier
from tests.helpers.mirror import OPTIMIZERS, model, train


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_mirror_steps_like_the_optimizer(name: str, tmp_path) -> None:
    expected = train(net := model(), OPTIMIZERS[name](list(net.parameters())), 5, unused=True)
    net = model()
    opt = OPTIMIZERS[name](list(net.parameters()))
    with SpillFileTier(directory=tmp_path) as tier:
        mirror = OptimizerMirror(opt, tier, chunk_bytes=2000)  # several chunks
        got = train(net, opt, 5, unused=True)
        assert len(mirror._chunks) >= 3
        assert mirror.stored_bytes() > 0 and tier.bytes_read > 0
        # between steps no large state stays in memory
        resident = [
            v
            for s in opt.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.numel() > 1
        ]
        assert resident == []
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # the checkpoint view: every state back, equal to the plain optimizer's
        with mirror.resident():
            state = opt.state_dict()["state"]
            assert all(
                "exp_avg" in s or "momentum_buffer" in s or "sum" in s for s in state.values()
            )
        assert mirror.stored_bytes() > 0


def test_mirror_survives_state_replacement_and_lr_schedule(tmp_path) -> None:
    """An LR scheduler wraps the mirrored step; load_state_dict between steps replaces the
    tensors (the mirror packs them afresh)."""
    net = model()
    opt = OPTIMIZERS["adamw"](list(net.parameters()))
    reference_net = model()
    reference = OPTIMIZERS["adamw"](list(reference_net.parameters()))
    with SpillFileTier(directory=tmp_path) as tier:
        mirror = OptimizerMirror(opt, tier, chunk_bytes=1 << 20)  # before the scheduler, as
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # the Engine
        reference_schedule = torch.optim.lr_scheduler.StepLR(reference, step_size=2, gamma=0.5)
        for _ in range(2):
            train(net, opt, 2)
            train(reference_net, reference, 2)
            schedule.step()
            reference_schedule.step()
            with mirror.resident():
                opt.load_state_dict(copy.deepcopy(reference.state_dict()))
        assert opt.param_groups[0]["lr"] == reference.param_groups[0]["lr"] == 0.005
        for a, b in zip(net.parameters(), reference_net.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_mirror_refuses_a_closure(tmp_path) -> None:
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with SpillFileTier(directory=tmp_path) as tier:
        OptimizerMirror(opt, tier, chunk_bytes=1 << 20)
        with pytest.raises(ValueError, match="closure"):
            opt.step(lambda: torch.zeros(()))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host tier)")
def test_mirror_on_cuda_keeps_state_in_pinned_host_memory() -> None:
    """On a GPU the state lives in pinned host memory between steps (the pinned_host tier,
    side stream); parameters equal the optimizer alone and device memory holds no state."""
    from phalanx.memory.tiers import PinnedHostTier

    device = torch.device("cuda")
    expected = train(
        net := model().to(device), OPTIMIZERS["adamw"](list(net.parameters())), 4, device=device
    )
    net = model().to(device)
    opt = OPTIMIZERS["adamw"](list(net.parameters()))
    with PinnedHostTier(device) as tier:
        mirror = OptimizerMirror(opt, tier, chunk_bytes=2000)
        got = train(net, opt, 4, device=device)
        assert mirror.stored_bytes() > 0
        resident = [v for s in opt.state.values() for v in s.values() if v.numel() > 1]
        assert resident == []
        mirror.close()
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("place", ["host", "mirror"])
def test_engine_with_host_optimizer_on_a_tied_batchnorm_model_with_an_unused_layer(
    place: str, tmp_path
) -> None:
    """As a user writes it (no close(), defaults otherwise): tied embedding/head weights,
    BatchNorm, a layer forward never uses; parameters equal plain torch's AdamW, with the
    state in the spill file (host on a CPU) or stepped on the host mirror (masters, F19)."""
    import phalanx as px
    from phalanx.memory.manager import MemoryConfig, MemoryManager

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 32)
            self.bn = nn.BatchNorm1d(32)
            self.unused = nn.Linear(32, 32)
            self.head = nn.Linear(32, 50, bias=False)
            self.head.weight = self.emb.weight  # tied

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.bn(self.emb(x).mean(1)))

    torch.manual_seed(0)
    reference, net = Net(), Net()
    net.load_state_dict(reference.state_dict())
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    config = MemoryConfig(optimizer=place, optimizer_chunk_mb=0.001)
    engine = px.Engine(
        net,
        nn.functional.cross_entropy,
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        memory=MemoryManager.build([], config, torch.device("cpu")),
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randint(0, 50, (16, 5), generator=g), torch.randint(0, 50, (16,), generator=g)
        engine.step(x, y)
        plain.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        plain.step()
    assert engine.memory.mirror.stored_bytes() > 0
    kind = {"host": "OptimizerMirror", "mirror": "HostMirror"}[place]
    assert type(engine.memory.mirror).__name__ == kind
    for (name, a), b in zip(engine.module.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    # A checkpoint (the state read from the tier piece by piece where it lives there) resumes
    # an Engine without the memory manager: its optimizer state is plain AdamW's.
    from phalanx import checkpoint

    resident = [v for s in engine.optimizer.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0]  # fmt: skip
    assert (place == "host") == (engine.state.lazy_shards() is not None)
    checkpoint.save(tmp_path / "ckpt", 4, {"engine": engine})
    if place == "host":  # nothing was brought back into memory for the save
        assert resident == [] and engine.memory.mirror.num_resident == 0
    again = px.Engine(Net(), nn.functional.cross_entropy, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    checkpoint.restore(tmp_path / "ckpt", {"engine": again})
    got, expected = again.optimizer.state_dict(), plain.state_dict()
    assert got["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got["state"][index][key], value, rtol=0, atol=0)


def big_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 128), nn.Linear(128, 4))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_parameter_larger_than_a_chunk_is_stepped_in_pieces(name: str, tmp_path) -> None:
    """A 128 x 128 weight holds more state than a chunk: it steps in element ranges, with its
    group's hyperparameters; the parameters and the whole state (checkpoint view, mid-run and at
    the end) equal the plain optimizer's bit for bit."""
    net = big_model()
    plain = OPTIMIZERS[name](list(net.parameters()))
    train(net, plain, 2, unused=True)
    expected_mid = copy.deepcopy(plain.state_dict())
    expected = train(net, plain, 2, unused=True)
    net = big_model()
    opt = OPTIMIZERS[name](list(net.parameters()))
    with SpillFileTier(directory=tmp_path) as tier:
        mirror = OptimizerMirror(opt, tier, chunk_bytes=20_000)
        train(net, opt, 2, unused=True)
        pieces = [x for chunk in mirror._chunks for x in chunk if x.param is net[2].weight]
        assert len(pieces) >= 3 and all(x.view is not x.param for x in pieces)
        with mirror.resident():
            _assert_same_state(opt.state_dict(), expected_mid)
        got = train(net, opt, 2, unused=True)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        with mirror.resident():
            _assert_same_state(opt.state_dict(), plain.state_dict())
        mirror.close()
    assert set(opt.state) == set(net.parameters())  # keyed by the parameters again


def _assert_same_state(got: dict, expected: dict) -> None:
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        assert got["state"][index].keys() == state.keys(), index
        for key, value in state.items():
            torch.testing.assert_close(got["state"][index][key], value, rtol=0, atol=0)


def test_a_discarded_state_is_not_brought_back_and_the_optimizer_refuses_to_step(
    tmp_path,
) -> None:
    """``phalanx train`` ends by dropping a state kept in the tier (its last checkpoint holds
    it): closing then reads nothing back, and the optimizer says why it cannot step."""
    net = big_model()
    opt = OPTIMIZERS["adamw"](list(net.parameters()))
    with SpillFileTier(directory=tmp_path) as tier:
        mirror = OptimizerMirror(opt, tier, chunk_bytes=20_000)
        train(net, opt, 2)
        read = tier.bytes_read
        mirror.discard_state()
        mirror.close()
        assert tier.bytes_read == read and not opt.state
    with pytest.raises(RuntimeError, match="state was dropped when its run closed"):
        opt.step()
