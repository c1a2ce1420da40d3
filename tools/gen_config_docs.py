"""Regenerate docs/configs.md from the Config dataclasses: `python tools/gen_config_docs.py`."""

from __future__ import annotations

from pathlib import Path

from phalanx.config import describe
from phalanx.models.layers import LAYERS

HEADER = """# Config reference

A run is configured by a TOML file with one table per component; `--set section.key=value`
overrides any key (the value is parsed as TOML, a bare word as a string). Unknown keys, wrong
types and out-of-range values are one-line errors naming the key path and what is allowed.
This table is generated from the Config dataclasses by `tools/gen_config_docs.py`; a test keeps
it in step with the code.

| key | type | default | meaning |
|---|---|---|---|
"""

MODEL = """
## The model table (F6)

Either a built-in model, `name = "digits_cnn"` or `"mlp"` with keyword `options`, or `layers`:
a list of tables, each with a `type` and that torch layer's constructor arguments, assembled in
order into an `nn.Sequential`. Arguments are checked against the constructor when the config
loads, so `layers[2].kernel` fails with the list of allowed arguments. `lstm` is `nn.LSTM` with
`batch_first = true` that returns only its output sequence (B, T, H).

Layer types: {layers}.

```toml
[model]
layers = [
  {{ type = "linear", in_features = 64, out_features = 128 }},
  {{ type = "relu" }},
  {{ type = "linear", in_features = 128, out_features = 10 }},
]
```
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bare pipe inside a cell would end it


def render() -> str:
    rows = "".join(f"| `{k}` | {_cell(t)} | `{d}` | {doc} |\n" for k, t, d, doc in describe())
    layers = ", ".join(f"`{name}`" for name in LAYERS.names())
    return HEADER + rows + MODEL.format(layers=layers)


if __name__ == "__main__":
    Path(__file__).resolve().parents[1].joinpath("docs", "configs.md").write_text(render())
