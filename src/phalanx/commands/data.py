"""``phalanx data pack SOURCE OUT_DIR`` and ``phalanx data inspect DIR``: record stores."""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from phalanx.data.records import Field, RecordStore


def add_parser(commands: argparse._SubParsersAction) -> None:
    """``phalanx data`` and its actions; each sets ``handler``."""
    p = commands.add_parser("data", help="pack and inspect record stores")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    pack = actions.add_parser("pack", help="write a source into a record store")
    pack.add_argument("source", help="built-in source name (digits, ...) or a .npy/.npz directory")
    pack.add_argument("out_dir", help="new (or empty) directory for the store")
    pack.add_argument("--shard-mb", type=float, default=64.0, help="shard size (default 64)")
    pack.add_argument("--split", default="train", help="built-in sources: train or val")
    pack.set_defaults(handler=cmd_pack)
    inspect = actions.add_parser("inspect", help="summarise (and verify) a record store")
    inspect.add_argument("dir", help="the store's directory")
    inspect.add_argument("--verify", action="store_true", help="check every shard's SHA-256")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")
    inspect.set_defaults(handler=cmd_inspect)
    for sub in (pack, inspect):
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)


def cmd_pack(args: argparse.Namespace) -> int:
    from phalanx.data.pack import pack

    with pack(args.source, args.out_dir, args.shard_mb, args.split) as store:
        summary = store.summary()
    print(f"packed {summary['num_records']} records into {args.out_dir}: {_shape(summary)}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    with RecordStore(args.dir) as store:
        if args.verify:
            store.verify()
        summary = store.summary()
    if args.json:
        print(json.dumps({**summary, "verified": bool(args.verify)}, indent=2))
        return 0
    print(f"record store {summary['path']}: {summary['num_records']} records, {_shape(summary)}")
    for f in summary["fields"]:
        shape = Field(f["name"], f["dtype"], tuple(f["shape"])).shape_text()
        print(f"  field {f['name']:<8} {np.dtype(f['dtype']).name:<8} {shape}")
    if summary["meta"]:
        print("  meta: " + ", ".join(f"{k}={v}" for k, v in summary["meta"].items()))
    if args.verify:
        print("  verified: every shard's SHA-256 and every record's crc32 match")
    return 0


def _shape(s: dict[str, Any]) -> str:
    if s["fixed"]:
        size = f"fixed records of {s['record_bytes_min']} B"
    else:
        size = (
            f"variable records of {s['record_bytes_min']}-{s['record_bytes_max']} B "
            f"(mean {s['record_bytes_mean']:.0f})"
        )
    return f"{s['num_shards']} shard(s), {s['bytes'] / 2**20:.2f} MiB, {size}"
