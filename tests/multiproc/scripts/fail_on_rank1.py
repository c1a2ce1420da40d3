"""A worker script for the launcher test: rank 1 raises while rank 0 waits in a collective."""

import phalanx as px
from phalanx.cli import _report

ctx = px.init()
if ctx.rank == 1:
    error = RuntimeError("injected failure on rank 1")
    _report(error, in_worker=True)
    raise SystemExit(1)
ctx.barrier()  # never completes: the launcher must stop this rank
