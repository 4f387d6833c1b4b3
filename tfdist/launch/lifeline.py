"""What signals to a launcher do to its workers, and what its death does to them.

* The first SIGINT, SIGTERM, SIGHUP or SIGUSR1 (SLURM's ``--signal``) raises ``Stop`` in the
  launcher's main thread: it stops its workers gently (SIGTERM, which makes them save at an
  agreed step: ``tfdist.preemption``; SIGKILL after the grace period).
* A signal while the workers are being stopped, or any later signal, SIGKILLs every
  worker of this launcher at once (``watch``); the launcher still waits for them.
* A launcher killed outright (SIGKILL, the OOM killer) takes its children with it: each
  is started (``spawn_options``) with Linux's parent-death signal, SIGKILL. It fires when
  the thread that started the child exits, so children are started from the main thread
  (or a thread that lives as long as they do, as a Ray actor's).

Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from typing import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
_PR_SET_PDEATHSIG = 1

try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded here: a forked child must not dlopen
except (OSError, AttributeError):  # not Linux
    _prctl = None


class Stop(Exception):
    """Raised in the main loop on a signal or when the job's time runs out."""

    def __init__(self, reason: str, exit_code: int):
        super().__init__(reason)
        self.exit_code = exit_code


class _State:
    installed = False
    received = 0
    stopping = 0  # nested ``stopping`` blocks
    kills: dict[int, Callable[[], None]] = {}


def spawn_options() -> dict:
    """``subprocess.Popen`` options for a child of a launcher: a session of its own, death with this process."""
    if _prctl is None:
        return {"start_new_session": True}
    parent = os.getpid()

    def die_with_parent() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return {"start_new_session": True, "preexec_fn": die_with_parent}


def _stop_reason(signum: int) -> Stop:
    """The Stop a signal means: 'interrupted' (130) for SIGINT, 'received SIGTERM' (143), ..."""
    return Stop("interrupted" if signum == signal.SIGINT else f"received {signal.Signals(signum).name}", 128 + signum)


def _on_signal(signum, frame) -> None:
    _State.received += 1
    if _State.received == 1 and not _State.stopping:
        raise _stop_reason(signum)
    _kill_all_now()


def _kill_all_now() -> None:
    """SIGKILLs everything ``watch`` registered (a second signal does this)."""
    for kill in list(_State.kills.values()):
        kill()


def stop_on_signals() -> dict | None:
    """From now on (in the main thread): SIGINT/SIGTERM/SIGHUP/SIGUSR1 raise Stop once, then kill at once.

    Returns what ``restore`` needs to put the previous handlers back (None: nothing to restore:
    not the main thread, or an outer launcher installed them already).
    """
    if threading.current_thread() is not threading.main_thread() or _State.installed:
        return None
    _State.installed, _State.received = True, 0
    return {sig: signal.signal(sig, _on_signal) for sig in SIGNALS}


def restore(previous: dict | None) -> None:
    """Puts back the handlers ``stop_on_signals`` replaced."""
    if previous is None:
        return
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    _State.installed = False


@contextlib.contextmanager
def stopping():
    """For the block: any signal SIGKILLs every watched process instead of raising Stop."""
    _State.stopping += 1
    try:
        yield
    finally:
        _State.stopping -= 1


def watch(key: object, kill: Callable[[], None]) -> None:
    """Until ``unwatch(key)``: ``kill()`` (SIGKILL a child and what it started) on an escalating signal."""
    _State.kills[id(key)] = kill


def unwatch(key: object) -> None:
    _State.kills.pop(id(key), None)


@contextlib.contextmanager
def signals_held():
    """Defers SIGINT/SIGTERM/SIGHUP/SIGUSR1 (in the main thread) until the block ends; they are then handled.

    A handler notes them rather than a blocked signal mask, which every child started in
    the block would inherit: such children ignore SIGTERM and only die by SIGKILL.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])  # now handled as it would have been
