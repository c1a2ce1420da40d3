"""Error types. User mistakes raise these (one-line messages); internal invariants use assert."""

from __future__ import annotations

# The backends' words for a peer rank that went away (Gloo, NCCL, the process group).
PEER_LOSS = ("closed by peer", "reset by peer", "remote worker crashing", "remote process exit")


class PhalanxError(Exception):
    """Base class of every error phalanx raises for a user-facing problem."""


class ConfigError(PhalanxError, ValueError):
    """A config file, override or argument is wrong; the message names the key path."""


class CheckpointError(PhalanxError):
    """A checkpoint is missing, corrupted or does not match the run."""


class DataError(PhalanxError, ValueError):
    """A data source or data file is wrong."""


class WorkerError(PhalanxError):
    """A worker process (rank) failed; the message names the rank and the cause."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank


class NonFiniteError(PhalanxError):
    """Training stopped: losses or gradients stayed inf/NaN (the message names the step)."""


class Interrupted(PhalanxError):
    """The run was stopped by a signal (Ctrl-C, a scheduler's SIGTERM)."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class PeerLost(PhalanxError, RuntimeError):
    """A peer rank left the job during a step: its script ended early, or it failed."""

    def __init__(self, step: int, backend_message: str) -> None:
        super().__init__(
            f"step {step}: a peer rank left the job during this step ({backend_message}); if "
            "its script ended, every rank must call step() the same number of times (give "
            "each rank as many batches, e.g. DistributedSampler(drop_last=True)); if it "
            "failed, its own error is in its log"
        )

    @classmethod
    def from_backend(cls, error: RuntimeError, step: int) -> PeerLost | None:
        """The backend's ``error`` as a PeerLost when its words say a peer went away (its
        first sentence kept, without the source path), else None."""
        first_line = str(error).splitlines()[0] if str(error) else ""
        if isinstance(error, PhalanxError) or not any(p in first_line.lower() for p in PEER_LOSS):
            return None
        return cls(step, first_line.split("] ", 1)[-1].split(". ", 1)[0][:160])
