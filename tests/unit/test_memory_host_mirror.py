"""The host mirror (F19 as the document builds it): fp32 masters, state and the optimizer's
arithmetic on the host, parameters back through forward pre-hooks. On the CPU the same code runs
with synchronous copies, so the parameters equal the optimizer alone bit for bit."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from phalanx.errors import ConfigError
from phalanx.memory.host_mirror import HostMirror
from tests.helpers.mirror import CPU, OPTIMIZERS, model, train


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_host_mirror_steps_like_the_optimizer(name: str) -> None:
    expected = train(net := model(), OPTIMIZERS[name](list(net.parameters())), 5, unused=True)
    net = model()
    opt = OPTIMIZERS[name](list(net.parameters()))
    mirror = HostMirror(opt, CPU, net, chunk_bytes=2000)  # several chunks
    got = train(net, opt, 5, unused=True)
    assert len(mirror.chunks) >= 3 and mirror.defers
    assert mirror.num_chunks_stepped >= 3 * 5 - 2  # the unused weight's chunk skips twice
    assert opt.state == {}  # the device optimizer keeps nothing; the host one everything
    assert len(mirror.host.state) == len(mirror.params)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with mirror.resident():  # the checkpoint view: the whole state in the device optimizer
        assert len(opt.state_dict()["state"]) == len(mirror.params)
    assert opt.state == {} and mirror.stored_bytes() > 0


def test_host_mirror_without_a_module_finishes_inside_step() -> None:
    """Sharded owners step tensors no forward reads (they send them right after step): the
    update is complete when step returns."""
    expected = train(net := model(), OPTIMIZERS["adamw"](list(net.parameters())), 3)
    net = model()
    opt = OPTIMIZERS["adamw"](list(net.parameters()))
    mirror = HostMirror(opt, CPU, None, chunk_bytes=2000)
    assert not mirror.defers
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    got = [p.detach().clone() for p in net.parameters()]  # read at once, no waiting
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bf16_parameters_keep_fp32_masters_across_checkpoints() -> None:
    """The master copy is what makes low-precision parameters train: the update accumulates in
    fp32 and only the copy back rounds. A resident() block (a checkpoint) keeps the masters."""
    torch.manual_seed(0)
    reference = model().to(torch.bfloat16)
    net = copy.deepcopy(reference)
    masters = [p.detach().float() for p in reference.parameters()]
    plain = torch.optim.AdamW(masters, lr=1e-3)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    mirror = HostMirror(opt, CPU, net, chunk_bytes=1000)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        for m in (reference, net):
            m.zero_grad()
            nn.functional.mse_loss(m(x.bfloat16()), y.bfloat16()).backward()
        for p, master in zip(reference.parameters(), masters):
            master.grad = p.grad.float()
        plain.step()
        with torch.no_grad():
            for p, master in zip(reference.parameters(), masters):
                p.copy_(master)
        opt.step()
        if step == 1:
            with mirror.resident():
                pass
    mirror.sync()
    for a, b, m, ref_master in zip(
        net.parameters(), reference.parameters(), mirror.masters, masters
    ):
        assert a.dtype == torch.bfloat16 and m.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(m, ref_master, rtol=0, atol=0)
    # lr 1e-3 steps are below bf16's resolution for most weights: without masters they stall
    assert any(not torch.equal(m.bfloat16().float(), m) for m in mirror.masters)


def test_lr_schedule_and_state_replacement_reach_the_host() -> None:
    net, reference_net = model(), model()
    opt = OPTIMIZERS["adamw"](list(net.parameters()))
    reference = OPTIMIZERS["adamw"](list(reference_net.parameters()))
    mirror = HostMirror(opt, CPU, net, chunk_bytes=1 << 20)  # before the scheduler, as the
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # Engine does
    reference_schedule = torch.optim.lr_scheduler.StepLR(reference, step_size=2, gamma=0.5)
    for _ in range(2):
        train(net, opt, 2)
        train(reference_net, reference, 2)
        schedule.step()
        reference_schedule.step()
        with mirror.resident():
            opt.load_state_dict(copy.deepcopy(reference.state_dict()))
    assert mirror.host.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for _ in range(2):  # a schedule change between steps, no resident() block: step copies it
        schedule.step()
        reference_schedule.step()
    train(net, opt, 2, seed=2)
    train(reference_net, reference, 2, seed=2)
    assert mirror.host.param_groups[0]["lr"] == reference.param_groups[0]["lr"] == 0.0025
    for a, b in zip(net.state_dict().values(), reference_net.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _FailingSGD(torch.optim.SGD):
    """Fails on its third host step (a chunk's arithmetic raising on the worker thread)."""

    calls = 0

    def step(self, closure: Callable | None = None) -> None:  # type: ignore[override]
        type(self).calls += 1
        if type(self).calls == 3:
            raise RuntimeError("host step failed")
        super().step(closure)


def test_an_error_on_the_host_reaches_the_next_forward_without_a_hang() -> None:
    net = model()
    opt = _FailingSGD(net.parameters(), lr=0.1)
    mirror = HostMirror(opt, CPU, net, chunk_bytes=2000)
    x = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="host step failed"):
        for _ in range(3):
            opt.zero_grad()
            net(x).sum().backward()
            opt.step()
        net(x)  # the failed chunk's layer waits for it and sees the error
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: torch.zeros(()))
    mirror._hooks.clear()


def test_an_optimizer_that_cannot_be_rebuilt_on_the_host_is_a_one_line_error() -> None:
    class Positional(torch.optim.SGD):
        def __init__(self, params: object, scale: float) -> None:
            super().__init__(params, lr=0.1 * scale)

    net = model()
    with pytest.raises(ConfigError, match=r"memory.optimizer: the host mirror builds a Positional"):
        HostMirror(Positional(net.parameters(), 1.0), CPU, net, chunk_bytes=1000)


def test_close_gives_the_optimizer_back() -> None:
    expected = train(net := model(), OPTIMIZERS["sgd momentum"](list(net.parameters())), 4)
    net = model()
    opt = OPTIMIZERS["sgd momentum"](list(net.parameters()))
    mirror = HostMirror(opt, CPU, net, chunk_bytes=2000)
    train(net, opt, 2)
    mirror.close()
    assert "step" not in opt.__dict__ and len(opt.state) == len(list(net.parameters()))
    got = train(net, opt, 2, seed=2)  # the device optimizer goes on from the host's state
    train(
        reference := model(), ref_opt := OPTIMIZERS["sgd momentum"](list(reference.parameters())), 2
    )
    expected = train(reference, ref_opt, 2, seed=2)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host, side stream)")
def test_host_mirror_on_cuda_steps_on_the_host_and_overlaps_forward() -> None:
    """On a GPU: masters and state in pinned host memory, the device optimizer holds nothing,
    the parameters (on the GPU) match the device optimizer to CPU-vs-GPU rounding."""
    device = torch.device("cuda")
    expected = train(
        net := model().to(device), OPTIMIZERS["adamw"](list(net.parameters())), 4, device=device
    )
    net = model().to(device)
    opt = OPTIMIZERS["adamw"](list(net.parameters()))
    mirror = HostMirror(opt, device, net, chunk_bytes=2000)
    got = train(net, opt, 4, device=device)
    assert mirror.defers and opt.state == {}
    assert all(m.is_pinned() and m.device.type == "cpu" for m in mirror.masters)
    assert all(p.device.type == "cuda" for p in net.parameters())
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    mirror.close()


def test_engine_checkpoint_with_the_host_mirror_resumes_exactly() -> None:
    """engine.state_dict() / load_state_dict() while the host holds the state: a run resumed
    from step 3 equals the run without interruption (and plain AdamW)."""
    import phalanx as px
    from phalanx.memory.manager import MemoryConfig, MemoryManager

    def engine(net: nn.Module) -> px.Engine:
        config = MemoryConfig(optimizer="mirror", optimizer_chunk_mb=0.002)
        return px.Engine(
            net,
            nn.functional.mse_loss,
            lambda ps: torch.optim.AdamW(ps, lr=1e-2),
            memory=MemoryManager.build([], config, CPU),
        )

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(5)]
    whole = engine(model())
    for x, y in batches:
        whole.step(x, y)
    first = engine(model())
    for x, y in batches[:3]:
        first.step(x, y)
    state = copy.deepcopy(first.state_dict())
    first.close()
    resumed = engine(model())
    resumed.load_state_dict(state)
    for x, y in batches[3:]:
        resumed.step(x, y)
    plain_net = model()
    plain = torch.optim.AdamW(plain_net.parameters(), lr=1e-2)
    for x, y in batches:
        plain.zero_grad()
        nn.functional.mse_loss(plain_net(x), y).backward()
        plain.step()
    for a, b, c in zip(
        whole.module.state_dict().values(),
        resumed.module.state_dict().values(),
        plain_net.state_dict().values(),
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_an_optimizer_already_on_the_host_of_a_gpu_run_is_left_alone() -> None:
    """ps servers on a GPU run step fp32 masters in host memory themselves: ``mirror`` does
    not wrap them again (no CUDA call is made to decide it)."""
    from phalanx.memory.manager import MemoryManager
    from phalanx.memory.plan import Plan

    manager = MemoryManager(
        Plan({}, 0, 0.0, 0), None, [], optimizer_place="mirror", device=torch.device("cuda")
    )
    opt = torch.optim.Adam([nn.Parameter(torch.zeros(4))], lr=0.1)  # host tensors
    assert manager.attach_optimizer(opt) is None and "step" not in opt.__dict__
