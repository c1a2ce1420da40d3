"""Scaled fp16/bf16 messages (F13): round-trip error bounds, no new inf/NaN, half the bytes."""

from __future__ import annotations

import pytest
import torch

from phalanx.errors import ConfigError
from phalanx.exchange.compression import make_codec

# Relative precision of one rounding: fp16 keeps 11 significant bits, bf16 8.
UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(4096, generator=g)
    return {
        "random": normal,
        "tiny": normal * 1e-8,  # would flush to zero in fp16 without scaling
        "huge": normal * 1e6,  # would overflow fp16 (max 65504) without scaling
        "mixed": torch.cat([normal[:2048] * 1e-6, normal[2048:] * 1e3]),
    }


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("case", ["random", "tiny", "huge"])
def test_round_trip_relative_error(name: str, case: str) -> None:
    codec = make_codec(name)
    t = _cases()[case]
    back = codec.decode(codec.encode(t), t)
    assert back.dtype == t.dtype and torch.isfinite(back).all()
    relative = ((back - t).abs() / t.abs()).max().item()
    assert relative <= UNIT_ROUNDOFF[name], f"{name}/{case}: {relative}"


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_mixed_scales_error_is_bounded_by_the_largest_value(name: str) -> None:
    codec = make_codec(name)
    t = _cases()["mixed"]
    back = codec.decode(codec.encode(t), t)
    # One scale per message: small values lose bits relative to the largest, never overflow.
    assert ((back - t).abs().max() / t.abs().max()).item() <= UNIT_ROUNDOFF[name]
    large = t.abs() > 1.0
    assert ((back - t).abs() / t.abs())[large].max().item() <= UNIT_ROUNDOFF[name]


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_messages_take_half_the_bytes(name: str) -> None:
    codec = make_codec(name)
    t = torch.randn(10_000)
    assert codec.encode(t).nbytes == t.nbytes // 2 + 4  # payload + one float32 scale


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_no_new_inf_or_nan_and_existing_ones_are_reported(name: str) -> None:
    codec = make_codec(name)
    extreme = torch.tensor([3.0e38, -3.0e38, 1e-38, 0.0])
    assert torch.isfinite(codec.decode(codec.encode(extreme), extreme)).all()
    assert codec.num_nonfinite == 0
    bad = torch.tensor([1.0, float("inf"), float("nan"), -2.0])
    back = codec.decode(codec.encode(bad), bad)
    assert codec.num_nonfinite == 1
    assert back[1] == float("inf") and torch.isnan(back[2])  # passed on, not hidden
    torch.testing.assert_close(back[[0, 3]], bad[[0, 3]], rtol=UNIT_ROUNDOFF[name], atol=0)


def test_zeros_round_trip_exactly() -> None:
    codec = make_codec("fp16")
    z = torch.zeros(8)
    assert torch.equal(codec.decode(codec.encode(z), z), z)


def test_unknown_compression_lists_allowed() -> None:
    with pytest.raises(ConfigError, match="unknown compression 'int8'; known: bf16, fp16, none"):
        make_codec("int8")


def test_codec_kernel_timing_tool_runs(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tools/bench_codec_kernels.py backs the kernel choices in docs/benchmarks.md."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "bench_codec_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_codec_kernels", path)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.setattr(sys, "argv", ["bench_codec_kernels", "--numel", "1000", "--reps", "1"])
    threads = torch.get_num_threads()
    try:
        tool.main()
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + len(tool.rows(10)) and all(line.endswith(" ms") for line in lines[1:])
