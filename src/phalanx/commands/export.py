"""``phalanx export RUN_DIR -o model.safetensors``: the newest good checkpoint's model weights as
a safetensors file, which plain PyTorch loads with no phalanx installed. The checkpoint (a
torch.distributed.checkpoint directory) is read in this one process, no process group, and
only its model tensors::

    from safetensors.torch import load_file
    model.load_state_dict(load_file("model.safetensors"))
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from phalanx import checkpoint
from phalanx.errors import CheckpointError


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("export", help="a run's model weights as safetensors")
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory")
    p.add_argument("-o", "--output", default="model.safetensors", help="file to write")
    p.set_defaults(handler=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    step, count = export_weights(Path(args.run_dir), Path(args.output))
    print(f"wrote {args.output}: {count} tensors from the step-{step} checkpoint")
    return 0


def export_weights(run_dir: Path, output: Path) -> tuple[int, int]:
    """Write the weights; returns (checkpoint step, number of tensors). CheckpointError when
    the run has no good checkpoint (load falls back past damaged ones, with a warning)."""
    from safetensors.torch import save_file  # only this verb needs it

    payload = checkpoint.load(
        run_dir / "checkpoints", only=("trainer.step", "trainer.engine.model")
    )  # reads the model's tensors only (a single-file checkpoint of earlier versions: all)
    state = payload.get("trainer", payload)
    try:
        model = state["engine"]["model"]
    except (KeyError, TypeError):
        raise CheckpointError(f"{run_dir}: the checkpoint holds no model weights") from None
    # Tied weights share storage, which safetensors refuses: each key gets its own copy.
    tensors = {name: value.detach().contiguous().clone() for name, value in model.items()}
    metadata = {"step": str(state.get("step", "")), "source": str(run_dir)}
    config = run_dir / "config.json"
    if config.is_file():
        metadata["config"] = json.dumps(json.loads(config.read_text(encoding="utf-8")))
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(output)  # atomic: a reader never sees half a file
    return int(state.get("step", 0)), len(tensors)
