"""``python -m phalanx`` is the ``phalanx`` command (and the launcher's worker entry point)."""

from phalanx.cli import main

if __name__ == "__main__":
    main()
