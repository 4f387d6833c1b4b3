"""Gradient buckets: which gradients share one all-reduce, so communication overlaps the backward pass.

Keras all-reduces every gradient in one pack after the whole backward pass. tfdist
instead splits them into buckets in reverse variable order (the order the backward pass
produces them, as PyTorch DDP does): a first bucket of about ``first_bucket_bytes``
holding the last layers, then buckets of about ``bucket_bytes``. Each bucket is one
all-reduce that depends only on its own gradients, so inside a ``tf.function`` it starts
while the earlier layers' gradients are still being computed. A gradient larger than a
bucket gets one of its own.

The plan is a pure function of the gradients' sizes and the two settings, so every worker
makes the same one: ``check_agreement`` compares the settings across workers once (one
eager all-gather when a step is first traced) and raises ``CollectiveMismatchError``
naming each worker's values, instead of mismatched all-reduces. Bucketing changes no result
with 2 workers (a sum of two numbers does not depend on packing); with more, the sums of
one element may be added in another order (float rounding), identically on every worker.

    tfdist.set_bucket_bytes(8 << 20)   # larger buckets: fewer, later all-reduces
    tfdist.set_bucket_bytes(0)         # one all-reduce after the backward pass (Keras' way)

``TFDIST_BUCKET_BYTES`` in the environment sets the process's starting value (``tfdist
run`` passes it to every worker, over ssh too). Without either, ``tfdist.autotune`` picks
the setting while ``fit`` runs (``use_tuned``); a setting of yours is never tuned.
"""

from __future__ import annotations

import os
from typing import Sequence

import tensorflow as tf

from tfdist import cluster
from tfdist.errors import CollectiveMismatchError

DEFAULT_BUCKET_BYTES = 4 << 20
# Measured (benchmarks/RESULTS.md, issue 22): a 256 KiB first bucket split a 0.6 MB float16 gradient in
# two and ran slower than one pack (a collective's fixed CPU cost outweighed the 5 ms it could hide).
DEFAULT_FIRST_BUCKET_BYTES = 1 << 20
ENV = cluster.ENV_BUCKET_BYTES

_settings: dict[str, int] = {}  # set_bucket_bytes' or the environment's: the user's, never tuned
_tuned: tuple[int, int] | None = None  # tfdist.autotune's, used when the user set nothing
_agreed: set[tuple] = set()  # (group ranks, sizes) already compared across the group


def set_bucket_bytes(bucket_bytes: int, first_bucket_bytes: int | None = None) -> None:
    """Sets this process's bucket sizes; 0 turns bucketing off (one all-reduce per step).

    Read when a training step is traced: call it before ``fit`` (or before the first
    call of your ``tf.function``), with the same values on every worker.

    Args:
        bucket_bytes: the size a bucket grows to before the next one starts; 0: one bucket.
        first_bucket_bytes: the first (last layers') bucket; default min(1 MiB, bucket_bytes).

    Raises:
        ValueError: a size that is not an int >= 0.
    """
    _check("bucket_bytes", bucket_bytes)
    first = min(DEFAULT_FIRST_BUCKET_BYTES, bucket_bytes) if first_bucket_bytes is None else first_bucket_bytes
    _check("first_bucket_bytes", first)
    _settings.update(bucket_bytes=bucket_bytes, first_bucket_bytes=first)


def bucket_sizes() -> tuple[int, int]:
    """(bucket_bytes, first_bucket_bytes) for this process: ``set_bucket_bytes``, the environment, autotune's
    choice, else the defaults."""
    if not explicit():
        return _tuned or (DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES)
    if not _settings:
        raw = os.environ[ENV].strip()
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{ENV}={raw!r} is not a whole number of bytes; set it to e.g. {DEFAULT_BUCKET_BYTES} "
                             "(4 MiB buckets) or 0 (one all-reduce per step), or unset it.") from None
        try:
            set_bucket_bytes(value)
        except ValueError as error:
            raise ValueError(f"{ENV}: {error}") from None
    return _settings["bucket_bytes"], _settings["first_bucket_bytes"]


def explicit() -> bool:
    """Whether the user chose the bucket sizes (``set_bucket_bytes`` or ``TFDIST_BUCKET_BYTES``): autotune keeps off."""
    return bool(_settings) or bool(os.environ.get(ENV, "").strip())


def use_tuned(bucket_bytes: int, first_bucket_bytes: int) -> None:
    """``tfdist.autotune``'s setting, used by steps traced from now on unless the user chose one."""
    global _tuned
    _tuned = (bucket_bytes, first_bucket_bytes)


def plan(sizes: Sequence[int], bucket_bytes: int | None = None,
         first_bucket_bytes: int | None = None, kinds: Sequence | None = None) -> list[list[int]]:
    """Indices of ``sizes`` (bytes per gradient, in variable order) grouped into buckets, in launch order.

    Buckets run from the last gradient to the first; each bucket's indices are ascending.
    With ``bucket_bytes`` 0 there is one bucket of every index. Defaults: ``bucket_sizes()``.
    ``kinds`` (e.g. each gradient's dtype) keeps gradients of different kinds in different
    buckets: one all-reduce concatenates its tensors, so a bucket holds one dtype. Each kind
    is planned on its own; the buckets launch by their last index, last first.
    """
    if bucket_bytes is None:
        bucket_bytes, first_bucket_bytes = bucket_sizes()
    if first_bucket_bytes is None:
        first_bucket_bytes = min(DEFAULT_FIRST_BUCKET_BYTES, bucket_bytes)
    kinds = [None] * len(sizes) if kinds is None else list(kinds)
    buckets = []
    for kind in dict.fromkeys(kinds):  # each kind once, in order of first appearance
        indices = [i for i, k in enumerate(kinds) if k == kind]
        buckets += [[indices[i] for i in bucket]
                    for bucket in _plan_one_kind([sizes[i] for i in indices], bucket_bytes, first_bucket_bytes)]
    return sorted(buckets, key=max, reverse=True)


def plan_tensors(tensors: Sequence) -> list[list[int]]:
    """``plan`` for tensors (or ``tf.IndexedSlices``): their sizes, one dtype per bucket, this process's settings."""
    return plan([nbytes(t) for t in tensors], kinds=[t.dtype for t in tensors])


def _plan_one_kind(sizes: Sequence[int], bucket_bytes: int, first_bucket_bytes: int) -> list[list[int]]:
    if bucket_bytes == 0 or not sizes:
        return [list(range(len(sizes)))] if sizes else []
    buckets, current, filled, limit = [], [], 0, first_bucket_bytes
    for index in reversed(range(len(sizes))):
        current.append(index)
        filled += sizes[index]
        if filled >= limit:
            buckets.append(sorted(current))
            current, filled, limit = [], 0, bucket_bytes
    if current:
        buckets.append(sorted(current))
    return buckets


def check_agreement(group) -> None:
    """Raises ``CollectiveMismatchError`` unless every member of ``group`` uses this process's bucket sizes.

    ``group`` is a ``tfdist.process_group.ProcessGroup``. One eager all-gather per group and
    setting: call it where every member plans its buckets (when a step is traced).
    """
    sizes = bucket_sizes()
    key = (group.ranks, sizes)
    if group.size <= 1 or key in _agreed:
        return
    with tf.init_scope():
        everyone = group.allgather(tf.constant([sizes], tf.int64), device="CPU").numpy().tolist()
    if any(row != everyone[0] for row in everyone):
        listing = "; ".join(f"rank {rank}: bucket_bytes={row[0]}, first_bucket_bytes={row[1]}"
                            for rank, row in enumerate(everyone))
        raise CollectiveMismatchError(
            f"Workers plan their gradient buckets with different sizes ({listing}), so their all-reduces would not "
            f"match. Call tfdist.set_bucket_bytes(...) with the same values on every worker, or set {ENV} the "
            "same for all of them.")
    _agreed.add(key)


def nbytes(tensor) -> int:
    """Bytes of a tensor with a known shape (0 when unknown: such a tensor joins the current bucket)."""
    count = tensor.shape.num_elements()
    return 0 if count is None else count * tensor.dtype.size


def _check(name: str, value) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise ValueError(f"{name} must be a whole number of bytes >= 0; received {name}={value!r}. "
                         f"For example {DEFAULT_BUCKET_BYTES} (4 MiB), or 0 for one all-reduce per step.")
