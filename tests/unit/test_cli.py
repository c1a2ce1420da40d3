"""The ``phalanx`` command: one-line errors with exit code 2, --debug tracebacks, a real tiny run
and resuming it. Most runs are in-process (``phalanx.cli.main``); three are real subprocesses."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from phalanx import checkpoint
from phalanx.cli import main
from phalanx.config import config_from_data, load_config
from phalanx.errors import ConfigError
from phalanx.runtime.context import shutdown
from tests.helpers.cli import assert_one_line_error, metrics, own_process_group, run_main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "configs" / "digits_cnn.toml")
PHALANX = Path(sys.executable).parent / "phalanx"
STEP_KEYS = {"loss", "forward_s", "backward_s", "exchange_s", "optimizer_s", "bytes_sent"}
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PHALANX_LAUNCHED")


@pytest.fixture(autouse=True)
def not_in_a_worker(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 8):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A real 4-step, 1-process run of the example config (in-process); (run_dir, stdout)."""
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    argv = ["train", EXAMPLE, "--set", "train.steps=4", "--run-dir", str(run_dir)]
    out, err = io.StringIO(), io.StringIO()
    saved = {name: os.environ.pop(name) for name in LAUNCH_VARS if name in os.environ}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run_main(argv)
    finally:
        os.environ.update(saved)
    assert code == 0, err.getvalue()
    return run_dir, out.getvalue()


@pytest.fixture
def run_copy(tiny_run, tmp_path):
    """A private copy of the tiny run's directory, free to damage or extend."""
    return Path(shutil.copytree(tiny_run[0], tmp_path / "run"))


# -- a real run ----------------------------------------------------------------------------------


def test_tiny_run_writes_config_json(tiny_run):
    run_dir, _ = tiny_run
    saved = json.loads((run_dir / "config.json").read_text())
    config = config_from_data(saved)
    assert config.train.steps == 4
    assert config == load_config(EXAMPLE, ["train.steps=4"])


def test_tiny_run_writes_one_metrics_record_per_step(tiny_run):
    records = metrics(tiny_run[0])
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert STEP_KEYS <= record.keys()
        assert math.isfinite(record["loss"]) and record["loss"] > 0
        for key in ("forward_s", "backward_s", "exchange_s", "optimizer_s"):
            assert isinstance(record[key], float) and record[key] >= 0
        assert isinstance(record["bytes_sent"], int) and record["bytes_sent"] >= 0
    assert 0.0 <= records[-1]["val_accuracy"] <= 1.0  # validated at the last step


def test_tiny_run_writes_summary_and_prints_it(tiny_run):
    run_dir, stdout = tiny_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["world_size"] == 1
    assert summary["global_batch"] == 32
    assert summary["run_dir"] == str(run_dir)
    assert 0.0 <= summary["val_accuracy"] <= 1.0 and summary["samples_per_s"] > 0
    assert "final validation accuracy" in stdout and "4 steps" in stdout


def test_tiny_run_writes_a_loadable_checkpoint(tiny_run):
    directory = tiny_run[0] / "checkpoints"
    assert [p.name for p in directory.glob("step-*") if p.is_dir()] == ["step-0000004"]
    payload = checkpoint.load(directory)["trainer"]
    assert payload["step"] == 4 and payload["world_size"] == 1
    assert payload["data"] == {"epoch": 0, "step": 4, "samples": 128}
    assert {"engine", "rng"} <= payload.keys()


def test_resume_continues_the_run(run_copy, capsys):
    code = run_main(["train", "--resume", str(run_copy), "--set", "train.steps=6"])
    assert code == 0, capsys.readouterr().err
    assert [r["step"] for r in metrics(run_copy)] == [1, 2, 3, 4, 5, 6]
    assert checkpoint.load(run_copy / "checkpoints")["trainer"]["step"] == 6
    names = sorted(p.name for p in (run_copy / "checkpoints").glob("step-*") if p.is_dir())
    assert names == ["step-0000004", "step-0000006"]  # keep = 2
    assert json.loads((run_copy / "summary.json").read_text())["steps"] == 6


def test_background_checkpoints_resume_the_same(run_copy, capsys):
    """checkpoint.async_save: checkpoints written while training goes on (the last in place)
    resume to the same losses as in-place ones."""
    argv = ["train", "--resume", str(run_copy), "--set", "train.steps=7", "--set",
            "checkpoint.every=1", "--set", "checkpoint.async_save=true"]  # fmt: skip
    assert run_main(argv) == 0, capsys.readouterr().err
    directory = run_copy / "checkpoints"
    names = sorted(p.name for p in directory.glob("step-*") if p.is_dir())
    assert names == ["step-0000006", "step-0000007"]
    assert checkpoint.load(directory)["trainer"]["step"] == 7
    losses = [r["loss"] for r in metrics(run_copy)]
    shutil.rmtree(directory / "step-0000007")  # resume from the background one, step 6
    (directory / "step-0000007.json").unlink()
    (directory / "latest.json").unlink()
    assert run_main(["train", "--resume", str(run_copy), "--set", "train.steps=7"]) == 0
    assert [r["loss"] for r in metrics(run_copy)] == losses


def test_resume_with_a_corrupted_checkpoint_exits_2_naming_the_file(run_copy, capsys):
    (path,) = (p for p in (run_copy / "checkpoints").glob("step-*") if p.is_dir())
    flip_bytes(path / "__0_0.distcp")
    code = run_main(["train", "--resume", str(run_copy)])
    captured = capsys.readouterr()
    assert code == 2
    assert_one_line_error(captured.err, str(path), "corrupted")
    assert captured.out == ""


# -- user mistakes: exit 2, one line, no traceback ------------------------------------------------


def test_missing_config_exits_2(tmp_path, capsys):
    missing = tmp_path / "missing.toml"
    assert run_main(["train", str(missing)]) == 2
    assert_one_line_error(capsys.readouterr().err, "not found", str(missing))
    assert run_main(["train", str(tmp_path), "--dry-run"]) == 2
    assert_one_line_error(capsys.readouterr().err, f"{tmp_path}: is a directory")


def test_unknown_set_key_exits_2(capsys):
    assert run_main(["train", EXAMPLE, "--set", "train.lr=0.1"]) == 2
    assert_one_line_error(capsys.readouterr().err, "train.lr: unknown key", "allowed:")


@pytest.mark.parametrize(
    ("items", "fragment"),
    [
        (["train.steps=0", "train.epochs=0"], "train.steps"),
        (["exchange.strategy=nope"], "unknown strategy 'nope'"),
        (["optimizer.lr=-1"], "optimizer.lr: must be finite and > 0"),
        (["notakey"], "--set 'notakey'"),
    ],
)
def test_bad_overrides_exit_2(items, fragment, capsys):
    argv = ["train", EXAMPLE]
    for item in items:
        argv += ["--set", item]
    assert run_main(argv) == 2
    assert_one_line_error(capsys.readouterr().err, fragment)


def test_invalid_toml_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nsteps = = 3\n")
    assert run_main(["train", str(path)]) == 2
    assert_one_line_error(capsys.readouterr().err, str(path), "invalid TOML")


def test_train_without_config_or_resume_exits_2(capsys):
    assert run_main(["train"]) == 2
    assert_one_line_error(capsys.readouterr().err, "--resume")


def test_resume_of_a_non_run_directory_exits_2(tmp_path, capsys):
    assert run_main(["train", "--resume", str(tmp_path)]) == 2
    assert_one_line_error(capsys.readouterr().err, "config.json", str(tmp_path))


def test_resume_without_a_checkpoint_exits_2(tmp_path, capsys):
    config = load_config(EXAMPLE, ["train.steps=2"])
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert run_main(["train", "--resume", str(tmp_path)]) == 2
    assert_one_line_error(capsys.readouterr().err, "no checkpoint", str(tmp_path / "checkpoints"))


def test_no_command_prints_help_and_exits_2(capsys):
    assert run_main([]) == 2
    assert "train" in capsys.readouterr().out


def test_debug_after_train_shows_the_exception(tmp_path):
    with own_process_group(), pytest.raises(ConfigError, match="not found"):
        main(["train", str(tmp_path / "missing.toml"), "--debug"])


def test_top_level_debug_shows_the_exception(tmp_path):
    with own_process_group(), pytest.raises(ConfigError, match="not found"):
        main(["--debug", "train", str(tmp_path / "missing.toml")])


def test_wrongly_typed_layer_argument_exits_2(tmp_path, capsys):
    path = tmp_path / "typed.toml"
    path.write_text(
        "[model]\n"
        'layers = [{ type = "flatten" }, { type = "linear", in_features = "64", '
        "out_features = 10 }]\n"
        "[train]\nsteps = 1\nprogress = false\n"
    )
    code = run_main(["train", str(path), "--run-dir", str(tmp_path / "run")])
    assert code == 2
    assert_one_line_error(capsys.readouterr().err, "model.layers[1]")


# -- real subprocesses: the installed script ---------------------------------------------------


def run_phalanx(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return subprocess.run(
        [str(PHALANX), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow  # spawns processes: not in make test-fast
def test_script_missing_config_exits_2_without_traceback(tmp_path):
    result = run_phalanx("train", "missing.toml", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == "phalanx: error: config file not found: missing.toml\n"
    assert result.stdout == ""


@pytest.mark.slow  # spawns processes: not in make test-fast
def test_script_unknown_set_key_exits_2_without_traceback(tmp_path):
    result = run_phalanx("train", EXAMPLE, "--set", "train.lr=0.1", cwd=tmp_path)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "train.lr: unknown key")
    assert not (tmp_path / "runs").exists()  # failed before creating a run directory


@pytest.mark.slow  # spawns processes: not in make test-fast
def test_script_debug_shows_the_traceback(tmp_path):
    result = run_phalanx("train", "missing.toml", "--debug", cwd=tmp_path)
    assert result.returncode != 0
    assert "Traceback (most recent call last)" in result.stderr
    assert "ConfigError: config file not found: missing.toml" in result.stderr


# -- --version, config show, --dry-run ------------------------------------------------------------


def test_version(capsys):
    assert run_main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("phalanx 0.1.0 (torch ") and out.strip().endswith(")")


def test_config_show_prints_every_default_and_the_overrides(capsys):
    assert run_main(["config", "show", EXAMPLE, "--set", "scheduler.name=cosine"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["scheduler"]["name"] == "cosine"
    assert shown["train"]["nonfinite"] == "skip"  # a default the file does not mention
    assert shown == load_config(EXAMPLE, ["scheduler.name=cosine"]).to_dict()


def test_config_show_bad_key_exits_2(capsys):
    assert run_main(["config", "show", EXAMPLE, "--set", "train.lr=0.1"]) == 2
    assert_one_line_error(capsys.readouterr().err, "train.lr: unknown key")


def test_dry_run_describes_the_run_and_starts_nothing(tmp_path, capsys):
    shutdown()  # a world of one an earlier test in this process left (what is checked below)
    run_dir = tmp_path / "never"
    argv = ["train", EXAMPLE, "--nproc", "3", "--dry-run", "--run-dir", str(run_dir),
            "--set", "exchange.strategy=ps", "--set", "exchange.options={servers=1}"]  # fmt: skip
    assert run_main(argv) == 0
    out = capsys.readouterr().out
    assert "processes: 3 (2 training on data, 1 parameter servers)" in out
    batch = load_config(EXAMPLE).data.batch_size
    assert f"global batch: {batch} x 2 = {2 * batch}" in out
    assert "Conv2d(" in out and "parameters: " in out
    assert not run_dir.exists() and not dist.is_initialized()


def test_a_layer_whose_sizes_do_not_fit_is_named_by_dry_run_and_by_the_first_step(tmp_path, capsys):
    """in_features 1000 where the flattened conv output has 1024: --dry-run runs one batch
    through the layers and names the layer, and so does a run's first step (no traceback)."""
    assert run_main(["train", EXAMPLE, "--dry-run"]) == 0
    assert "shapes: one batch [32, 1, 8, 8] -> output [32, 10]" in capsys.readouterr().out
    text = Path(EXAMPLE).read_text()
    assert text.count("in_features = 1024") == 1
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("in_features = 1024", "in_features = 1000"))
    said = ("model.layers[6] (linear): mat1 and mat2 shapes cannot be multiplied",
            "its input has shape [32, 1024]")  # fmt: skip
    assert run_main(["train", str(bad), "--dry-run"]) == 2
    assert_one_line_error(capsys.readouterr().err, *said)
    argv = ["train", str(bad), "--run-dir", str(tmp_path / "run"), "--set", "train.steps=2",
            "--set", "train.progress=false"]  # fmt: skip
    assert run_main(argv) == 2
    assert_one_line_error(capsys.readouterr().err, *said)


@pytest.mark.parametrize(
    ("setting", "fragment"),
    [
        ("train.max_grad_norm=1.0", "train.max_grad_norm: exchange.strategy 'ps'"),
        ("train.precision=fp16", "train.precision: fp16 needs its loss scale removed"),
    ],
)
def test_rescaling_with_a_strategy_that_updates_during_exchange_exits_2(setting, fragment, capsys):
    argv = ["train", EXAMPLE, "--set", setting, "--set", "exchange.strategy=ps"]
    assert run_main(argv) == 2
    assert_one_line_error(capsys.readouterr().err, fragment)


def test_tensorboard_scalars_beside_metrics_and_plot(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["train", EXAMPLE, "--run-dir", str(run_dir), "--set", "train.steps=4",
            "--set", "log.tensorboard=true", "--set", "train.progress=false"]  # fmt: skip
    assert run_main(argv) == 0
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert run_main(["plot", str(run_dir), "-o", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 0
    assert run_main(["plot", str(tmp_path / "nothing")]) == 2
    assert_one_line_error(capsys.readouterr().err, "no metrics.jsonl")


PLAIN_LOAD = """
import sys
sys.modules["phalanx"] = None  # prove it: importing phalanx now fails
import torch
from safetensors.torch import load_file
from torch import nn
model = nn.Sequential(
    nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
    nn.MaxPool2d(2), nn.Flatten(), nn.Linear(1024, 128), nn.ReLU(), nn.Dropout(0.1),
    nn.Linear(128, 10),
)
model.load_state_dict(load_file(sys.argv[1]), strict=True)
torch.save({k: v.clone() for k, v in model.state_dict().items()}, sys.argv[2])
"""


def test_export_loads_into_plain_pytorch(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["train", EXAMPLE, "--run-dir", str(run_dir), "--set", "train.steps=3",
            "--set", "train.progress=false"]  # fmt: skip
    assert run_main(argv) == 0
    weights = tmp_path / "out" / "model.safetensors"
    assert run_main(["export", str(run_dir), "-o", str(weights)]) == 0
    assert "8 tensors from the step-3 checkpoint" in capsys.readouterr().out
    loaded = tmp_path / "loaded.pt"
    done = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(weights), str(loaded)],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    expected = checkpoint.load(run_dir / "checkpoints")["trainer"]["engine"]["model"]
    got = torch.load(loaded, weights_only=True)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert run_main(["export", str(tmp_path / "nothing")]) == 2
    assert_one_line_error(capsys.readouterr().err, "no checkpoint in", ": no such directory")


def test_worker_error_file_is_written_whole_for_the_launcher(tmp_path, monkeypatch):
    """A worker's error reaches torch elastic's agent through TORCHELASTIC_ERROR_FILE, written
    atomically (a stopped writer leaves no half file for the agent to choke on) and in the
    format the agent parses; without the variable nothing is written."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from phalanx.cli import _record_for_launcher
    from phalanx.runtime.launch import _failure_message

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    _record_for_launcher(RuntimeError("nothing to write"))
    assert list(tmp_path.iterdir()) == []
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    _record_for_launcher(RuntimeError("bucket 3 exploded"))
    failure = ProcessFailure(local_rank=1, pid=123, exitcode=1, error_file=str(path))
    assert "RuntimeError: bucket 3 exploded" in _failure_message(failure)  # the launcher reads
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]  # no temporary left


def test_runs_started_in_the_same_second_get_their_own_directories(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A sweep starting several runs at once without --run-dir: each claims its own default
    directory (runs/<config>-<time>, then -2, ...) instead of all writing into one; a run
    refused for its config claims none."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda *_: "20261127-120000")
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    refused = ["--set", "exchange.strategy=ps", "--set", "exchange.options.servers=1"]
    assert run_main(["train", EXAMPLE, *refused]) == 2  # no worker left: refused at the start
    assert not (tmp_path / "runs").exists()
    for _ in range(2):
        assert run_main(["train", EXAMPLE, "--set", "train.steps=1"]) == 0
    first = Path("runs") / f"{Path(EXAMPLE).stem}-20261127-120000"
    second = first.with_name(f"{first.name}-2")
    for run_dir in (first, second):
        assert json.loads((tmp_path / run_dir / "summary.json").read_text())["steps"] == 1
    printed = capsys.readouterr().out
    assert f"run directory {first}" in printed and f"run directory {second}" in printed
