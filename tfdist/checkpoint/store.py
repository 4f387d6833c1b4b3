"""A checkpoint directory on disk: each worker's part, the manifest, the commit, and retention.

    DIRECTORY/
      step-120/              a committed checkpoint (the chief renamed it into place last)
        manifest.json        what each variable is and which part holds it
        part-0.npz ...       one file per worker: the variables it owns, its replicas' shards
      step-120.aside/        step 120's older save while a new one of that step commits (read while step-120 is not)
      .partial-<id>/         a checkpoint being written (or one whose writer died): never read
      .owner                 the manager that writes here now

A part is written under a temporary name, flushed to disk (fsync) and renamed; the chief writes the
manifest the same way once every part is there, then renames the partial directory to ``step-N``:
that rename is the commit. A reader lists ``step-*`` directories with a manifest, so a crash at any
moment leaves the previous checkpoint the latest.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from typing import Any

import numpy as np

MANIFEST = "manifest.json"
OWNER = ".owner"
_ASIDE = ".aside"
_STEP = re.compile(r"^step-(\d+)(?:\.aside)?$")


def check_directory(directory: str) -> str:
    """``directory`` made absolute; a ValueError for a URL (renames there are not atomic)."""
    if "://" in str(directory):
        raise ValueError(f"CheckpointManager writes to a local or mounted filesystem (it commits by renaming a "
                         f"directory); received directory={directory!r}: mount it (e.g. gcsfuse) or use a local "
                         "path.")
    return os.path.abspath(str(directory))


def partial_dir(directory: str, token: str, save_id: int) -> str:
    return os.path.join(directory, f".partial-{token}-{save_id}")


def part_path(checkpoint: str, worker: int) -> str:
    return os.path.join(checkpoint, f"part-{worker}.npz")


def write_part(checkpoint: str, worker: int, arrays: dict[str, Any]) -> None:
    """Writes this worker's arrays (or tensors), flushed to disk, as ``part-<worker>.npz`` (atomically)."""
    os.makedirs(checkpoint, exist_ok=True)
    path = part_path(checkpoint, worker)
    temp = f"{path}.tmp{os.getpid()}"
    try:
        with open(temp, "wb") as file:
            np.savez(file, **arrays)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)
    _sync_directory(checkpoint)


def commit(partial: str, directory: str, step: int, manifest: dict[str, Any]) -> str:
    """Writes the manifest into ``partial`` and renames it to ``step-<step>`` (replacing an older one of that
    step); returns the committed path."""
    temp = os.path.join(partial, MANIFEST + ".tmp")
    with open(temp, "w") as file:
        json.dump(manifest, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temp, os.path.join(partial, MANIFEST))
    _sync_directory(partial)
    final = os.path.join(directory, f"step-{step}")
    aside = final + _ASIDE
    if os.path.exists(final):  # the same step saved again: the old one moves aside (still read), then goes
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        _sync_directory(directory)
    os.replace(partial, final)
    _sync_directory(directory)
    shutil.rmtree(aside, ignore_errors=True)
    return final


def committed(directory: str) -> list[tuple[int, str]]:
    """Every committed checkpoint under ``directory``: (step, path), oldest first. A ``step-N.aside`` (the step's
    older save, moved aside while a new one of that step commits) counts while ``step-N`` is missing."""
    if not os.path.isdir(directory):
        return []
    found: dict[int, str] = {}
    for name in sorted(os.listdir(directory), key=lambda n: n.endswith(_ASIDE)):  # step-N first
        match = _STEP.match(name)
        path = os.path.join(directory, name)
        if match and os.path.exists(os.path.join(path, MANIFEST)):
            found.setdefault(int(match.group(1)), path)
    return sorted(found.items())


def read_manifest(checkpoint: str) -> dict[str, Any]:
    with open(os.path.join(checkpoint, MANIFEST)) as file:
        return json.load(file)


def keep_newest(directory: str, count: int) -> None:
    """Removes committed checkpoints but the newest ``count`` (with what a crash left aside of their steps)."""
    for step, _ in committed(directory)[:-count] if count > 0 else []:
        for name in (f"step-{step}", f"step-{step}{_ASIDE}"):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def remove_partials(directory: str, token: str, before: int) -> None:
    """Removes this manager's partial directories of saves before ``before`` (saves that did not commit)."""
    prefix = f".partial-{token}-"
    for name in os.listdir(directory):
        if name.startswith(prefix) and name[len(prefix):].isdigit() and int(name[len(prefix):]) < before:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def claim(directory: str, token: str) -> None:
    """Records ``token`` as the manager that writes ``directory`` now, and removes the partial checkpoints other
    managers left (a killed run's: one still writing fails its commit, as ``token`` owns the directory)."""
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        if name.startswith(".partial-") and not name.startswith(f".partial-{token}-"):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    temp = os.path.join(directory, f"{OWNER}.tmp{os.getpid()}")
    with open(temp, "w") as file:
        file.write(token)
    os.replace(temp, os.path.join(directory, OWNER))


def owner(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, OWNER)) as file:
            return file.read().strip()
    except FileNotFoundError:
        return None


def _sync_directory(path: str) -> None:
    """Flushes a directory's entries (a rename, a new file) to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
