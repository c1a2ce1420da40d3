"""What several test modules share (a test module imports from here, never from another test
module): ``spawn`` (the spawned Gloo ranks), ``equivalence`` (N ranks equal one process: the
global batches, the engine run on this rank's shard, the one-process reference, the
comparisons), ``cli`` (the ``phalanx`` command run in this process), ``models`` and ``mirror``
(small models and loops the unit tests train). The ``fresh_world`` fixture is in
tests/conftest.py."""
