"""``phalanx bench gpu --device cpu`` in this process at a tiny size (the GPU path but CUDA):
every contender with tokens/s, MFU, ratios and memory fields; the flop convention on GPT-2
small's sizes; bad flags refused in one line. (make test-cuda runs it on a GPU.)"""

from __future__ import annotations

import json

import pytest
import torch

from phalanx.bench.gpu import KINDS, GpuBenchConfig, flops_per_token
from phalanx.errors import ConfigError
from phalanx.models.gpt import GPT, GPT2_SMALL
from tests.helpers.cli import assert_one_line_error, run_main

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("fresh_world")]
TINY = ["--device", "cpu", "--num-layers", "2", "--width", "64", "--rounds", "2", "--steps", "2",
        "--warmup", "1"]  # fmt: skip


def test_a_tiny_cpu_run_reports_every_contender(tmp_path, capsys) -> None:
    out = tmp_path / "gpu.json"
    assert run_main(["bench", "gpu", *TINY, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows, meta = result["rows"], result["meta"]
    assert set(rows) == {kind + mode for kind in KINDS for mode in ("", "+compile")}
    for name, row in rows.items():
        assert row["tokens_per_s"] > 0 and len(row["seconds"]) == 2, name
        assert 0 < row["mfu"] < 1 and row["vs_plain"] > 0 and row["warmup_s"] > 0, name
        memory = ("held_mib", "step_peak_mib", "peak_mib", "max_allocated_mib")
        assert all(row[k] is None for k in memory), name  # no allocator to read on a CPU
        assert ("vs_eager" in row) == name.endswith("+compile"), name
        assert ("vs_fsdp2" in row) == (name.removesuffix("+compile") == "fsdp"), name
    assert rows["plain"]["vs_plain"] == 1.0
    assert meta["sizes"]["num_layers"] == 2 and meta["sizes"]["dim"] == 64 and meta["batch"] == 2
    assert meta["flop_convention"].startswith("6N + 12*L*H*Q*T") and meta["device"] == "cpu"
    printed = capsys.readouterr().out
    verdicts = [line for line in printed.splitlines() if line.startswith(("PASS: ", "MISS: "))]
    # allreduce and fsdp per mode, compiled vs eager per kind, the compiled plain loop's MFU
    assert len(verdicts) == 2 + 2 + len(KINDS) + 1, printed
    assert "plain+compile MFU" in printed and "tokens/s" in printed


def test_gpt2_small_and_its_flops_per_token() -> None:
    with torch.device("meta"):
        model = GPT(**GPT2_SMALL)
    assert sum(p.numel() for p in model.parameters()) == 124_439_808  # the head tied
    # 6N (N: the parameters but the 1024 x 768 position embedding) + 12 L H Q T
    expected = 6 * (124_439_808 - 1024 * 768) + 12 * 12 * 12 * 64 * 1024
    assert flops_per_token(model, GPT2_SMALL) == expected
    cfg = GpuBenchConfig()
    assert cfg.sizes() == GPT2_SMALL and cfg.batch() == 16 and cfg.peak_tflops == 989.0


def test_bad_flags(capsys) -> None:
    with pytest.raises(ConfigError, match="--width: 65 does not divide among 2 heads"):
        GpuBenchConfig(device="cpu", width=65).validate()
    with pytest.raises(ConfigError, match="--kinds: unknown 'dp'"):
        GpuBenchConfig(device="cpu", kinds=("plain", "dp")).validate()
    with pytest.raises(ConfigError, match="--steps: must be >= 1"):
        GpuBenchConfig(device="cpu", steps=0).validate()
    assert run_main(["bench", "gpu", "--device", "cpu", "--modes", "jit"]) == 2
    assert_one_line_error(capsys.readouterr().err, "--modes: unknown 'jit'")
    if not torch.cuda.is_available():
        assert run_main(["bench", "gpu"]) == 2
        assert_one_line_error(capsys.readouterr().err, "--device cuda:", "use --device cpu")
