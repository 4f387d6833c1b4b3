"""The stop signals of a worker process: which they are, how they reach tfdist, and their default action.

``TFDIST_STOP_SIGNALS`` names them (default SIGTERM,SIGUSR1; "" none), ``TFDIST_GRACE_PERIOD``
says how long a worker has after one (every launcher sets it from ``--grace-period``; default
25 s). ``Watcher`` installs a handler for each and hands every arrival to ``on_signal`` in two
ways: from the handler, which Python runs in the main thread between bytecodes (late when the
main thread waits inside TensorFlow), and at once from a thread of tfdist's that reads the byte
the C-level handler writes to a wake-up pipe (``signal.set_wakeup_fd``; not when another
library, an asyncio loop, holds it). ``on_signal`` may so run twice for one arrival.
``default_action`` ends the process as the signal would have without tfdist, from any thread.
Once ``exiting`` is called (the process leaves with an exit code of its own: the hang watchdog's,
an agreed stop's), stop signals are dropped and take no default action, so that code is the one
the launcher reads.
A process forked from a worker gets every stop signal's default action back at the fork.

Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
from typing import Callable, Mapping

from tfdist import cluster

ENV_SIGNALS = cluster.ENV_STOP_SIGNALS
DEFAULT_SIGNALS = "SIGTERM,SIGUSR1"
_libc = ctypes.CDLL(None)  # loaded now: a thread may need libc's signal() late
_exiting = threading.Event()


def signals_from_env(environ: Mapping[str, str] | None = None) -> tuple[signal.Signals, ...]:
    """The stop signals ``TFDIST_STOP_SIGNALS`` names (default SIGTERM,SIGUSR1; "" none).

    Raises:
        ValueError: a name that is not a signal.
    """
    raw = (os.environ if environ is None else environ).get(ENV_SIGNALS, DEFAULT_SIGNALS)
    found = []
    for name in filter(None, (part.strip().upper() for part in raw.split(","))):
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name not in signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP"):
            raise ValueError(f"{ENV_SIGNALS}={raw!r}: {name} is not a signal a process can catch; give names "
                             f"such as {DEFAULT_SIGNALS} (the default), or '' to keep each signal's default action.")
        found.append(signal.Signals[name])
    return tuple(found)


def grace_from_env(environ: Mapping[str, str] | None = None) -> float:
    """The grace period ``TFDIST_GRACE_PERIOD`` gives (seconds; default 25).

    Raises:
        ValueError: not a number of seconds >= 0.
    """
    raw = (os.environ if environ is None else environ).get(cluster.ENV_GRACE_PERIOD, "").strip()
    if not raw:
        return cluster.DEFAULT_GRACE_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(f"{cluster.ENV_GRACE_PERIOD}={raw!r} is not a number of seconds: set it to the time between "
                         f"a stop signal and SIGKILL, e.g. {cluster.DEFAULT_GRACE_SECONDS:g} (tfdist run "
                         "--grace-period sets it).")
    return value


class Watcher:
    """Delivers this process's stop signals to ``on_signal(signum)`` (main thread only: ``start``)."""

    def __init__(self, signals: tuple[signal.Signals, ...], on_signal: Callable[[int], None]):
        self.signals, self.on_signal = signals, on_signal
        self.wakeup: int | None = None  # the read end of the wake-up pipe, when this process got it
        self.forked = False

    def start(self) -> None:
        for sig in self.signals:
            signal.signal(sig, lambda signum, frame: self._deliver(signum))
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        if signal.set_wakeup_fd(write, warn_on_full_buffer=False) == -1:
            self.wakeup = read
        else:  # another library's wake-up fd (an asyncio loop): leave it, the handlers still deliver
            signal.set_wakeup_fd(-1)
            os.close(read)
            os.close(write)
        os.register_at_fork(after_in_child=self._in_child)

    def wait(self, seconds: float) -> None:
        """Waits up to ``seconds`` for a signal to arrive, handing each one that did to ``on_signal``."""
        if self.wakeup is None:
            threading.Event().wait(seconds)
            return
        if select.select([self.wakeup], [], [], seconds)[0]:
            try:
                arrived = os.read(self.wakeup, 64)
            except BlockingIOError:
                return
            for signum in arrived:
                if signum in self.signals:
                    self._deliver(signum)

    def _deliver(self, signum: int) -> None:
        if not _exiting.is_set():
            self.on_signal(signum)

    def _in_child(self) -> None:
        self.forked = True
        if self.wakeup is not None:
            signal.set_wakeup_fd(-1)
        for sig in self.signals:
            signal.signal(sig, signal.SIG_DFL)


def exiting() -> None:
    """This process leaves now with an exit code of its own: stop signals are dropped from here on."""
    _exiting.set()


def default_action(signum: int) -> None:
    """Ends this process as ``signum`` would have without tfdist's handler (from any thread); nothing once
    ``exiting`` was called."""
    if _exiting.is_set():
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_DFL)
    else:  # only the main thread may use the signal module
        _libc.signal(int(signum), 0)  # SIG_DFL
    os.kill(os.getpid(), signum)
