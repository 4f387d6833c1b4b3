"""Who writes what in a checkpoint, and where a replica's shard comes from when it is read back.

Pure arithmetic on sizes (no TensorFlow): every worker computes the same answers from the same
model, so no worker needs to ask another what it wrote.
"""

from __future__ import annotations

import math


def owners(nbytes: list[int], workers: int) -> list[int]:
    """The worker that writes each whole variable: the largest first, each to the worker with the fewest bytes
    so far (ties: the lowest rank), so every worker writes about 1/``workers`` of the bytes."""
    load = [0] * workers
    owner = [0] * len(nbytes)
    for index in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        worker = min(range(workers), key=lambda w: (load[w], w))
        owner[index], load[worker] = worker, load[worker] + nbytes[index]
    return owner


def shard_size(size: int, replicas: int) -> int:
    """Elements in each replica's shard of a flattened variable of ``size`` elements (the last one padded)."""
    return math.ceil(size / replicas)


def shard_range(replica: int, replicas: int, size: int) -> tuple[int, int]:
    """The elements ``[start, stop)`` of the flattened variable that ``replica`` holds (stop <= size)."""
    width = shard_size(size, replicas)
    return min(replica * width, size), min((replica + 1) * width, size)


def pieces(start: int, stop: int, saved_replicas: int, size: int) -> list[tuple[int, int, int]]:
    """Where elements ``[start, stop)`` lie among ``saved_replicas`` saved shards: ``(replica, lo, hi)``, each
    ``[lo, hi)`` of that replica's shard, in order."""
    width = shard_size(size, saved_replicas)
    found = []
    for replica in range(start // width if width else 0, saved_replicas):
        first, last = replica * width, min((replica + 1) * width, size)
        if first >= stop:
            break
        lo, hi = max(start, first), min(stop, last)
        if lo < hi:
            found.append((replica, lo - first, hi - first))
    return found
