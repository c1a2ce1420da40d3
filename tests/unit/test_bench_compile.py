"""``phalanx bench compile``: one tiny compiled ``phalanx train`` process (the compile line and
``summary.json``'s ``compile_s`` the bench reads), the summary, the report and its checks."""

from __future__ import annotations

import pytest

from phalanx.bench.compile import CompileBenchConfig, check, format_report, run_train, summarize
from phalanx.errors import ConfigError

TINY = """
[model]
layers = [{ type = "flatten" }, { type = "linear", in_features = 64, out_features = 10 }]
[data]
source = "digits"
batch_size = 16
[optimizer]
name = "sgd"
lr = 0.05
"""


@pytest.mark.slow  # spawns processes or trains for real: not in make test-fast
def test_a_compiled_run_reports_its_compile_time_once(tmp_path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    cfg = CompileBenchConfig(config=str(config), nproc=1, steps=2, warmup=1)
    run = run_train(cfg, True, tmp_path / "run")
    assert "error" not in run, run
    assert run["compile_s"] > 0 and len(run["step_s"]) == 1
    assert run["compile_line"].startswith("compile: 2 layers (Flatten, Linear) compiled in ")


def _variant(step_s: float, compile_s: float | None) -> dict:
    return {"median_step_s": step_s, "first_step_s": 1.0, "compile_s": compile_s, "val_loss": 2.0}


def test_summary_report_and_checks() -> None:
    rounds = [
        {"order": ["off", "on"], "variants": {"off": _variant(0.2, None), "on": _variant(0.1, 3)}},
        {"order": ["on", "off"], "variants": {"off": _variant(0.3, None), "on": _variant(0.2, 5)}},
    ]
    s = summarize(rounds)
    assert s["speedup"] == pytest.approx(1.75)  # median of 2.0 and 1.5
    assert s["compile_s"] == 4 and s["break_even_steps"] == pytest.approx(4 / 0.1)
    result = {"meta": {"config": {"config": "gpt.toml", "nproc": 2, "steps": 40}}, "summary": s}
    check(result)
    assert "1.75x" in format_report(result) and "repaid after 40 steps" in format_report(result)
    rounds[1]["variants"]["on"] = {"error": "boom"}
    with pytest.raises(ConfigError, match="bench compile: a run failed: round 1 on: boom"):
        check({"summary": summarize(rounds)})


def test_bad_flags(tmp_path) -> None:
    with pytest.raises(ConfigError, match="--warmup: 5 leaves no timed step of 5"):
        CompileBenchConfig(steps=5, warmup=5).validate()
    with pytest.raises(ConfigError, match="--config: .* is not a file"):
        CompileBenchConfig(config=str(tmp_path / "missing.toml")).validate()
