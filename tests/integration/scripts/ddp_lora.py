"""A LoRA fine-tuning script with peft, written for DDP first, and its phalanx port, which
changes only the lines the port guide names (marked ``# port``). Needs transformers and peft.

Usage (under torchrun): ddp_lora.py OUT_DIR RUN [RUN ...]

Each RUN is ``ddp`` (torch's DistributedDataParallel; first, as it joins the process group
itself) or a phalanx strategy. A GPT-2 built from a tiny config gets LoRA adapters on its
attention projections (every other parameter frozen), trains with the model's own loss and
AdamW, two micro-batches per update (all but the last under ``no_sync``); rank 0 saves the adapter
with ``save_pretrained`` to ``OUT_DIR/RUN/`` (the port passes it the weights every rank
gathered with ``engine.full_state_dict()``, as Hugging Face's FSDP users do), every rank its
losses to ``OUT_DIR/RUN/losses_rank_R.json``. The job ends with
``dist.destroy_process_group()``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import GPT2Config, GPT2LMHeadModel

import phalanx as px

VOCAB, SEQ = 64, 16
UPDATES, BATCH, ACCUM = 4, 4, 2  # per rank: micro-batch size, micro-batches per update


def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    """This rank's micro-batch: counting sequences (x, x + k, x + 2k, ...) to learn."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB
    return {"input_ids": ids, "labels": ids}


def main(run: str, out: Path) -> None:
    ddp = run == "ddp"
    if ddp:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        rank = px.init().rank  # port
    out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True,
        task_type="CAUSAL_LM",
    )  # fmt: skip
    model = get_peft_model(GPT2LMHeadModel(config), lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.01)
    if ddp:
        model = DDP(model)
    else:  # port
        engine = px.Engine(model, optimizer=optimizer, exchange=run)

    def forward_backward(inputs: dict[str, torch.Tensor]) -> float:
        loss = model(**inputs).loss
        (loss / ACCUM).backward()
        return loss.item()

    model.train()
    losses = []
    for update in range(UPDATES):
        micro = [batch(update * ACCUM + i, rank) for i in range(ACCUM)]
        if ddp:  # as torch's no_sync docs: all but the last micro-batch accumulate locally
            with model.no_sync():
                losses += [forward_backward(inputs) for inputs in micro[:-1]]
            losses.append(forward_backward(micro[-1]))  # this backward all-reduces
            optimizer.step()
            optimizer.zero_grad()
        else:  # port
            with engine.no_sync():
                losses += [engine.step(**inputs).item() for inputs in micro[:-1]]
            losses.append(engine.step(**micro[-1]).item())

    # the adapter only (adapter_config.json, adapter_model.safetensors), saved by rank 0
    if ddp:
        if rank == 0:
            model.module.save_pretrained(out)
    else:  # port: every rank gathers the weights (under fsdp each holds rows), rank 0 saves
        weights = engine.full_state_dict()
        if rank == 0:
            engine.module.save_pretrained(out, state_dict=weights)
    (out / f"losses_rank_{rank}.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args()
    for run in args.runs:
        main(run, args.out / run)
    dist.destroy_process_group()
