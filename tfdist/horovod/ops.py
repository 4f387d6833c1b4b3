"""Horovod's collectives on tensors and Python objects: ``hvd.allreduce``, ``hvd.broadcast_object``, ...

A thin front over ``tfdist.process_group``: Horovod's signatures (``average``,
``device_dense``, ``name``, ``ignore_name_scope`` are accepted; names and devices do not
change what is computed) and Horovod's rules: ``root_rank`` is a global rank even with a
process set, ``op`` defaults to Average, Adasum is refused. Tensor collectives work eagerly
and inside ``tf.function``; the ``*_object`` functions and ``join`` are eager.
"""

from __future__ import annotations

import pickle
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tfdist.compression import Compression
from tfdist.horovod.basics import (REDUCE_OPS, Adasum, Average, Sum, _cluster, global_process_set, group_of,
                                   local_rank, local_size, rank, size)

ADASUM_MESSAGE = ("op=hvd.Adasum is not supported: tfdist.horovod reduces with TensorFlow's collectives, which have "
                  "no Adasum. Use op=hvd.Average (the default) with the learning rate scaled by hvd.size() and a "
                  "warmup (hvd.callbacks.LearningRateWarmupCallback).")


def check_op(op: Any, average: bool | None = None, allowed: Sequence[str] = REDUCE_OPS) -> str:
    """Horovod's ``op``/``average`` pair as a ``tfdist.process_group`` op name.

    Raises:
        ValueError: both given, Adasum, or an op outside ``allowed``.
    """
    if op is not None and average is not None:
        raise ValueError(f"Pass op= or the deprecated average=, not both; received op={op!r}, average={average!r}.")
    if op is None:
        op = Average if average in (None, True) else Sum
    if op == Adasum:
        raise ValueError(ADASUM_MESSAGE)
    if op not in allowed:
        names = {Average: "hvd.Average", Sum: "hvd.Sum", "min": "hvd.Min", "max": "hvd.Max", "product": "hvd.Product"}
        raise ValueError(f"Unknown op={op!r}; use one of {[names[o] for o in allowed if o in names]}.")
    return op


def _device(device_dense: str) -> str | None:
    """Horovod's ``device_dense`` ('', '/gpu:0', 'CPU') as "CPU", "GPU" or None (GPU when visible)."""
    lowered = (device_dense or "").lower()
    return "GPU" if "gpu" in lowered else "CPU" if "cpu" in lowered else None


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False) -> tf.Tensor:
    """Reduces ``tensor`` (same shape on every rank) over all ranks; Average by default.

    A ``tf.IndexedSlices`` is gathered instead (values and indices), as Horovod does.
    ``compression=hvd.Compression.fp16`` sends floats as float16.
    """
    op = check_op(op, average)
    group = group_of(process_set, "allreduce")

    def reduce(value):
        return group.allreduce(value, op, prescale_factor, postscale_factor, compression, device=_device(device_dense))

    if isinstance(tensor, tf.IndexedSlices) or op not in (Average, Sum):
        return reduce(tensor)
    # Differentiable as Horovod's: the gradient of an all-reduce is the same all-reduce of the gradients.
    return _with_gradient(reduce, reduce, tensor)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None) -> list:
    """``allreduce`` of a list of tensors, fused into one collective per dtype."""
    op = check_op(op, average)
    return group_of(process_set, "grouped_allreduce").grouped_allreduce(
        list(tensors), op, prescale_factor, postscale_factor, compression, device=_device(device_dense))


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set) -> tf.Tensor:
    """Concatenates every rank's ``tensor`` along the first axis (its length may differ per rank)."""
    group = group_of(process_set, "allgather")

    def backward(upstream, value):
        # This rank's rows of the gradients summed over all ranks (Horovod's allgather gradient).
        lengths = group.allgather(tf.shape(value)[:1])
        start = tf.reduce_sum(lengths[:group.rank])
        return group.allreduce(upstream, "sum")[start:start + lengths[group.rank]]

    return _with_gradient(group.allgather, backward, tensor, pass_input=True)


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set) -> list:
    """``allgather`` of each tensor in a list."""
    group = group_of(process_set, "grouped_allgather")
    return [group.allgather(t) for t in tensors]


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set) -> tf.Tensor:
    """Returns rank ``root_rank``'s ``tensor`` on every rank (same shape everywhere)."""
    group = group_of(process_set, "broadcast")
    root = group.root_index(root_rank)

    def backward(upstream):
        # Every rank's gradient flows to the root's input (Horovod's broadcast gradient).
        summed = group.allreduce(upstream, "sum")
        return summed if group.rank == root else summed * 0

    return _with_gradient(lambda value: group.broadcast(value, root), backward, tensor)


def broadcast_(variables, root_rank, name=None, process_set=global_process_set) -> list:
    """Assigns rank ``root_rank``'s values to ``variables`` in place; returns their new values."""
    broadcast_variables(variables, root_rank, process_set)
    return [tf.convert_to_tensor(v) for v in variables]


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False) -> None:
    """Assigns rank ``root_rank``'s values to ``variables`` on every rank (one collective per dtype)."""
    variables = list(variables)
    group = group_of(process_set, "broadcast_variables")
    values = group.grouped_broadcast([tf.convert_to_tensor(v) for v in variables], group.root_index(root_rank))
    for variable, value in zip(variables, values):
        variable.assign(value)


def broadcast_object(obj: Any, root_rank: int = 0, session=None, name=None, process_set=global_process_set) -> Any:
    """Returns rank ``root_rank``'s ``obj`` (anything picklable) on every rank. Eager only."""
    group = group_of(process_set, "broadcast_object")
    root = group.root_index(root_rank)
    payload = _to_bytes(obj) if group.rank == root else np.zeros(0, np.uint8)
    length = int(group.broadcast(tf.constant([payload.size], tf.int64), root).numpy()[0])
    if group.rank != root:
        payload = np.zeros(length, np.uint8)
    return _from_bytes(group.broadcast(tf.constant(payload), root).numpy())


def allgather_object(obj: Any, session=None, name=None, process_set=global_process_set) -> list:
    """Every rank's ``obj`` (anything picklable), as a list in rank order. Eager only."""
    group = group_of(process_set, "allgather_object")
    payload = _to_bytes(obj)
    lengths = group.allgather(tf.constant([payload.size], tf.int64)).numpy()
    gathered = group.allgather(tf.constant(payload)).numpy()
    return [_from_bytes(part) for part in np.split(gathered, np.cumsum(lengths)[:-1])]


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Sends rows ``splits[j]`` of ``tensor`` to rank j; returns what arrived (and, with ``splits``, the counts).

    Returns:
        The received rows in rank order; ``(rows, received_splits)`` when ``splits`` is given.
    """
    received, received_splits = group_of(process_set, "alltoall").alltoall(tensor, splits)
    return (received, received_splits) if splits is not None else received


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0) -> tf.Tensor:
    """Reduces ``tensor`` over all ranks and returns this rank's rows (the first ``rows % size`` ranks get one more)."""
    op = check_op(op, allowed=(Average, Sum, "min", "max", "product"))
    return group_of(process_set, "reducescatter").reducescatter(tensor, op, prescale_factor, postscale_factor,
                                                                compression)


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0) -> list:
    """``reducescatter`` of each tensor in a list."""
    op = check_op(op)
    group = group_of(process_set, "grouped_reducescatter")
    return [group.reducescatter(t, op, prescale_factor, postscale_factor, compression) for t in tensors]


def join() -> tf.Tensor:
    """Call when this rank has no more data: until every rank joined, it takes part in the others'
    gradient all-reduces with zeros (the average still divides by ``size()``, as Horovod's does).

    Returns the last rank to join, the same on every rank. Eager only; see ``tfdist.horovod.uneven``
    for what a joined rank stands in for.
    """
    from tfdist.horovod import uneven as join_lib

    return tf.constant(join_lib.join(group_of(global_process_set, "join")), tf.int32)


def size_op(process_set_id: int = 0, name=None) -> tf.Tensor:
    """``size()`` (or a registered process set's size) as a tensor."""
    from tfdist.horovod.basics import _state

    if process_set_id == 0:
        return tf.constant(size(), tf.int32)
    return tf.constant(len(_registered(_state, process_set_id).ranks), tf.int32)


def process_set_included_op(process_set_id: int = 0, name=None) -> tf.Tensor:
    """1 when this rank belongs to the process set, else 0, as a tensor."""
    from tfdist.horovod.basics import _state

    if process_set_id == 0:
        _cluster("process_set_included_op")
        return tf.constant(1, tf.int32)
    return tf.constant(int(rank() in _registered(_state, process_set_id).ranks), tf.int32)


def rank_op(name=None) -> tf.Tensor:
    """``rank()`` as a tensor."""
    return tf.constant(rank(), tf.int32)


def local_rank_op(name=None) -> tf.Tensor:
    """``local_rank()`` as a tensor."""
    return tf.constant(local_rank(), tf.int32)


def local_size_op(name=None) -> tf.Tensor:
    """``local_size()`` as a tensor."""
    return tf.constant(local_size(), tf.int32)


def _registered(state, process_set_id: int):
    _cluster("size_op")
    if process_set_id not in state.process_sets:
        raise ValueError(f"No process set with process_set_id={process_set_id} is registered; register it with "
                         "hvd.init(process_sets=[...]) or hvd.add_process_set(...).")
    return state.process_sets[process_set_id]


def _with_gradient(forward, backward, tensor, pass_input: bool = False):
    """``forward(tensor)``, differentiable with ``backward(upstream[, input])`` for floating-point tensors."""
    tensor = tf.convert_to_tensor(tensor)
    if not tensor.dtype.is_floating:
        return forward(tensor)

    @tf.custom_gradient
    def collective(value):
        return forward(value), (lambda upstream: backward(upstream, value)) if pass_input else backward

    return collective(tensor)



def _to_bytes(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)


def _from_bytes(array: np.ndarray) -> Any:
    return pickle.loads(array.tobytes())
