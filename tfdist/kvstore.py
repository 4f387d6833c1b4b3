"""The coordination service's key-value store of a multi-worker job, and leaving a job together.

TensorFlow's coordination service (worker 0 holds it) has a key-value store with no public API
(``context.context().get_config_key_value``); the hang watchdog (``tfdist.watchdog``) and the
agreed stop (``tfdist.preemption``) use it through these helpers. Without a store (one worker,
no multi-worker strategy) reads return None and writes do nothing; so do they in a process forked
from a worker (a ``multiprocessing`` child), whose copy of TensorFlow's client is not its own.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

from tensorflow.python.eager import context  # private: TF's key-value store has no public API

from tfdist import stop_signals

TIMEOUT_MS = 500
WRITE_TIMEOUT_S = 5.0  # a write that has not returned by then: the store (worker 0) is frozen or gone
_BACKOFF_S = (0.05, 1.0)  # the first and the longest pause between reads of a store that fails at once
# wait_for's shortest read: a key that is there is found (a 1 ms read of worker 0's store from worker 1 beside two
# busy loops missed 17 of 300; 5 ms missed none, the slowest answer 4 ms); an absent key costs this past a deadline
_LAST_READ_MS = 100
_forked = False  # a child forked from a worker: TensorFlow's client is not its own
_before_leaving: list[Callable[[float], None]] = []  # leave_together calls each with the seconds it may take
_stuck: threading.Thread | None = None  # a write past WRITE_TIMEOUT_S: later ones are skipped while it waits


def _in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_in_child)


def _context():
    if _forked:
        return None
    ctx = context.context()
    return ctx if ctx.coordination_service is not None else None


def available() -> bool:
    """Whether this process has a coordination service (a multi-worker job)."""
    return _context() is not None


def get(key: str, timeout_ms: int = TIMEOUT_MS) -> str | None:
    """The value of ``key``, waiting up to ``timeout_ms`` for it; None when absent (or no store)."""
    ctx = _context()
    if ctx is None:
        return None
    try:
        return ctx.get_config_key_value(key, timeout_ms)
    except Exception:  # noqa: BLE001  (absent: DeadlineExceeded; the store gone: Unavailable)
        return None


def wait_for(key: str, deadline: float) -> str | None:
    """The value of ``key`` once set, or None when ``deadline`` (``time.monotonic()``) passes first.

    Each read waits in the store for up to a second; when the store answers at once without a
    value (it is gone, or refuses), the next read comes after a pause that doubles up to a second.
    A read waits ``_LAST_READ_MS`` at least, even at or past the deadline (a caller reading its peers
    in turn with one deadline): it may return that much after the deadline.
    """
    pause = _BACKOFF_S[0]
    while True:  # one read at least: a value set before the deadline passed is found after it too
        left = deadline - time.monotonic()
        began = time.monotonic()
        value = get(key, max(_LAST_READ_MS, int(min(left, 1.0) * 1000)))
        if value is not None or deadline - time.monotonic() <= 0:
            return value
        if time.monotonic() - began < 0.5 * min(left, 1.0):  # failed fast: back off
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, _BACKOFF_S[1])
    return None


def put(key: str, value: str) -> None:
    """Sets ``key``, replacing what it held (nothing without a store; see ``_bounded``)."""
    def write(ctx) -> None:
        _delete(ctx, key)
        try:
            ctx.set_config_key_value(key, value)
        except Exception:  # noqa: BLE001  (the store is gone: the job is ending anyway)
            pass

    _bounded(write)


def put_once(key: str, value: str) -> str | None:
    """Sets ``key`` unless it holds a value already, and returns the value it holds then (None: no store, or it
    did not answer). The store refuses to insert a key that exists, so of workers racing to set one key, one
    value wins and every worker reads that one."""
    def insert(ctx) -> None:
        try:
            ctx.set_config_key_value(key, value)
        except Exception:  # noqa: BLE001  (AlreadyExists: another value won; or the store is gone)
            pass

    _bounded(insert)
    return get(key)


def delete(key: str) -> None:
    """Removes ``key`` (nothing when absent or without a store; see ``_bounded``)."""
    _bounded(lambda ctx: _delete(ctx, key))


def _delete(ctx, key: str) -> None:
    try:
        ctx.delete_config_key_value(key)
    except Exception:  # noqa: BLE001  (absent, or the store is gone)
        pass


def _bounded(write: Callable) -> None:
    """Runs ``write(ctx)`` for at most WRITE_TIMEOUT_S. TensorFlow's writes have no timeout: with worker 0 (the
    store) frozen one never returns, and neither would its caller (a stop's verdict, the grace period's timer).
    While such a write still waits, later ones are skipped (each would wait too); once it returns (a store that
    was only slow), writes go on."""
    global _stuck
    ctx = _context()
    if ctx is None or (_stuck is not None and _stuck.is_alive()):
        return
    writer = threading.Thread(target=write, args=(ctx,), name="tfdist-store-write", daemon=True)
    writer.start()
    writer.join(WRITE_TIMEOUT_S)
    if writer.is_alive():
        _stuck = writer


def before_leaving(callback: Callable[[float], None]) -> None:
    """``callback(seconds)`` runs in ``leave_together`` before the process exits (atexit handlers do not run there),
    within ``seconds``: the timeline's last publication."""
    _before_leaving.append(callback)


def leave_together(prefix: str, rank: int, size: int, exit_code: int, deadline: float) -> None:
    """Exits with ``exit_code`` once every worker reached this call (or ``deadline`` seconds passed).

    A worker that left earlier would fail its peers' pending collectives (they would exit with
    that error instead), and worker 0 holds the store, so it leaves last. The ``before_leaving``
    callbacks run first, within half of ``deadline``.
    """
    stop_signals.exiting()
    end = time.monotonic() + deadline
    for callback in _before_leaving:
        try:
            callback(max(0.0, end - deadline / 2 - time.monotonic()))
        except Exception as error:  # noqa: BLE001  (leaving must not fail)
            print(f"tfdist: before leaving: {error!r}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    put(f"{prefix}left/{rank}", "1")
    while size > 1 and time.monotonic() < end and any(get(f"{prefix}left/{r}") is None for r in range(size)):
        time.sleep(0.2)
    if rank == 0 and size > 1:
        time.sleep(1.0)
    os._exit(exit_code)
