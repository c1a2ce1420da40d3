"""The input Pipeline: the order of ShardedBatches whatever the workers and buffers, disjoint and
complete rank slices, exact resume, every accepted source, failures raised in the consumer,
and no thread or process left behind."""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phalanx.data import Pipeline, ShardedBatches, pad_collate, write_store
from phalanx.data.records import Field
from phalanx.errors import ConfigError, DataError

N = 50  # x[i] == (i, i, i) and y[i] == i, so a batch shows which samples it holds
FAST = settings(
    max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def ids_data(n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 3), torch.arange(n)


def take(pipe: Pipeline | ShardedBatches, steps: int) -> list[list[int]]:
    """The sample ids of the next ``steps`` batches (checking that x and y stay paired)."""
    out = []
    for _ in range(steps):
        x, y = pipe.next()
        assert torch.equal(x[:, 0].long(), y) and torch.equal(x[:, 2].long(), y)
        out.append(y.tolist())
    return out


def pipeline(batch: int, rank: int = 0, world: int = 1, **kwargs) -> Pipeline:
    return Pipeline(ids_data(), batch, rank=rank, world_size=world, **kwargs)


@contextlib.contextmanager
def no_new_threads():
    """Every thread started inside the block has ended when it exits."""
    before = set(threading.enumerate())
    yield
    leaked = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not leaked, f"threads left running: {leaked}"


def noisy(batch, rng):
    """A preprocess whose result depends on its rng: x + uniform noise, y unchanged."""
    x, y = batch
    return x + torch.from_numpy(rng.random(x.shape, dtype=np.float32)), y


def fail_at_17(batch, rng):
    x, y = batch
    if 17 in y.tolist():
        raise ZeroDivisionError("sample 17 is cursed")
    return x, y


def noisy_until_17(batch, rng):
    return noisy(fail_at_17(batch, rng), rng)


# -- order --------------------------------------------------------------------------------------
@FAST
@given(
    batch=st.integers(1, 12),
    world=st.integers(1, 3),
    seed=st.integers(0, 2**31),
    shuffle=st.booleans(),
    workers=st.integers(1, 3),
    buffers=st.integers(1, 4),
    io_threads=st.integers(1, 2),
)
def test_same_batches_as_sharded_batches(batch, world, seed, shuffle, workers, buffers, io_threads):
    if batch * world > N:
        return
    with no_new_threads():
        for rank in range(world):
            reference = ShardedBatches(*ids_data(), batch, rank, world, seed=seed, shuffle=shuffle)
            steps = 2 * reference.steps_per_epoch + 1  # crosses two epoch boundaries
            with pipeline(batch, rank, world, seed=seed, shuffle=shuffle, workers=workers,
                          buffers=buffers, io_threads=io_threads) as pipe:  # fmt: skip
                assert pipe.steps_per_epoch == reference.steps_per_epoch == len(pipe)
                assert take(pipe, steps) == take(reference, steps)
                assert pipe.state_dict() == reference.state_dict()


@FAST
@given(world=st.integers(1, 3), batch=st.integers(1, 9), seed=st.integers(0, 100))
def test_ranks_are_disjoint_and_cover_the_epoch(world, batch, seed):
    if batch * world > N:
        return
    for drop_last in (True, False):
        pipes = [pipeline(batch, r, world, seed=seed, drop_last=drop_last) for r in range(world)]
        epoch = [take(p, p.steps_per_epoch) for p in pipes]
        for p in pipes:
            p.close()
        seen = [i for rank in epoch for b in rank for i in b]
        assert len(seen) == len(set(seen)), "ranks overlap"
        full = (N // (batch * world)) * batch * world
        assert len(seen) == (full if drop_last else N)
        if not drop_last and full < N:  # the short last global batch is split evenly
            sizes = [len(rank[-1]) for rank in epoch]
            assert max(sizes) - min(sizes) <= 1 and sum(sizes) == N - full


def test_results_do_not_depend_on_workers_or_buffers():
    """A random preprocess draws from an rng of (seed, epoch, step, rank): any pool gives the
    same batches; a different seed gives different noise."""

    def run(**kwargs) -> list[torch.Tensor]:
        with pipeline(4, preprocess=noisy, seed=5, **kwargs) as pipe:
            return [pipe.next()[0] for _ in range(30)]

    reference = run(workers=1, buffers=1)
    for kwargs in ({"workers": 3, "buffers": 4, "io_threads": 2}, {"workers": 2, "buffers": 2}):
        assert all(torch.equal(a, b) for a, b in zip(reference, run(**kwargs)))
    with pipeline(4, preprocess=noisy, seed=6) as other:
        assert not torch.equal(other.next()[0], reference[0])


# -- resume -------------------------------------------------------------------------------------
@FAST
@given(consumed=st.integers(0, 30), workers=st.integers(1, 3), buffers=st.integers(1, 4))
def test_resume_mid_epoch_is_exact(consumed, workers, buffers):
    with pipeline(7, seed=9, preprocess=noisy) as original:
        for _ in range(consumed):
            original.next()
        state = original.state_dict()
        expected = [original.next() for _ in range(8)]
    with pipeline(7, seed=9, preprocess=noisy, workers=workers, buffers=buffers) as resumed:
        resumed.next()  # wherever it was (with batches prepared ahead), loading moves it
        resumed.load_state_dict(state)
        for a, b in zip(expected, (resumed.next() for _ in range(8))):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_resume_on_another_world_size():
    two = [pipeline(4, r, 2, seed=1) for r in range(2)]
    for p in two:
        take(p, 3)  # 3 global batches of 8 = 24 samples
    three = [pipeline(4, r, 3, seed=1) for r in range(3)]
    for p in three:
        p.load_state_dict(two[0].state_dict())
        assert p.state_dict()["samples"] == 24 and p.position.step == 2
    single = pipeline(12, seed=1)
    single.load_state_dict({"epoch": 0, "step": 2, "samples": 24})
    parts = [take(p, 1)[0] for p in three]
    assert [i for part in parts for i in part] == take(single, 1)[0]
    for p in [*two, *three, single]:
        p.close()


# -- sources ------------------------------------------------------------------------------------
class Squares(torch.utils.data.Dataset):
    """A map-style torch Dataset returning (tensor, int)."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int):
        return torch.tensor([float(i), float(i * i)]), i


def test_every_kind_of_source_gives_the_same_samples(tmp_path):
    x, y = ids_data()
    store = tmp_path / "store"
    fields = (Field("x", "<f4", (3,)), Field("y", "<i8", ()))
    write_store(store, fields, zip(x.numpy(), y.numpy()), shard_bytes=200).close()
    sources = {
        "tensors": (x, y),
        "numpy": (x.numpy(), y.numpy()),
        "store path": str(store),
        "list of pairs": [(x[i], int(y[i])) for i in range(N)],
    }
    expected = take(pipeline(5, seed=2), 12)
    for name, source in sources.items():
        with Pipeline(source, 5, seed=2, rank=0, world_size=1) as pipe:
            assert take(pipe, 12) == expected, name
    with Pipeline(Squares(), 4, shuffle=False, rank=0, world_size=1) as pipe:
        xs, ys = pipe.next()
        assert xs.shape == (4, 2) and ys.tolist() == [0, 1, 2, 3]
        assert xs[:, 1].tolist() == [0.0, 1.0, 4.0, 9.0]


def test_builtin_source_and_dataset_give_the_training_split():
    from phalanx.data import DataConfig, load_source

    data = load_source(DataConfig())
    for source in ("digits", data):
        with Pipeline(source, 8, shuffle=False, rank=0, world_size=1) as pipe:
            xb, yb = pipe.next()
            assert torch.equal(xb, data.x_train[:8]) and torch.equal(yb, data.y_train[:8])


def test_variable_length_records_with_pad_collate(tmp_path):
    seqs = [np.arange(1, i + 2, dtype=np.int64) for i in range(6)]
    store = write_store(tmp_path / "v", (Field("x", "<i8", (-1,)),), ((s,) for s in seqs))
    with Pipeline(store, 3, collate=pad_collate, shuffle=False, rank=0, world_size=1) as pipe:
        (batch,) = pipe.next()
        assert batch.tolist() == [[1, 0, 0], [1, 2, 0], [1, 2, 3]]
    with Pipeline(store, 3, shuffle=False, rank=0, world_size=1) as pipe:
        with pytest.raises(DataError, match="different shapes.*pad_collate"):
            pipe.next()
    store.close()


def test_device_stage_on_cpu_returns_cpu_tensors():
    with pipeline(4, device="cpu", seed=3) as pipe, pipeline(4, seed=3) as host:
        a, b = pipe.next(), host.next()
        assert a[0].device.type == "cpu" and torch.equal(a[0], b[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned + stream path)")
def test_device_stage_on_cuda_matches_the_host_batches():
    with pipeline(4, device="cuda", seed=3, preprocess=noisy) as pipe:
        with pipeline(4, seed=3, preprocess=noisy) as host:
            for _ in range(10):
                a, b = pipe.next(), host.next()
                assert a[0].is_cuda and torch.equal(a[0].cpu(), b[0])


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("batch", "world"), [(51, 1), (26, 2), (17, 3)])
def test_batch_larger_than_the_data_is_a_one_line_error(batch, world):
    with pytest.raises(DataError) as info:
        pipeline(batch, 0, world)
    message = str(info.value)
    assert message.startswith("data.batch_size:") and "\n" not in message
    assert str(batch * world) in message and str(N) in message and "drop_last" in message
    with pipeline(batch, 0, world, drop_last=False) as pipe:  # allowed: one short step
        assert pipe.steps_per_epoch == 1


def test_bad_arguments_and_sources():
    with pytest.raises(ConfigError, match="workers: must be >= 1, got 0"):
        pipeline(4, workers=0)
    with pytest.raises(ConfigError, match=r"rank: must be in \[0, 2\), got 2"):
        pipeline(4, 2, 2)
    with pytest.raises(ValueError, match="pass both or neither"):
        Pipeline(ids_data(), 4, rank=0)
    with pytest.raises(DataError, match="expected a record store directory"):
        Pipeline(42, 4, rank=0, world_size=1)
    with pytest.raises(DataError, match="no such directory"):
        Pipeline("/no/such/store", 4, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="unknown preprocess pool 'fibers'"):
        pipeline(4, preprocess=noisy, pool="fibers")
    with pytest.raises(DataError, match="needs a picklable function"):
        pipeline(4, preprocess=lambda b, r: b, pool="process")


# -- failures and cleanup -----------------------------------------------------------------------
def test_preprocess_error_is_raised_in_the_consumer_with_its_traceback():
    with no_new_threads():
        pipe = pipeline(5, shuffle=False, preprocess=fail_at_17, workers=2, buffers=3)
        assert take(pipe, 3) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
        with pytest.raises(ZeroDivisionError, match="sample 17 is cursed") as info:
            pipe.next()
        frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
        assert "fail_at_17" in frames  # the original traceback, from the worker thread
        with pytest.raises(DataError, match="closed"):
            pipe.next()


def test_corrupted_record_is_raised_naming_file_and_record(tmp_path):
    x, y = ids_data()
    fields = (Field("x", "<f4", (3,)), Field("y", "<i8", ()))
    write_store(tmp_path / "s", fields, zip(x.numpy(), y.numpy())).close()
    shard = tmp_path / "s" / "shard-00000.rec"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the last record (49)
    shard.write_bytes(bytes(data))
    with no_new_threads():
        pipe = Pipeline(str(tmp_path / "s"), 10, shuffle=False, rank=0, world_size=1)
        take(pipe, 4)
        with pytest.raises(DataError, match=r"shard-00000.rec: record 49 .*checksum mismatch"):
            pipe.next()


def test_no_thread_leaks_in_any_way_of_stopping():
    with no_new_threads():
        with pipeline(4) as pipe:  # context manager after use
            take(pipe, 5)
        pipeline(4).close()  # never started
        pipe = pipeline(4, buffers=2, workers=3, io_threads=2)
        take(pipe, 1)
        pipe.load_state_dict({"epoch": 3, "step": 2})  # restarts its threads
        take(pipe, 2)
        pipe.close()
        pipe.close()  # idempotent
        with pytest.raises(RuntimeError, match="boom"), pipeline(4) as pipe:
            take(pipe, 2)
            raise RuntimeError("boom")  # the block fails while producers wait for a buffer


def test_buffer_occupancy_and_input_wait_are_reported():
    release = threading.Event()

    def gated(batch, rng):
        release.wait(10)
        return batch

    with pipeline(4, preprocess=gated, buffers=3, workers=2) as pipe:
        release.set()
        pipe.next()
        deadline = time.monotonic() + 10
        while pipe._buffers.num_ready < 2 and time.monotonic() < deadline:
            time.sleep(0.001)  # the two other buffers fill while the consumer holds one
        pipe.next()
        assert pipe.last_ready == 2 and pipe.last_wait_s >= 0.0


@pytest.mark.slow  # spawns processes: not in make test-fast
def test_process_pool_matches_threads_fails_cleanly_and_leaves_no_process():
    import multiprocessing

    with no_new_threads():
        pipe = pipeline(5, shuffle=False, preprocess=noisy_until_17, pool="process", workers=1)
        with pipeline(5, shuffle=False, preprocess=noisy_until_17) as threads:
            for _ in range(3):
                a, b = pipe.next(), threads.next()
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        children = multiprocessing.active_children()
        assert children, "the process pool should have started worker processes"
        with pytest.raises(ZeroDivisionError, match="sample 17 is cursed") as info:
            pipe.next()
        assert "fail_at_17" in str(info.value.__cause__)  # the child's traceback text
        assert not any(p.is_alive() for p in children)
    assert not multiprocessing.active_children()


# -- ranks from the process group; the trainer ----------------------------------------------------
def _rank_batches(ctx, seed: int) -> tuple[int, int, list[list[int]]]:
    with Pipeline(ids_data(), 4, seed=seed) as pipe:  # rank and world from phalanx.init
        return pipe.rank, pipe.world_size, take(pipe, 2 * pipe.steps_per_epoch)


@pytest.mark.slow  # spawns processes: not in make test-fast
def test_ranks_of_a_process_group_split_each_global_batch():
    from tests.helpers.spawn import run_ranks

    results = run_ranks(_rank_batches, 3, 7)
    assert [(r, w) for r, w, _ in results] == [(0, 3), (1, 3), (2, 3)]
    with pipeline(12, seed=7) as single:
        expected = take(single, 2 * single.steps_per_epoch)
    joined = [sum((results[r][2][step] for r in range(3)), []) for step in range(len(expected))]
    assert joined == expected


def test_trainer_reads_a_record_store_and_reports_input_metrics(tmp_path, capsys):
    import json

    from phalanx.cli import main
    from phalanx.data.pack import pack
    from phalanx.runtime.context import shutdown

    pack("digits", tmp_path / "store").close()
    config = str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml")
    argv = ["train", config, "--set", "train.steps=3", "--set", "train.progress=false"]
    try:
        with pytest.raises(SystemExit) as info:
            main([*argv, "--set", f'data.path="{tmp_path / "store"}"', "--run-dir",
                  str(tmp_path / "run")])  # fmt: skip
        assert info.value.code == 0
        lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        for record in map(json.loads, lines):
            assert isinstance(record["input_wait_s"], float) and record["input_wait_s"] >= 0
            assert record["input_buffers_ready"] in (0, 1, 2, 3)  # of 3 buffers
        write_store(tmp_path / "three", [Field(k, "<f4", ()) for k in "abc"], [(1, 2, 3)] * 40)
        with pytest.raises(SystemExit) as info:
            main([*argv, "--set", f'data.path="{tmp_path / "three"}"', "--run-dir",
                  str(tmp_path / "run3")])  # fmt: skip
        assert info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "has fields (a, b, c); training needs two" in err
    finally:
        shutdown()


def test_the_example_in_docs_data_md_runs(tmp_path, monkeypatch, capsys):
    from phalanx.runtime.context import shutdown

    text = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    with no_new_threads():
        try:
            exec(compile(code, "docs/data.md", "exec"), {"__name__": "__main__"})
        finally:
            shutdown()
    out = capsys.readouterr().out
    assert "epoch 2: loss" in out and "buffers ready" in out
    assert "position: {'epoch': 2, 'step': 44, 'samples': 1408}" in out  # 1438 // 32 = 44
