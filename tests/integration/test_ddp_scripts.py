"""Scripts written for DDP first, and their phalanx ports, run as users run them (torchrun).

``scripts/ddp_resnet.py``: a small ResNet with BatchNorm, per-epoch train/eval switches, accuracy
from the outputs, ``no_sync`` accumulation, rank-0 periodic and final ``torch.save``
checkpoints (model, optimizer, scheduler), ``--resume`` and ``dist.destroy_process_group()``.
At worlds 2 and 3 one job trains it under DDP and under every strategy; each port equals DDP
tensor by tensor (parameters, BatchNorm buffers, momentum buffers, param groups and scheduler,
in every epoch's checkpoint and the final weights), and on every rank its training losses,
validation losses and accuracies equal DDP's (the validation runs through DDP's own forward,
as pytorch/examples' ImageNet script does: rank 0's buffers on every rank); a second job
resumes each from its epoch-2 checkpoint and ends where the uninterrupted run ended.
``scripts/ddp_lora.py``: a peft LoRA fine-tuning of a tiny GPT-2, equal to DDP under every
strategy, where peft and transformers are installed.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.users import SCRIPTS, assert_clean, torchrun

STRATEGIES = ["allreduce", "tree", "partitioned", "ps", "fsdp"]
EPOCHS, RESUME_AT = 4, 2
TOLERANCE = 1e-5  # fp32: phalanx's sums of gradients may be ordered unlike DDP's buckets'
# A resumed phalanx run sums every gradient in the uninterrupted run's order: bit for bit. DDP
# does not: its first iteration after construction uses its initial buckets, whose ring sums
# at world 3 are ordered unlike those of the rebuilt buckets it trained with (~3e-8 apart).
RESUMED_DDP_TOLERANCE = 1e-6


def differences(got: Any, expected: Any, where: str, atol: float) -> list[str]:
    """Every place where ``got`` differs from ``expected`` (nested dicts, lists and tensors;
    tensors within ``atol``, anything else equal), one line each."""
    if isinstance(expected, dict):
        if not isinstance(got, dict) or got.keys() != expected.keys():
            keys = sorted(map(str, got.keys())) if isinstance(got, dict) else type(got)
            return [f"{where}: keys {keys} != {sorted(map(str, expected.keys()))}"]
        return [d for k in expected for d in differences(got[k], expected[k], f"{where}.{k}", atol)]
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            return [f"{where}: {got!r} != {expected!r}"]
        return [d for i, (g, e) in enumerate(zip(got, expected)) for d in
                differences(g, e, f"{where}[{i}]", atol)]  # fmt: skip
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            return [f"{where}: {got!r} != tensor of shape {tuple(expected.shape)}"]
        if got.dtype != expected.dtype:
            return [f"{where}: dtype {got.dtype} != {expected.dtype}"]
        if not expected.is_floating_point():
            return [] if torch.equal(got, expected) else [f"{where}: {got} != {expected}"]
        off = (got - expected).abs().max().item() if got.numel() else 0.0
        return [] if off <= atol else [f"{where}: max abs difference {off:.3g} > {atol:g}"]
    if isinstance(expected, float) and isinstance(got, float):
        off = abs(got - expected)
        return [] if off <= atol else [f"{where}: {got!r} != {expected!r} ({off:.3g})"]
    return [] if got == expected else [f"{where}: {got!r} != {expected!r}"]


def report(problems: list[str], title: str, shown: int = 20) -> str:
    """How many differences of each kind (epochs, indices and optimizer slots folded), then
    the first ``shown`` in full."""
    kinds = Counter(re.sub(r"epoch \d+|\[\d+\]|\.\d+\b", "*", p.split(": ")[0]) for p in problems)
    summary = [f"{count} x {kind}" for kind, count in kinds.items()]
    return "\n".join([f"{title}: {len(problems)} differences", *summary, *problems[:shown]])


def ranks_json(folder: Path, name: str, world_size: int) -> list[Any]:
    """Every rank's ``NAME_rank_R.json``, in rank order."""
    return [json.loads((folder / f"{name}_rank_{r}.json").read_text()) for r in range(world_size)]


def run_outputs(folder: Path, world_size: int, epochs: range) -> dict[str, Any]:
    """What one run left: its checkpoints, final weights and every rank's metrics."""
    metrics = ranks_json(folder, "metrics", world_size)
    return {
        "checkpoints": {e: torch.load(folder / f"checkpoint_{e + 1}.pt") for e in epochs},
        "model_final": torch.load(folder / "model_final.pt"),
        "metrics": [{m["epoch"]: m for m in rank} for rank in metrics],
    }


def metrics_differences(got: Any, expected: Any, where: str, atol: float) -> list[str]:
    """Accuracies (from the outputs) equal; losses within ``atol``."""
    problems = []
    for rank, (ours, theirs) in enumerate(zip(got, expected)):
        for epoch, m in theirs.items():
            at = f"{where} rank {rank} epoch {epoch}"
            for key in ("train", "val", "global"):
                problems += differences(ours[epoch][key], m[key], f"{at} accuracy {key}", 0.0)
            for key in ("losses", "val_losses"):
                problems += differences(ours[epoch][key], m[key], f"{at} {key}", atol)
    return problems


def outputs_differences(got: Any, expected: Any, where: str, atol: float) -> list[str]:
    problems = differences(got["checkpoints"], expected["checkpoints"], f"{where} checkpoint", atol)
    problems += differences(got["model_final"], expected["model_final"], f"{where} final", atol)
    return problems + metrics_differences(got["metrics"], expected["metrics"], where, atol)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_ddp_resnet_script_ported_equals_ddp_and_resumes(tmp_path: Path, world_size: int) -> None:
    script, runs = SCRIPTS / "ddp_resnet.py", ["ddp", *STRATEGIES]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    epochs = ["--epochs", str(EPOCHS)]
    assert_clean(torchrun(script, str(full), *runs, *epochs, nproc=world_size, marker=str(full)))
    checkpoint = str(full / "{run}" / f"checkpoint_{RESUME_AT}.pt")
    done = torchrun(
        script, str(resumed), *runs, *epochs, "--resume", checkpoint, nproc=world_size,
        marker=str(resumed),
    )  # fmt: skip
    assert_clean(done)

    whole, rest = range(EPOCHS), range(RESUME_AT, EPOCHS)
    ddp = run_outputs(full / "ddp", world_size, whole)
    problems = []
    for run in runs:
        uninterrupted = run_outputs(full / run, world_size, whole)
        if run != "ddp":
            problems += outputs_differences(uninterrupted, ddp, f"{run} vs ddp", TOLERANCE)
        again = run_outputs(resumed / run, world_size, rest)
        uninterrupted["checkpoints"] = {e: uninterrupted["checkpoints"][e] for e in rest}
        uninterrupted["metrics"] = [{e: m[e] for e in rest} for m in uninterrupted["metrics"]]
        exact = 0.0 if run != "ddp" else RESUMED_DDP_TOLERANCE
        problems += outputs_differences(again, uninterrupted, f"{run} resumed", exact)
    if problems:
        pytest.fail(report(problems, f"world {world_size}"), pytrace=False)


@pytest.mark.timeout(300)
def test_a_ddp_lora_script_ported_equals_ddp(tmp_path: Path) -> None:
    """peft's LoRA on a tiny GPT-2 (every other parameter frozen), the model's own loss,
    ``no_sync`` accumulation, rank 0 saving the adapter with ``save_pretrained``."""
    pytest.importorskip("transformers", reason="the LoRA script needs transformers (phalanx[hf])")
    pytest.importorskip("peft", reason="the LoRA script needs peft")
    from safetensors.torch import load_file

    world_size, runs = 2, ["ddp", *STRATEGIES]
    done = torchrun(SCRIPTS / "ddp_lora.py", str(tmp_path), *runs, nproc=world_size)
    assert_clean(done)

    def outputs(run: str) -> dict[str, Any]:
        folder = tmp_path / run
        return {
            "adapter": load_file(folder / "adapter_model.safetensors"),
            "config": json.loads((folder / "adapter_config.json").read_text()),
            "losses": ranks_json(folder, "losses", world_size),
        }

    ddp, problems = outputs("ddp"), []
    for run in STRATEGIES:
        problems += differences(outputs(run), ddp, f"{run} vs ddp", TOLERANCE)
    if problems:
        pytest.fail(report(problems, "LoRA at world 2"), pytrace=False)
