"""tools/test_cuda.py (``make test-cuda``) smoke-tested without a GPU, so that the GPU window is
not spent on a typo: every part's command (the GPU ones too) parses and validates; a run with
``--device cpu`` and a tiny budget reports every part as ok, failed or skipped, the report
rewritten after each part; SIGTERM stops the running part and still writes the report."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.unit
TOOL = Path(__file__).resolve().parents[2] / "tools" / "test_cuda.py"


@functools.cache
def _tool():
    """tools/test_cuda.py as a module (once: its dataclasses need it in sys.modules)."""
    spec = importlib.util.spec_from_file_location("tools_test_cuda", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the tool sets it
    return subprocess.Popen([sys.executable, str(TOOL), *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


def _statuses(report: str) -> dict[str, tuple[str, str]]:
    """The report's table: part name -> (status, note)."""
    rows = re.findall(r"^\| ([^|]+) \| (\w+) \| \d+ \| \d+ \| ([^|]*) \|$", report, re.M)
    return {name: (status, note.strip()) for name, status, note in rows}


def test_every_part_parses_on_both_devices(monkeypatch, tmp_path) -> None:
    tool = _tool()
    monkeypatch.syspath_prepend(str(tool.SRC))
    for part in tool.parts("cpu", tmp_path / "gpu.json"):
        assert tool.check_command(part.argv) is None, part.name
    # the GPU commands as a GPU machine checks them (their --device cuda needs CUDA to be seen)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    parts = tool.parts("cuda", tmp_path / "gpu.json")
    assert [p.key for p in parts[:2]] == ["tests", "gpu"]  # the most important first
    assert sum(p.limit_s for p in parts[:2]) <= 480 - 60  # room left in the default budget
    for part in parts:
        assert tool.check_command(part.argv) is None, part.name
    said = tool.check_command(["-m", "phalanx", "bench", "gpu", "--steps", "x"])
    assert "--steps: invalid int value: 'x'" in said
    said = tool.check_command(["-m", "phalanx", "bench", "gpu", "--kinds", "plain,dpp"])
    assert said == "ConfigError: --kinds: unknown 'dpp'; known: plain, ddp, allreduce, fsdp, fsdp2"


def test_children_find_this_checkout_and_cpu_hides_cuda(monkeypatch) -> None:
    tool = _tool()
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = tool.child_env("cpu")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tool.SRC), "/elsewhere"]
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    visible = tool.child_env("cuda").get("CUDA_VISIBLE_DEVICES")
    assert visible == os.environ.get("CUDA_VISIBLE_DEVICES")  # as the caller set it


def test_a_tiny_budget_runs_what_fits_and_reports_every_part(tmp_path) -> None:
    out = tmp_path / "report.md"
    # --device cpu limits: tests 40 s (fits in 60), bench gpu 120 s (does not): skipped
    proc = _run("--device", "cpu", "--budget-s", "60", "--only", "tests,gpu", "--out", str(out))
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    report = out.read_text()
    statuses = _statuses(report)
    tool = _tool()
    names = [p.name for p in tool.parts("cpu", tmp_path / "x.json")]
    assert list(statuses) == names, report
    assert statuses["tests marked cuda"][0] == "ok", report
    gpu = statuses["bench gpu (GPT-2 small vs plain PyTorch)"]
    assert gpu[0] == "skipped" and re.fullmatch(r"its 120 s > \d+ s left", gpu[1]), gpu
    for name in names[2:]:
        assert statuses[name] == ("skipped", "not selected (--only)"), name
    assert f"1 of {len(names)} parts ok; skipped: " in report
    assert "## tests marked cuda: ok" in report and "skipped" in report.split("```")[1]
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically: no temporary left


def test_sigterm_stops_the_running_part_and_writes_the_report(tmp_path) -> None:
    out = tmp_path / "report.md"
    proc = _run("--device", "cpu", "--only", "tests", "--out", str(out))
    assert proc.stdout is not None
    said = []
    while not (said and said[-1].startswith("== tests marked cuda: ")):  # the part has started
        said.append(proc.stdout.readline())
        assert said[-1], "".join(said)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1, output
    status, note = _statuses(out.read_text())["tests marked cuda"]
    assert (status, note) == ("failed", "stopped by SIGTERM"), output
