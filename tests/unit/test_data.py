"""Built-in data (fixed split) and ShardedBatches (disjoint, deterministic, resumable)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from phalanx.data import DataConfig, ShardedBatches, load_source
from phalanx.data.sources import digits_arrays, split
from phalanx.errors import DataError

N = 50  # samples in the synthetic set; x[i] == y[i] == i, so a batch shows which samples it holds


def ids_data(n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 3), torch.arange(n)


def loader(batch_size: int, rank: int = 0, world_size: int = 1, **kwargs) -> ShardedBatches:
    x, y = ids_data()
    return ShardedBatches(x, y, batch_size, rank, world_size, **kwargs)


def take(batches: ShardedBatches, steps: int) -> list[list[int]]:
    """The sample ids of the next ``steps`` batches (checking that x and y stay paired)."""
    out = []
    for _ in range(steps):
        x, y = batches.next()
        assert torch.equal(x[:, 0].long(), y) and torch.equal(x[:, 2].long(), y)
        out.append(y.tolist())
    return out


# -- sources -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    return load_source(DataConfig(seed=0))


def test_digits_shapes_and_ranges(digits):
    assert digits.x_train.shape[1:] == (1, 8, 8) and digits.x_train.dtype == torch.float32
    assert digits.y_train.dtype == torch.int64 and digits.num_classes == 10
    assert len(digits.x_train) + len(digits.x_val) == 1797
    assert len(digits.x_val) == round(1797 * 0.2)
    assert 0.0 <= float(digits.x_train.min()) and float(digits.x_train.max()) <= 1.0
    assert set(digits.y_val.tolist()) == set(range(10))


def test_digits_split_does_not_depend_on_data_seed(digits):
    other = load_source(DataConfig(seed=123))
    assert torch.equal(digits.x_val, other.x_val) and torch.equal(digits.y_val, other.y_val)
    assert torch.equal(digits.x_train, other.x_train)


def test_digits_val_fraction_sets_the_split_size():
    data = load_source(DataConfig(val_fraction=0.5))
    assert len(data.x_val) == round(1797 * 0.5)


def test_split_is_disjoint_covering_and_fixed():
    x = np.arange(100, dtype=np.float32)[:, None]
    y = np.arange(100, dtype=np.int64)
    first = split(x, y, 0.3, num_classes=100)
    train, val = set(first.y_train.tolist()), set(first.y_val.tolist())
    assert len(val) == 30 and len(train) == 70
    assert not train & val and train | val == set(range(100))
    assert torch.equal(first.x_val[:, 0].long(), first.y_val)  # x and y stay paired
    again = split(x, y, 0.3, num_classes=100)
    assert torch.equal(first.y_val, again.y_val)
    assert first.y_val.tolist() != sorted(first.y_val.tolist())  # shuffled, not a prefix


def test_digits_train_and_val_are_disjoint(digits):
    # the digits set has a few duplicate images, so compare by (image, label) multiset counts:
    # the split must partition the original 1797 samples exactly
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images, target = digits_arrays()  # read without importing scikit-learn: the same arrays
    assert np.array_equal(images, bunch.images) and np.array_equal(target, bunch.target)
    original = sorted(
        (img.astype(np.float32) / 16.0).tobytes() + bytes([t])
        for img, t in zip(bunch.images, bunch.target)
    )
    x = torch.cat([digits.x_train, digits.x_val])
    y = torch.cat([digits.y_train, digits.y_val])
    rebuilt = sorted(xi[0].numpy().tobytes() + bytes([int(yi)]) for xi, yi in zip(x, y))
    assert rebuilt == original


# -- ShardedBatches -------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_are_disjoint_and_together_equal_the_global_batch(world_size):
    batch = 4
    single = loader(batch * world_size, seed=3)
    ranks = [loader(batch, r, world_size, seed=3) for r in range(world_size)]
    steps = 2 * single.steps_per_epoch + 1  # crosses two epoch boundaries
    assert all(r.steps_per_epoch == single.steps_per_epoch for r in ranks)
    expected = take(single, steps)
    per_rank = [take(r, steps) for r in ranks]
    for step in range(steps):
        parts = [per_rank[r][step] for r in range(world_size)]
        assert all(len(p) == batch for p in parts)
        flat = [i for p in parts for i in p]
        assert len(set(flat)) == len(flat), f"ranks overlap at step {step}"
        assert flat == expected[step]


def test_an_epoch_never_repeats_a_sample_and_drops_the_incomplete_batch():
    batches = loader(8)
    assert batches.steps_per_epoch == N // 8
    seen = [i for b in take(batches, batches.steps_per_epoch) for i in b]
    assert len(seen) == len(set(seen)) == (N // 8) * 8
    assert batches.state_dict() == {"epoch": 0, "step": N // 8, "samples": (N // 8) * 8}
    take(batches, 1)
    assert batches.state_dict() == {"epoch": 1, "step": 1, "samples": 8}


def test_deterministic_per_seed_and_epoch():
    a, b = loader(5, seed=11), loader(5, seed=11)
    spe = a.steps_per_epoch
    seq_a, seq_b = take(a, 2 * spe), take(b, 2 * spe)
    assert seq_a == seq_b
    assert seq_a[:spe] != seq_a[spe:]  # reshuffled each epoch
    assert take(loader(5, seed=12), spe) != seq_a[:spe]


def test_epoch_e_uses_permutation_seed_plus_e():
    base = loader(5, seed=4)
    spe = base.steps_per_epoch
    epoch1 = take(base, 2 * spe)[spe:]
    assert take(loader(5, seed=5), spe) == epoch1


def test_no_shuffle_is_in_order():
    batches = loader(10, shuffle=False)
    assert take(batches, 2) == [list(range(10)), list(range(10, 20))]
    batches.load_state_dict({"epoch": 3, "step": 0})
    assert take(batches, 1) == [list(range(10))]


@pytest.mark.parametrize("consumed", [0, 1, 6, 7, 13])
def test_state_dict_round_trip_resumes_the_same_sequence(consumed):
    # batch 7 of 50 samples: 7 steps per epoch, so 7 is an epoch end and 13 is inside epoch 1
    original = loader(7, seed=9)
    take(original, consumed)
    state = json.loads(json.dumps(original.state_dict()))  # plain, JSON-safe ints
    resumed = loader(7, seed=9)
    take(resumed, 3)  # wherever it was, loading the state moves it
    resumed.load_state_dict(state)
    assert take(resumed, 10) == take(original, 10)


def test_state_dict_round_trip_per_rank():
    ranks = [loader(4, r, 2, seed=2) for r in range(2)]
    for r in ranks:
        take(r, 5)
    states = [r.state_dict() for r in ranks]
    resumed = [loader(4, r, 2, seed=2) for r in range(2)]
    for r, s in zip(resumed, states):
        r.load_state_dict(s)
    assert [take(r, 4) for r in resumed] == [take(r, 4) for r in ranks]


@pytest.mark.parametrize(("batch", "world_size"), [(51, 1), (26, 2), (17, 3)])
def test_batch_larger_than_data_is_a_data_error(batch, world_size):
    with pytest.raises(DataError) as info:
        loader(batch, 0, world_size)
    message = str(info.value)
    assert message.startswith("data.batch_size:") and "\n" not in message
    assert str(batch * world_size) in message and str(N) in message


def test_batch_equal_to_data_is_one_step():
    batches = loader(25, 1, 2)
    assert batches.steps_per_epoch == 1
    assert len(take(batches, 3)[2]) == 25


def test_position_resumes_on_another_world_size():
    two = loader(4, rank=0, world_size=2)
    take(two, 3)  # 3 global batches of 8 = 24 samples
    three = loader(4, rank=0, world_size=3)
    three.load_state_dict(two.state_dict())
    assert three.state_dict()["samples"] == 24  # 24 / 12 = step 2 exactly
    assert three.position.step == 2
