"""Which failure the launcher reports when several ranks fail together."""

from __future__ import annotations

from types import SimpleNamespace

from phalanx.runtime.launch import _describe, _failure_message, _root_cause


def _failure(message: str, exitcode: int = 1, timestamp: int = 100) -> SimpleNamespace:
    return SimpleNamespace(message=message, exitcode=exitcode, timestamp=timestamp)


def test_a_rank_with_its_own_error_beats_a_bare_exit_code_at_the_same_second() -> None:
    failures = {0: _failure(""), 1: _failure("RuntimeError: injected failure on rank 1")}
    assert _root_cause(failures)[0] == 1


def test_peer_loss_and_stop_signals_are_consequences() -> None:
    failures = {
        0: _failure("RuntimeError: Connection closed by peer [127.0.0.1]:1", timestamp=99),
        1: _failure("", exitcode=-15, timestamp=98),
        2: _failure("ValueError: bad shard", timestamp=101),
    }
    assert _root_cause(failures)[0] == 2


def test_earliest_then_lowest_rank_among_equals() -> None:
    assert _root_cause({0: _failure("A", timestamp=5), 1: _failure("B", timestamp=4)})[0] == 1
    assert _root_cause({0: _failure("A"), 1: _failure("B")})[0] == 0


def test_a_rank_killed_by_a_signal_is_the_cause_and_the_signal_is_named() -> None:
    """kill -9 of rank 1: rank 0 fails first with "Connection reset by peer", the launcher
    stops rank 2 with SIGTERM; rank 1 is the cause, reported with the signal's name."""
    failures = {
        0: _failure("RuntimeError: Read error: Connection reset by peer", timestamp=97),
        1: _failure("Signal 9 (SIGKILL) received by PID 4242", exitcode=-9, timestamp=99),
        2: _failure("", exitcode=-15, timestamp=98),
    }
    rank, failure = _root_cause(failures)
    assert rank == 1
    assert _failure_message(failure).startswith("killed — out of memory? (SIGKILL")


def test_signal_messages() -> None:
    assert _failure_message(_failure("", exitcode=-11)).startswith("crashed (segmentation fault)")
    assert _failure_message(_failure("", exitcode=-6)).startswith("aborted (SIGABRT")
    assert _failure_message(_failure("", exitcode=-1)).startswith("killed (SIGHUP")
    assert _failure_message(_failure("ValueError: x", exitcode=1)) == "ValueError: x (exit code 1)"


def test_a_hung_rank_killed_late_by_the_launcher_is_not_blamed_on_memory() -> None:
    """Rank 1 hangs: rank 0 times out in a collective; 30 s later the launcher SIGKILLs rank 1
    (it ignored SIGTERM). The timeout is the cause; rank 1 is named as unresponsive."""
    failures = {
        0: _failure("RuntimeError: Timed out waiting 20000ms for recv", timestamp=121),
        1: _failure("Signal 9 (SIGKILL) received by PID 7", exitcode=-9, timestamp=152),
    }
    rank, message = _describe(failures)
    assert rank == 0
    assert message.startswith("RuntimeError: Timed out waiting 20000ms for recv (exit code 1)")
    assert message.endswith("; rank 1 stopped responding and was killed by the launcher")
    assert "out of memory" not in message


def test_own_error_then_stopped_by_the_launcher_is_the_cause() -> None:
    """A rank that recorded its error and was still exiting (closing its connections) when its
    peer died of the lost connection and the launcher stopped it: its error is the cause."""
    failures = {
        0: _failure("", exitcode=1),  # lost the peer inside the backend: a bare exit code
        1: _failure("RuntimeError: injected failure on rank 1", exitcode=-15),
    }
    rank, message = _describe(failures)
    assert rank == 1 and message.startswith("RuntimeError: injected failure on rank 1"), message
    stopped = {  # a rank the launcher stopped that only recorded its own interruption
        0: _failure("ValueError: bad batch", exitcode=1),
        1: _failure("stopped by SIGTERM", exitcode=-15, timestamp=99),
        2: _failure("Signal 15 (SIGTERM) received by PID 7", exitcode=-15, timestamp=98),
    }
    assert _root_cause(stopped)[0] == 0
