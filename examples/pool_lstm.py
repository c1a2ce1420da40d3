"""The WorkerPool flow (F15) as you would type it in a Jupyter notebook, cell by cell.

Run it as a script (`python examples/pool_lstm.py`, ~20 s on 2 CPU cores) or paste the cells
into a notebook: the workers are fresh processes, so nothing here needs an
`if __name__ == "__main__":` guard, and functions defined here travel to them by value.
Raise STEPS for a better model; configs/char_lstm.toml trains a larger one with `phalanx train`.
"""

# %% Start one worker per device (2 CPU processes here; on a GPU machine: one per GPU).
import functools

import torch

import phalanx as px
from phalanx.data import DataConfig, load_source
from phalanx.data.sources import TEXT_VOCAB
from phalanx.models.layers import LSTMLayer
from phalanx.pool_training import PoolTrainConfig, PoolTrainer

STEPS, ROUNDS = 40, 3  # small settings: a quick demonstration

pool = px.WorkerPool(2)
print(pool)

# %% Data: Python's own help texts as (N, 64) character ids; the targets are shifted by one.
data = load_source(DataConfig(source="text", seq_len=64, val_fraction=0.1))
print(f"{len(data.x_train)} training sequences, vocabulary {data.num_classes}")


# %% The model-initialisation function is sent to every worker (defined here, sent by value).
def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Embedding(len(TEXT_VOCAB), 48),
        LSTMLayer(48, 128),  # nn.LSTM (batch first) returning only its outputs (B, T, H)
        torch.nn.Linear(128, len(TEXT_VOCAB)),
    )


trainer = PoolTrainer(
    pool,
    make_model,
    optimizer=functools.partial(torch.optim.Adam, lr=0.005),
    config=PoolTrainConfig(batch_size=32),
    name="lm",  # each worker keeps its replica in px.current_worker().state.lm
)
trainer.scatter(data.x_train, data.y_train)  # one contiguous block per worker
print(f"{trainer.num_params:,} parameters, {trainer.steps_per_epoch} steps per epoch")

# %% Train in rounds: the model lives in the workers between calls.
for round_ in range(ROUNDS):
    losses = trainer.train(STEPS)
    scores = trainer.evaluate(data.x_val, data.y_val)
    print(
        f"round {round_}: train loss {losses[-1]:.3f} | val loss {scores['loss']:.3f} | "
        f"perplexity {scores['perplexity']:.2f} | accuracy {scores['accuracy']:.3f}"
    )


# %% Anything else runs in the workers too, with the state they keep: sample some text.
def sample(prompt: str, length: int) -> str:
    model = px.current_worker().state.lm.engine.module.eval()
    ids = torch.tensor([[TEXT_VOCAB.index(c) for c in prompt]])
    with torch.no_grad():
        for _ in range(length):
            logits = model(ids)[0, -1]
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    model.train()
    return "".join(TEXT_VOCAB[i] for i in ids[0].tolist())


print(repr(pool.run_on(0, sample, "The ", 60)))

# %% Done: stop the workers (also happens at exit).
state = trainer.state_dict()  # rank 0's model on the CPU; every replica is identical
print(f"final model: {sum(t.numel() for t in state.values()):,} values")
pool.close()
