"""Eager collectives across every worker of the job: allreduce, allgather, broadcast.

Horovod's ``hvd.allreduce`` and friends for Python numbers and NumPy arrays, built on the
job's ``tfdist.process_group``: a *rank* is a worker process (``tfdist.rank()``), as in
Horovod, and each worker counts once however many devices it drives. Every worker must
make the same calls in the same order (they are collectives); a call whose shapes differ
between workers fails on every worker with ``CollectiveMismatchError``.

Values may be Python numbers, NumPy arrays or tensors; the result comes back as the same
kind. Integers travel as float64 (exact up to 2**53), floats in their own dtype. For
tensors inside ``tf.function`` and Horovod's full set of collectives, see
``tfdist.process_group`` and ``tfdist.horovod``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tfdist import cluster as cluster_lib
from tfdist import process_group, state
from tfdist import strategy as strategy_lib
from tfdist.process_group import ProcessGroup, num_workers, worker_rank  # noqa: F401  (re-exported)

REDUCE_OPS = ("mean", "sum")  # the eager helpers' subset of process_group.REDUCE_OPS


def job_group(strategy: tf.distribute.Strategy | None = None) -> ProcessGroup:
    """The group of every worker process of the job (or of ``strategy``'s workers).

    In a multi-worker job with no strategy yet, builds the job's MultiWorkerMirroredStrategy
    (which sets up the collective runtime); ``tfdist.strategy.StrategyError`` says why
    when TensorFlow already started without it.
    """
    if strategy is None:
        strategy = state.current_strategy()
        if strategy is None and cluster_lib.cluster_from_env().is_multi_worker:
            strategy = strategy_lib.get_strategy()
        strategy = strategy or tf.distribute.get_strategy()
    return process_group.for_strategy(strategy)


def allreduce(value: Any, op: str = "mean", strategy: tf.distribute.Strategy | None = None) -> Any:
    """Sums or averages ``value`` over all workers; every worker gets the result.

    Args:
        value: a number, NumPy array or tensor, with the same shape on every worker.
        op: "mean" or "sum".
        strategy: the strategy whose workers take part; None: the process's strategy.

    Returns:
        The reduced value, as the same kind as ``value``. A mean of integers is float64.

    Raises:
        ValueError: ``op`` is not "mean" or "sum".
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"allreduce op must be one of {REDUCE_OPS}; received op={op!r}.")
    group = job_group(strategy)
    array, kind = _to_array(value)
    total = group.allreduce(_wire(array), op="sum", device="CPU").numpy()
    if op == "sum":
        return _from_array(total.astype(array.dtype), kind)
    mean = total / group.size
    return _from_array(mean.astype(array.dtype if _is_float(array.dtype) else np.float64), kind)


def broadcast(value: Any, root_rank: int = 0, strategy: tf.distribute.Strategy | None = None) -> Any:
    """Returns worker ``root_rank``'s ``value`` on every worker (exactly, bit for bit).

    Raises:
        ValueError: ``root_rank`` is not a worker of this job.
    """
    array, kind = _to_array(value)
    (result,) = broadcast_arrays([array], root_rank, strategy)
    return _from_array(result, kind)


def broadcast_arrays(arrays: Sequence[np.ndarray], root_rank: int = 0,
                     strategy: tf.distribute.Strategy | None = None) -> list[np.ndarray]:
    """Broadcasts several arrays from ``root_rank`` in one collective; dtypes are kept."""
    group = job_group(strategy)
    root_rank = group.root_index(root_rank)
    arrays = [np.asarray(a) for a in arrays]
    results = group.grouped_broadcast([tf.constant(a) for a in arrays], root_rank, device="CPU")
    return [r.numpy().astype(a.dtype) for r, a in zip(results, arrays)]


def allgather(value: Any, strategy: tf.distribute.Strategy | None = None) -> Any:
    """Concatenates every worker's ``value`` along the first axis, in rank order.

    Workers may contribute different first-dimension lengths; the other dimensions
    must match. A scalar counts as one row, so ``allgather(tfdist.rank())`` is
    ``[0, 1, ...]``.
    """
    array, kind = _to_array(value)
    result = job_group(strategy).allgather(_wire(array), device="CPU").numpy()
    return _from_array(result.astype(array.dtype), kind)


def barrier(strategy: tf.distribute.Strategy | None = None) -> None:
    """Returns once every worker has called it."""
    job_group(strategy).barrier()


def _is_float(dtype) -> bool:
    return np.issubdtype(dtype, np.floating)


def _to_array(value: Any) -> tuple[np.ndarray, str]:
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return np.asarray(value.numpy()), "tensor"
    if isinstance(value, np.ndarray):
        return value, "numpy"
    if isinstance(value, (bool, int, float, np.generic)):
        return np.asarray(value), "python"
    raise TypeError(f"tfdist collectives take a number, NumPy array or tensor; received "
                    f"{type(value).__name__}: {value!r}.")


def _from_array(array: np.ndarray, kind: str) -> Any:
    if kind == "tensor":
        return tf.convert_to_tensor(array)
    if kind == "python":
        return array.tolist()  # a number, or a list of them (allgather)
    return array


def _wire(array: np.ndarray) -> tf.Tensor:
    """The tensor a value travels as: floats as themselves, everything else as float64."""
    return tf.constant(array if _is_float(array.dtype) else array.astype(np.float64))
