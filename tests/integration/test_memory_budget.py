"""``[memory] budget_mb`` on models the project never saw, run as a user runs them: ``phalanx
train CONFIG`` in a subprocess, once unmanaged and once with a budget of 40% of the unmanaged
run's measured peak. The budgeted run prints its plan (``progress = false``), peaks at 0.7x the
unmanaged run or less (the process's resident high-water mark above its start, summary.json),
and trains the same parameters bit for bit. A budget no plan reaches is one line, exit 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from phalanx.commands.export import export_weights
from tests.integration.users import assert_clean, run

# Activation-dominated, as the held-out models: per-token MLP blocks (embedding,
# six "linear 128->2048, gelu, linear 2048->128, layernorm", a head) and a 6-block GPT.
MLP_BLOCK = (
    '  { type = "linear", in_features = 128, out_features = 2048 },\n'
    '  { type = "gelu" },\n'
    '  { type = "linear", in_features = 2048, out_features = 128 },\n'
    '  { type = "layernorm", normalized_shape = 128 },\n'
)
MODELS = {
    "mlp_per_token": (
        '[model]\nlayers = [\n  { type = "embedding", num_embeddings = 97, embedding_dim = 128 },\n'
        + MLP_BLOCK * 6
        + '  { type = "linear", in_features = 128, out_features = 97 },\n]\n'
        + "[data]\nbatch_size = 16\n"
    ),
    "transformer": (
        '[model]\nlayers = [\n  { type = "gpt_embedding", vocab_size = 97, dim = 192, '
        "max_seq_len = 256 },\n"
        + '  { type = "transformer_block", dim = 192, num_heads = 4 },\n' * 6
        + '  { type = "layernorm", normalized_shape = 192 },\n'
        + '  { type = "linear", in_features = 192, out_features = 97 },\n]\n'
        + "[data]\nbatch_size = 32\n"
    ),
}
# (root-level tables first: what follows them is the model's and the data's)
COMMON = """train = { steps = 3, progress = false }
optimizer = { name = "adam", lr = 0.001 }
checkpoint = { every = 0 }
"""
DATA = 'source = "text"\nseq_len = 256\nval_fraction = 0.01\n'


def _train(tmp_path: Path, config: Path, name: str, *sets: str) -> tuple[dict, str]:
    run_dir = tmp_path / name
    command = [sys.executable, "-m", "phalanx", "train", str(config), "--run-dir", str(run_dir)]
    for item in sets:
        command += ["--set", item]
    done = run(command, marker=str(tmp_path), timeout=280)
    assert_clean(done)
    return json.loads((run_dir / "summary.json").read_text()), done.output


def _weights(tmp_path: Path, name: str) -> dict[str, torch.Tensor]:
    """The run's final weights, as ``phalanx export`` writes them (in this process: a
    subprocess per export would only add torch's start-up)."""
    out = tmp_path / f"{name}.safetensors"
    export_weights(tmp_path / name, out)
    return load_file(out)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_budget_of_40_percent_lowers_the_measured_peak(tmp_path: Path, model: str) -> None:
    config = tmp_path / f"{model}.toml"
    config.write_text(COMMON + MODELS[model] + DATA)
    unmanaged, _ = _train(tmp_path, config, "none")
    peak = unmanaged["memory_peak_mb"]
    assert peak > 100, unmanaged  # activation-dominated: the step holds hundreds of MiB
    budget = round(0.4 * peak, 1)
    managed, printed = _train(tmp_path, config, "budget", f"memory.budget_mb={budget}")
    assert "memory plan: predicted peak" in printed and f"budget {budget:.1f} MiB" in printed
    assert "memory: measured peak" in printed, printed[-2000:]
    assert managed["memory_budget_mb"] == budget
    assert managed["memory_peak_mb"] <= 0.7 * peak, (managed, peak, printed[-3000:])
    expected, got = _weights(tmp_path, "none"), _weights(tmp_path, "budget")
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key  # bit for bit
    if model != "mlp_per_token":  # (one model suffices for the refusal)
        return
    below = run(
        [sys.executable, "-m", "phalanx", "train", str(config), "--set", "memory.budget_mb=8"],
        marker=str(tmp_path),
    )
    assert below.returncode == 2, below.output[-2000:]
    lines = [line for line in below.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "memory.budget_mb: 8.0 MiB cannot be met" in lines[0], lines


# Optimizer state dominates: 8.4 M parameters (33.6 MB), Adam's state twice that.
STATE_MODEL = """train = { steps = 3, progress = false }
optimizer = { name = "adam", lr = 0.0001 }
checkpoint = { every = 0 }
[model]
layers = [
  { type = "flatten" },
  { type = "linear", in_features = 64, out_features = 2048 },
  { type = "relu" },
  { type = "linear", in_features = 2048, out_features = 2048 },
  { type = "relu" },
  { type = "linear", in_features = 2048, out_features = 2048 },
  { type = "relu" },
  { type = "linear", in_features = 2048, out_features = 10 },
]
[data]
source = "digits"
batch_size = 64
"""


@pytest.mark.timeout(300)
def test_the_host_optimizer_lowers_the_measured_peak_by_its_state(tmp_path: Path) -> None:
    """F19 as the budget measures it: ``memory.optimizer = "host"`` (the state in the spill
    file between steps) peaks lower than the optimizer on the device by at least the state's
    size (its final checkpoint included), with the same parameters."""
    config = tmp_path / "state.toml"
    config.write_text(STATE_MODEL)
    device, _ = _train(tmp_path, config, "device")
    # 4 MiB chunks: what is in flight (a chunk read ahead, one stepping, two being written) is
    # then small beside this model's 64 MiB of state (16 MiB chunks suit larger models)
    sets = ('memory.optimizer="host"', "memory.optimizer_chunk_mb=4")
    host, printed = _train(tmp_path, config, "host", *sets)
    assert "optimizer state: in the tier between steps" in printed
    params = 64 * 2048 + 2048 + 2 * (2048 * 2048 + 2048) + 2048 * 10 + 10
    state_mb = 2 * 4 * params / 2**20  # Adam: two fp32 moments per parameter
    drop = device["memory_peak_mb"] - host["memory_peak_mb"]
    assert drop >= state_mb, (device, host, state_mb)
    expected, got = _weights(tmp_path, "device"), _weights(tmp_path, "host")
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
