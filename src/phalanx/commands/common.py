"""What every verb of the ``phalanx`` command shares: its name and exit codes."""

from __future__ import annotations

PROG = "phalanx"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
EXIT_PREEMPTED = 143  # 128 + SIGTERM
