"""The char-LSTM on Python's own help texts: the ``text`` source, the WorkerPool training flow
(2 and 3 workers equal one process on the same global batches), validation loss and perplexity
in the trainer, and ``phalanx train configs/char_lstm.toml --nproc 2`` end to end.

The single-process reference is plain torch in this (controller) process.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.data import DataConfig, load_source
from phalanx.data.sources import TEXT_VOCAB
from phalanx.errors import ConfigError
from phalanx.models.layers import build_layers
from phalanx.pool_training import PoolTrainConfig, PoolTrainer, block_order, split_blocks

ROOT = Path(__file__).resolve().parents[2]
SEQ_LEN, BATCH, STEPS = 16, 4, 7  # BATCH per worker; 7 steps cross an epoch boundary
LAYERS = [
    {"type": "embedding", "num_embeddings": len(TEXT_VOCAB), "embedding_dim": 8},
    {"type": "lstm", "input_size": 8, "hidden_size": 16},
    {"type": "linear", "in_features": 16, "out_features": len(TEXT_VOCAB)},
]
SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)


@pytest.fixture(scope="module")
def text():
    return load_source(DataConfig(source="text", seq_len=SEQ_LEN, val_fraction=0.1))


def make_model() -> torch.nn.Module:
    return build_layers(LAYERS)


def decode(ids: torch.Tensor) -> str:
    return "".join(TEXT_VOCAB[i] for i in ids.tolist())


# -- the text source ----------------------------------------------------------------------------
def test_text_source_is_next_character_prediction_on_python_help(text):
    from pydoc_data.topics import topics

    assert text.num_classes == 97 and text.x_train.dtype == text.y_train.dtype == torch.int64
    assert text.x_train.shape[1:] == text.y_train.shape[1:] == (SEQ_LEN,)
    assert torch.equal(text.x_train[:, 1:], text.y_train[:, :-1])  # targets shifted by one
    assert torch.equal(text.x_val[:, 1:], text.y_val[:, :-1])
    total = len(text.x_train) + len(text.x_val)
    corpus_chars = sum(len(t) for t in topics.values())
    assert total == (corpus_chars + 2 * (len(topics) - 1) - 1) // SEQ_LEN
    assert len(text.x_val) == round(total * 0.1)
    assert decode(text.x_train[0]) + decode(text.y_train[0])[-1] in "\n\n".join(
        topics[k] for k in sorted(topics)
    )
    again = load_source(DataConfig(source="text", seq_len=SEQ_LEN, val_fraction=0.1, seed=9))
    assert torch.equal(again.x_val, text.x_val)  # the split is fixed


def test_text_source_rejects_a_bad_seq_len():
    with pytest.raises(ConfigError, match="seq_len: must be >= 1, got 0"):
        px.load_config(None, ["data.source=text", "data.seq_len=0"])


# -- WorkerPool training flow == one process ----------------------------------------------------
def reference_run(data, world: int) -> tuple[list[float], dict, torch.nn.Module]:
    """Plain torch on the global batches the workers see together: step s of epoch e takes the
    same positions of block_order(e) in every block, concatenated in rank order."""
    config = PoolTrainConfig(batch_size=BATCH, seed=3)
    blocks = split_blocks(data[0], data[1], world)
    size = len(blocks[0][0])
    per_epoch = size // BATCH
    torch.manual_seed(config.seed)
    model = make_model()
    optimizer = SGD(model.parameters())
    losses = []
    for step in range(STEPS):
        epoch, position = divmod(step, per_epoch)
        index = block_order(size, config, epoch)[position * BATCH : (position + 1) * BATCH]
        x = torch.cat([bx[index] for bx, _ in blocks])
        y = torch.cat([by[index] for _, by in blocks])
        optimizer.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, copy.deepcopy(model.state_dict()), model


def replica_parameters(name: str) -> torch.Tensor:
    module = getattr(px.current_worker().state, name).engine.module
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def trainer_evaluate(name: str, x_val: torch.Tensor, y_val: torch.Tensor) -> dict[str, float]:
    """phalanx.trainer.evaluate in a worker: strided shards, sums all-reduced over the group."""
    from phalanx.data.sources import Dataset
    from phalanx.trainer import evaluate

    w = px.current_worker()
    data = Dataset(
        x_train=x_val[:0], y_train=y_val[:0], x_val=x_val, y_val=y_val, num_classes=len(TEXT_VOCAB)
    )
    return evaluate(getattr(w.state, name).engine.module, data, w.context, batch_size=5)


@pytest.mark.parametrize("world", [2, 3])
def test_pool_training_equals_one_process_on_the_same_global_batches(text, world):
    # Enough windows for 5 steps per epoch per worker; 7 steps cross into epoch 1 (reshuffled).
    n = world * BATCH * 5 + (world - 1)  # + a remainder that split_blocks must drop
    data = (text.x_train[:n], text.y_train[:n])
    ref_losses, ref_state, ref_model = reference_run(data, world)
    with px.WorkerPool(world) as pool:
        trainer = PoolTrainer(
            pool, make_model, optimizer=SGD, config=PoolTrainConfig(batch_size=BATCH, seed=3)
        )
        assert trainer.scatter(*data) == BATCH * 5 and trainer.steps_per_epoch == 5
        losses = trainer.train(3) + trainer.train(STEPS - 3)  # state persists between calls
        state = trainer.state_dict()
        replicas = pool.run(replica_parameters, trainer.name)
        x_val, y_val = text.x_val[:23], text.y_val[:23]
        scores = trainer.evaluate(x_val, y_val, batch_size=4)
        trainer_scores = pool.run(trainer_evaluate, trainer.name, x_val, y_val)
        trainer.close()
        assert pool.run(lambda: sorted(vars(px.current_worker().state))) == [[]] * world
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert losses[-1] < losses[0]  # it learns
    assert state.keys() == ref_state.keys()
    for key in state:
        torch.testing.assert_close(state[key], ref_state[key], rtol=1e-5, atol=1e-6)
    for other in replicas[1:]:
        assert torch.equal(other, replicas[0])  # identical updates on every worker
    with torch.no_grad():
        out = ref_model(x_val)
        logits, target = out.reshape(-1, out.shape[-1]), y_val.reshape(-1)
        ref_loss = float(F.cross_entropy(logits, target))
        ref_accuracy = float((logits.argmax(-1) == target).float().mean())
    assert scores["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert scores["accuracy"] == pytest.approx(ref_accuracy)
    assert scores["perplexity"] == pytest.approx(math.exp(ref_loss), rel=1e-5)
    for result in trainer_scores:  # every rank gets the all-reduced whole-set numbers
        assert result["val_loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert result["val_accuracy"] == pytest.approx(ref_accuracy)
        assert result["val_perplexity"] == pytest.approx(math.exp(ref_loss), rel=1e-5)


# -- the config end to end ----------------------------------------------------------------------
def test_char_lstm_config_trains_on_two_processes_and_reports_perplexity(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "phalanx", "train", "configs/char_lstm.toml", "--nproc", "2"]
    command += ["--set", "train.steps=3", "--set", "train.progress=false"]
    command += ["--run-dir", str(run_dir)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert summary["val_perplexity"] == pytest.approx(math.exp(summary["val_loss"]))
    assert 1.0 < summary["val_perplexity"] < len(TEXT_VOCAB) * 1.5  # near uniform after 3 steps
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and last["val_loss"] == summary["val_loss"]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("final validation accuracy") and "| perplexity " in line
    assert f"| loss {summary['val_loss']:.4f} |" in line


# -- phalanx bench rnn --------------------------------------------------------------------------
def test_bench_rnn_runs_every_contender_and_writes_json(tmp_path, capsys):
    """A real but tiny run (one pool of 2): every number positive and finite. No timing checks."""
    from phalanx.cli import main

    path = tmp_path / "out" / "rnn.json"
    argv = ["bench", "rnn", "--nproc", "2", "--steps", "1", "--rounds", "2", "--warmup", "0"]
    argv += ["--embed", "8", "--hidden", "16", "--seq-len", "4", "--json", str(path)]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "phalanx bench rnn" in printed and "tokens/s" in printed and "vs DDP" in printed
    result = json.loads(path.read_text(encoding="utf-8"))
    contenders = result["contenders"]
    assert list(contenders) == ["single", "ddp", "phalanx", "pool"]
    assert result["meta"]["devices"] == ["cpu", "cpu"] and result["meta"]["params"] > 0
    for name, c in contenders.items():
        assert c["processes"] == (1 if name == "single" else 2)
        assert len(c["tokens_per_s"]) == 2 and all(v > 0 for v in c["tokens_per_s"])
        assert math.isfinite(c["median_tokens_per_s"])
        if name != "single":
            assert c["median_speedup"] > 0
    assert "median_vs_ddp" not in contenders["ddp"] and contenders["pool"]["median_vs_ddp"] > 0


def test_bench_rnn_summary_takes_medians_of_per_round_ratios():
    from phalanx.bench.rnn import CONTENDERS, RnnBenchConfig, summarize

    cfg = RnnBenchConfig(nproc=2, batch_size=2, seq_len=5, steps=10, rounds=3)
    seconds = {"single": [1.0, 1.0, 2.0], "ddp": [1.0, 2.0, 2.0], "phalanx": [0.5, 2.0, 1.0],
               "pool": [1.0, 1.0, 1.0]}  # fmt: skip
    rounds = [{n: {"seconds": seconds[n][i], "exchange_s": 0.0} for n in CONTENDERS} for i in
              range(3)]  # fmt: skip
    out = summarize(rounds, cfg)
    assert out["single"]["tokens_per_s"] == [100.0, 100.0, 50.0]  # 2 x 5 x 10 tokens
    assert out["ddp"]["tokens_per_s"] == [200.0, 100.0, 100.0]
    assert out["ddp"]["median_speedup"] == 2.0  # ratios 2, 1, 2
    assert out["phalanx"]["vs_ddp"] == [2.0, 1.0, 2.0] and out["phalanx"]["median_vs_ddp"] == 2.0


def test_bench_rnn_bad_flags_are_one_line_errors(capsys):
    from phalanx.cli import main

    for flag, value in (("--nproc", "0"), ("--steps", "0"), ("--warmup", "-1")):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "rnn", flag, value])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("phalanx: error: ") and flag in err and "\n" not in err
