"""The spawn harness of the multi-process tests: the library's runner, ``phalanx.runtime.spawn``.

``run_ranks(fn, world_size, *args, timeout=120)`` runs ``fn(ctx, *args)`` in ``world_size`` Gloo
ranks (file rendezvous) and returns the results in rank order; a failing or dying rank is raised
as ``RankFailed`` naming it, and every rank is stopped, so a broken test never hangs.
"""

from phalanx.runtime.spawn import RankFailed, run_ranks

__all__ = ["RankFailed", "run_ranks"]
