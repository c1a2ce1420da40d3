"""The generated config reference matches the code."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_config_reference_is_current() -> None:
    spec = importlib.util.spec_from_file_location("gen", ROOT / "tools" / "gen_config_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    current = (ROOT / "docs" / "configs.md").read_text()
    assert current == gen.render(), "run: python tools/gen_config_docs.py"
