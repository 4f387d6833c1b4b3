"""Worker output: each line prefixed with the worker's index, TensorFlow's start-up noise dropped.

TensorFlow prints dozens of C++ log lines as each worker starts (oneDNN, CUDA stubs,
the coordination service), some of them before its own log level is read. Unless the
user asked for them (``--tf-logs``, or their own ``TF_CPP_MIN_LOG_LEVEL``), the
launcher sets ``TF_CPP_MIN_LOG_LEVEL=2`` and drops what still gets through: INFO and
WARNING lines in TensorFlow's C++ format, and the cuInit error of a machine that has
no CUDA driver at all. Errors and everything Python prints are kept.

Output never holds up a job: ``pump`` reads at most ``CHUNK`` bytes at a time (a progress
bar with no newline is relayed in pieces, never buffered whole), and ``tfdist run`` writes
through a ``Sink``, which drops what a slow or departed reader (``| head``) cannot take,
saying so once on stderr, so the workers' pipes are always read.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import threading
from typing import IO

CHUNK = 64 * 1024  # the most of one line relayed at once
BUFFERED = 16 * 1024 * 1024  # what a Sink holds for a slow reader before it drops output

# glog-style INFO/WARNING lines: "I0000 00:00:1795400470.056422   20822 port.cc:153] ..."
_CPP_INFO_OR_WARNING = re.compile(rb"^[IW]\d{4} \d\d:\d\d:[\d.]+ +\d+ [\w./-]+:\d+\] ")
_ABSL_PREAMBLE = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_NO_CUDA_DRIVER = b"Could not find cuda drivers on your machine"
_CUINIT_ERROR = b"failed call to cuInit"


class StartupNoiseFilter:
    """Decides, line by line, what of one worker's output to keep."""

    def __init__(self) -> None:
        self.no_cuda_driver = False

    def keep(self, line: bytes) -> bool:
        if _NO_CUDA_DRIVER in line:
            self.no_cuda_driver = True  # so the cuInit "error" that follows is expected
        if line.rstrip(b"\r\n") == _ABSL_PREAMBLE or _CPP_INFO_OR_WARNING.match(line):
            return False
        return not (self.no_cuda_driver and _CUINIT_ERROR in line)


class _KeepAll:
    def keep(self, line: bytes) -> bool:
        return True


def line_filter(hide_tf_logs: bool):
    """A fresh per-worker filter: StartupNoiseFilter, or one that keeps every line."""
    return StartupNoiseFilter() if hide_tf_logs else _KeepAll()


def pump(stream: IO[bytes], prefix: str, out: IO[bytes], lock: threading.Lock, hide_tf_logs: bool,
         on_line=None) -> None:
    """Copies ``stream`` to ``out`` line by line (``CHUNK`` bytes at most) with ``prefix``; ``on_line(line)`` sees each."""
    keep = line_filter(hide_tf_logs).keep
    head = prefix.encode()
    for line in iter(lambda: stream.readline(CHUNK), b""):
        if on_line is not None:
            on_line(line)
        if not keep(line):
            continue
        with lock:
            out.write(head + line if line.endswith(b"\n") else head + line + b"\n")
            out.flush()
    stream.close()


def say(out: IO[bytes], message: str, who: str = "tfdist run") -> None:
    """A launcher line: ``tfdist run: message`` (``who`` names a node of a multi-node job)."""
    out.write(f"{who}: {message}\n".encode())
    out.flush()


class Sink:
    """A binary stream for the launcher's output: a thread drains a bounded buffer into ``out``.

    ``write`` never waits for the reader of ``out``: what does not fit in ``limit`` bytes is
    dropped, and once the reader has gone (a broken pipe) everything is, the job going on;
    each is said once on stderr. ``close`` lets what is buffered out (for a few seconds).
    """

    def __init__(self, out: IO[bytes], limit: int = BUFFERED):
        self.out, self.limit = out, limit
        self.pending: collections.deque = collections.deque()
        self.size = 0  # buffered or being written
        self.gone = False
        self.noted: set[str] = set()
        self.changed = threading.Condition()
        threading.Thread(target=self._drain, daemon=True, name="tfdist-output").start()

    def write(self, data: bytes) -> int:
        with self.changed:
            if self.gone:
                return len(data)
            if self.size + len(data) > self.limit:
                self._note("slow", "the reader of this output is slower than the workers; dropping what does not "
                                   f"fit in {self.limit >> 20} MiB of buffer (the job goes on)")
                return len(data)
            self.pending.append(data)
            self.size += len(data)
            self.changed.notify_all()
        return len(data)

    def flush(self) -> None:
        """Nothing to do: the draining thread flushes ``out`` after every write."""

    def close(self, timeout: float = 5.0) -> None:
        with self.changed:
            self.changed.wait_for(lambda: self.size == 0 or self.gone, timeout=timeout)

    def _drain(self) -> None:
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.pending)
                data = b"".join(self.pending)
                self.pending.clear()
            try:
                self.out.write(data)
                self.out.flush()
            except (OSError, ValueError) as err:
                self._reader_gone(err)
            with self.changed:
                self.size -= len(data)
                self.changed.notify_all()

    def _reader_gone(self, err: Exception) -> None:
        with self.changed:
            self.gone = True
            self.size -= sum(map(len, self.pending))
            self.pending.clear()
            self._note("gone", f"the reader of this output went away ({getattr(err, 'strerror', None) or err}); "
                               "dropping the rest of it (the job goes on)")
        try:  # so that nothing written later (Python's own flush at exit) fails on the broken pipe
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.out.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass

    def _note(self, kind: str, message: str) -> None:
        if kind in self.noted:
            return
        self.noted.add(kind)
        try:
            sys.stderr.write(f"tfdist run: {message}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
