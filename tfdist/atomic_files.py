"""Writing checkpoint files from several workers without races or broken files.

Keras 3's checkpoint callbacks have no notion of a chief: every worker writes the same
path (tensorflow#38635, #31070, #40374). As tf-keras 2 did, the chief writes the real
files while every other worker writes into a private temporary directory, which it
deletes right after; every worker still saves, so a save that needs every
worker never waits on one that skipped it. Writes are atomic: the file is written under
a temporary name in the same directory and moved into place with ``os.replace``, so a
worker killed mid-save leaves the previous complete file.

``tfdist.keras_fixes.callbacks`` uses these helpers to make Keras' own callbacks safe.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import tempfile
from typing import Callable, Iterator


def is_local(path: str) -> bool:
    """Whether ``path`` is on a local or mounted filesystem (where ``os.replace`` is atomic)."""
    return "://" not in str(path)


def atomic_write(write: Callable[[str], None], path: str) -> None:
    """Calls ``write(temp_path)`` and moves the result to ``path`` in one step.

    The temporary name keeps ``path``'s ending (Keras checks ``.keras``, ``.weights.h5``) and names this host and
    process, so writers on several hosts of a shared filesystem never meet. Leftovers of earlier interrupted writes
    to ``path`` by this host are removed first (not those of a process of this host that is still writing).
    """
    directory, name = os.path.split(os.path.abspath(path))
    for stale in glob.glob(os.path.join(glob.escape(directory), f".tmp{glob.escape(_HOST)}~*-{glob.escape(name)}")):
        if not _writer_alive(os.path.basename(stale)[len(f".tmp{_HOST}~"):-len(name) - 1]):
            with contextlib.suppress(FileNotFoundError):  # another writer removed it first
                os.remove(stale)
    temp = os.path.join(directory, f".tmp{_HOST}~{os.getpid()}-{name}")
    try:
        write(temp)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.remove(temp)


_HOST = socket.gethostname().replace("/", "_").replace("~", "_")


def _writer_alive(pid: str) -> bool:
    """Whether the process ``pid`` (a temporary file's writer) runs on this host (and is not this process)."""
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def write_text(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` atomically."""
    def write(temp: str) -> None:
        with open(temp, "w") as f:
            f.write(text)

    atomic_write(write, path)


@contextlib.contextmanager
def worker_directory(directory: str, rank: int) -> Iterator[str]:
    """Yields where worker ``rank`` writes: ``directory`` for rank 0, else a private temp dir deleted after.

    The temp dir is outside ``directory``, so code that lists the checkpoint directory
    (``max(os.listdir(d), key=...)``) never meets another worker's leftovers.
    """
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        yield directory
        return
    temp = tempfile.mkdtemp(prefix=f"tfdist-workertemp_{rank}-")
    try:
        yield temp
    finally:
        shutil.rmtree(temp, ignore_errors=True)
