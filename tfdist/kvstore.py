"""The coordination service's key-value store of a multi-worker job, and leaving a job together.

TensorFlow's coordination service (worker 0 holds it) has a key-value store with no public API
(``context.context().get_config_key_value``); the hang watchdog (``tfdist.watchdog``) and the
agreed stop (``tfdist.preemption``) use it through these helpers. Without a store (one worker,
no multi-worker strategy) reads return None and writes do nothing.
"""

from __future__ import annotations

import os
import sys
import time

from tensorflow.python.eager import context  # private: TF's key-value store has no public API

TIMEOUT_MS = 500


def _context():
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


def put(key: str, value: str) -> None:
    """Sets ``key``, replacing what it held (nothing without a store)."""
    ctx = _context()
    if ctx is None:
        return
    try:
        ctx.delete_config_key_value(key)
    except Exception:  # noqa: BLE001  (absent)
        pass
    try:
        ctx.set_config_key_value(key, value)
    except Exception:  # noqa: BLE001  (the store is gone: the job is ending anyway)
        pass


def leave_together(prefix: str, rank: int, size: int, exit_code: int, deadline: float) -> None:
    """Exits with ``exit_code`` once every worker reached this call (or ``deadline`` seconds passed).

    A worker that left earlier would fail its peers' pending collectives (they would exit with
    that error instead), and worker 0 holds the store, so it leaves last.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    put(f"{prefix}left/{rank}", "1")
    end = time.monotonic() + deadline
    while size > 1 and time.monotonic() < end and any(get(f"{prefix}left/{r}") is None for r in range(size)):
        time.sleep(0.2)
    if rank == 0 and size > 1:
        time.sleep(1.0)
    os._exit(exit_code)
