"""Tensor collectives among the job's worker processes, eagerly or inside ``tf.function``.

Horovod's view of a job: each worker process is one rank, trains its own model outside
any strategy, and a collective combines one tensor from every rank. ``ProcessGroup`` runs
those collectives on TensorFlow's own collective ops (``all_reduce_v2``, ``all_gather_v2``,
``broadcast_send_v2``/``broadcast_recv_v2``, ``all_to_all_v2``: a ring over gRPC between
CPUs, NCCL between GPUs where TensorFlow picks it), in the collective runtime that the job's
MultiWorkerMirroredStrategy set up (tfdist builds it just before TensorFlow's first op).
Nothing here enters that strategy: the tensors are the process's own. With one process,
every collective is local arithmetic.

Keys. TensorFlow matches the members of a collective by group key and instance key. The
group key is fixed per group and device type; instance keys come from a per-group counter
in call order: one per eager call, and one per call site each time a ``tf.function`` is
traced (the trace reuses it every step). So every rank must make the same collective calls
in the same order, as with Horovod. A ``KeyCache`` keeps the keys of a caller that reduces
the same tensors every step (an optimizer's gradients, the gathers of its sparse gradients)
stable across retraces: a rank that alone traces a step again (its partial last batch has
another shape) must not take new keys, or its collectives and every later one would miss the
other ranks'. A caller made anew in each trace (a ``DistributedGradientTape`` created inside
the step) gets its caches from ``trace_key_caches``, by a name every rank computes alike.
Eager calls take fresh keys, in call order, cached or not.

Checks. In eager code every call first gathers each rank's call, shapes and dtypes, and
raises ``CollectiveMismatchError`` on every rank when they differ (TensorFlow alone fails
on one rank and leaves the others waiting for their timeout). Inside a ``tf.function``
nothing is checked: shapes there are the model's, the same on every rank.
"""

from __future__ import annotations

import itertools
import threading
import weakref
import zlib
from typing import Any, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import collective_ops, resource_variable_ops

from tfdist import compression as compression_lib
from tfdist import fusion, watchdog
from tfdist.errors import CollectiveMismatchError

REDUCE_OPS = ("mean", "sum", "min", "max", "product")
_MERGE_OPS = {"sum": "Add", "mean": "Add", "min": "Min", "max": "Max", "product": "Mul"}
_KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "barrier")
# Far above the small keys tf.distribute strategies count up from. A group's key lies in
# [_GROUP_KEY_BASE, _GROUP_KEY_BASE + _LANE_STRIDE); its lanes' keys above, one stride each.
_GROUP_KEY_BASE = 1 << 29
_LANE_STRIDE = 1 << 21
_MAX_LANES = 63
SYNC_BATCH_NORM_LANE = 1  # synchronized BatchNormalization's all-reduces (tfdist.horovod and Keras')
_INSTANCE_KEY_BASE = 1 << 30
_SIGNATURE_DIMS = 8

Tensorish = Any  # a tf.Tensor, tf.Variable, NumPy array or number


class KeyCache:
    """Instance keys that stay the same when a ``tf.function`` is traced again.

    One per caller that reduces the same tensors every step (an optimizer): a retrace on
    one rank only (a partial last batch, say) then still meets the other ranks' collective.
    """

    def __init__(self):
        self._keys: dict[tuple, int] = {}

    def key(self, group: "ProcessGroup", slot: tuple) -> int:
        """The instance key of ``slot`` in ``group``, allocated on first use."""
        full = (group.group_key_base, *slot)
        if full not in self._keys:
            self._keys[full] = group.new_instance_key()
        return self._keys[full]


# (*name, occurrence) -> {number: KeyCache}: the caches of callers made anew in every trace.
_trace_caches: dict[tuple, dict[int, KeyCache]] = {}
_trace_counts: "weakref.WeakKeyDictionary[tf.Graph, dict]" = weakref.WeakKeyDictionary()


def trace_key_caches(name: tuple) -> tuple[tuple, dict[int, KeyCache]]:
    """The name and key caches of the next caller called ``name`` in the function being traced.

    For a caller made anew in every trace (a ``DistributedGradientTape`` created inside the
    step): ``name`` (its options, its gradients' shapes and dtypes) must read the same on
    every rank. The n-th caller of a name in one trace is named ``(*name, n)`` and gets the
    caches of that name, the same in every trace; two in one step never share a key. The
    caller keeps its own ``KeyCache`` per number there (its buckets).
    """
    counts = _trace_counts.setdefault(tf.compat.v1.get_default_graph(), {})
    counts[name] = counts.get(name, -1) + 1
    full = (*name, counts[name])
    return full, _trace_caches.setdefault(full, {})


class ProcessGroup:
    """Some (usually all) of the job's worker processes, as one collective group.

    Attributes:
        ranks: the job ranks in the group, ascending.
        rank: this process's index in ``ranks`` (None when it is not a member).
        size: number of processes in the group.
    """

    def __init__(self, ranks: Sequence[int], my_job_rank: int, timeout: float | None = None, hint: str = "auto"):
        self.ranks = tuple(sorted(ranks))
        self.rank = self.ranks.index(my_job_rank) if my_job_rank in self.ranks else None
        self.size = len(self.ranks)
        self._timeout = float(timeout or 0)
        self._hint = hint.lower()
        self.group_key_base = _GROUP_KEY_BASE + 2 * (zlib.crc32(repr(self.ranks).encode()) % (_LANE_STRIDE // 2))
        self._counter = itertools.count(_INSTANCE_KEY_BASE)
        self._lock = threading.Lock()
        self._tokens: dict[str, tf.Variable] = {}
        self._lanes: dict[int, "ProcessGroup"] = {}

    def __repr__(self) -> str:
        return f"ProcessGroup(ranks={list(self.ranks)}, rank={self.rank})"

    def subgroup(self, job_ranks: Sequence[int]) -> "ProcessGroup":
        """A group of some of this group's job ranks, with the same timeout and transport."""
        return ProcessGroup(job_ranks, self.ranks[self.rank] if self.rank is not None else -1,
                            self._timeout, self._hint)

    def lane(self, number: int) -> "ProcessGroup":
        """The same ranks on a group key and ordering token of their own (``number`` 1 to 63).

        Inside a tf.function this group's collectives run in program order, each after the
        one before (the ordering token); a lane's collectives are ordered among themselves
        only. A layer whose collectives sit in the backward pass (SyncBatchNormalization)
        uses a lane, so the gradient all-reduces created after the backward pass do not
        wait for them. Instance keys come from this group's counter.
        """
        if not (isinstance(number, int) and 1 <= number <= _MAX_LANES):
            raise ValueError(f"lane number must be an int from 1 to {_MAX_LANES}; received {number!r}.")
        if number not in self._lanes:
            lane = ProcessGroup.__new__(ProcessGroup)
            lane.__dict__.update(self.__dict__)  # same ranks, timeout, transport, key counter and lock
            lane.group_key_base = self.group_key_base + number * _LANE_STRIDE
            lane._tokens, lane._lanes = {}, {}
            self._lanes[number] = lane
        return self._lanes[number]

    def new_instance_key(self) -> int:
        """The next instance key of this group (every rank allocates in the same order)."""
        with self._lock:
            return next(self._counter)

    # Reductions ------------------------------------------------------------------------------

    @watchdog.watched
    def allreduce(self, tensor: Tensorish, op: str = "sum", prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, compression=None, device: str | None = None) -> tf.Tensor:
        """Reduces ``tensor`` over the group; every member gets the result.

        Args:
            tensor: the same shape and dtype on every rank (a ``tf.IndexedSlices`` is
                gathered instead, as Horovod does; only "sum" and "mean").
            op: one of ``REDUCE_OPS``.
            prescale_factor: multiplies each rank's tensor before the reduction.
            postscale_factor: multiplies the result.
            compression: ``tfdist.compression.Compression.none`` (default) or ``.fp16``.
            device: where the collective runs ("CPU" or "GPU"); None: GPU when visible.

        Returns:
            The reduced tensor, in ``tensor``'s dtype (a mean of integers is float64).
        """
        return self.grouped_allreduce([tensor], op, prescale_factor, postscale_factor, compression,
                                      device=device)[0]

    @watchdog.watched
    def grouped_allreduce(self, tensors: Sequence[Tensorish], op: str = "sum", prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, compression=None, keys: KeyCache | None = None,
                          device: str | None = None) -> list:
        """``allreduce`` of several tensors, fused: one collective per wire dtype.

        Args:
            keys: a ``KeyCache`` to reuse instance keys across retraces (see the module).
            Others: as ``allreduce``.
        """
        _check_op(op)
        compression = compression_lib.check(compression or compression_lib.Compression.none)
        tensors = [t if isinstance(t, tf.IndexedSlices) else tf.convert_to_tensor(t) for t in tensors]
        self._check_member("allreduce")
        dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
        if tf.executing_eagerly() and self.size > 1:
            self._agree("allreduce", [tensors[i] for i in dense], op=op)
        results: list = [None] * len(tensors)
        for i, tensor in enumerate(tensors):
            if isinstance(tensor, tf.IndexedSlices):
                results[i] = self._reduce_sparse(tensor, op, prescale_factor * postscale_factor, keys, ("sparse", i))
        scaled = [_scale(tensors[i], prescale_factor) for i in dense]
        reduced = self._reduce_dense(scaled, op, compression, keys, device)
        for i, tensor in zip(dense, reduced):
            if op == "mean":
                tensor = _divide(tensor, self.size)
            results[i] = _scale(tensor, postscale_factor)
        return results

    def differentiable_sum(self, tensor: tf.Tensor, keys: tuple = (None, None)) -> tf.Tensor:
        """The sum of ``tensor`` over the group; its gradient is the upstream gradient summed over the group.

        Args:
            keys: ``KeyCache``s (or None) for the forward and the backward all-reduce.
        """
        @tf.custom_gradient
        def summed(x):
            def grad(upstream):
                return self.grouped_allreduce([upstream], "sum", keys=keys[1])[0]

            return self.grouped_allreduce([x], "sum", keys=keys[0])[0], grad

        return summed(tensor)

    @watchdog.watched
    def reducescatter(self, tensor: Tensorish, op: str = "mean", prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, compression=None) -> tf.Tensor:
        """Reduces ``tensor`` and returns this rank's rows of the result.

        Rows are split as evenly as possible, in rank order; the first ``rows % size``
        ranks get one row more (Horovod's split). Moves the whole tensor (an all-reduce,
        then a slice), not a true reduce-scatter.
        """
        tensor = tf.convert_to_tensor(tensor)
        if tensor.shape.rank == 0:
            raise ValueError("reducescatter splits the first dimension, so it needs a tensor of rank >= 1; "
                             "received a scalar.")
        reduced = self.allreduce(tensor, op, prescale_factor, postscale_factor, compression)
        rows = tf.shape(tensor)[0]
        base, extra = rows // self.size, rows % self.size
        start = self.rank * base + tf.minimum(self.rank, extra)
        length = base + tf.cast(self.rank < extra, rows.dtype)
        return reduced[start:start + length]

    # Moving data -----------------------------------------------------------------------------

    @watchdog.watched
    def allgather(self, tensor: Tensorish, device: str | None = None) -> tf.Tensor:
        """Concatenates every rank's ``tensor`` along the first axis, in rank order.

        The first dimension may differ per rank; the others and the dtype must match.
        A scalar counts as one row.
        """
        return self._allgather(tf.convert_to_tensor(tensor), device)

    def _allgather(self, tensor: tf.Tensor, device: str | None, keys: KeyCache | None = None,
                   slot: tuple = ()) -> tf.Tensor:
        """``allgather``; inside a tf.function its two collectives take their keys from ``keys`` (at ``slot``)."""
        if tensor.shape.rank == 0:
            tensor = tf.reshape(tensor, [1])
        self._check_member("allgather")
        if self.size == 1:
            return tensor
        if tf.executing_eagerly():
            lengths = [shapes[0][0] for shapes in self._agree("allgather", [tensor], first_dim_free=True)]
            if len(set(lengths)) == 1:
                return self._gather(tensor, device)
            lengths = tf.constant(lengths, tf.int32)
        else:
            lengths = self._gather(tf.shape(tensor, out_type=tf.int32)[:1], device,
                                   self._instance_key(keys, (*slot, "lengths", self._device(device))))
        longest = tf.reduce_max(lengths)
        padding = [[0, longest - tf.shape(tensor, out_type=tf.int32)[0]]] + [[0, 0]] * (tensor.shape.rank - 1)
        gathered = self._gather(tf.pad(tensor, padding), device,
                                self._instance_key(keys, (*slot, "rows", self._device(device))))
        return tf.boolean_mask(gathered, tf.reshape(tf.sequence_mask(lengths, longest), [-1]))

    @watchdog.watched
    def broadcast(self, tensor: Tensorish, root: int, device: str | None = None) -> tf.Tensor:
        """Returns the ``tensor`` of the member with index ``root`` on every member, bit for bit."""
        return self.grouped_broadcast([tensor], root, device)[0]

    @watchdog.watched
    def grouped_broadcast(self, tensors: Sequence[Tensorish], root: int, device: str | None = None) -> list:
        """``broadcast`` of several tensors: one collective per dtype."""
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        self._check_member("broadcast")
        if not (isinstance(root, (int, np.integer)) and 0 <= root < self.size):
            raise ValueError(f"root={root!r} is not an index into this group of {self.size} rank(s); "
                             "ProcessGroup.root_index(rank) gives it.")
        if self.size == 1 or not tensors:
            return list(tensors)
        if tf.executing_eagerly():
            self._agree("broadcast", tensors, root=int(root))
        results: list = [None] * len(tensors)
        previous = None
        for dtype, indices in fusion.by_wire_dtype(tensors).items():
            flat, layout = fusion.pack([tensors[i] for i in indices])
            with tf.control_dependencies(_after(previous)), tf.device(self._device(device)):
                key = self.new_instance_key()
                if self.rank == root:
                    out = collective_ops.broadcast_send_v2(flat, self.size, self._group_key(device), key,
                                                           self._hint, self._timeout)
                else:
                    out = collective_ops.broadcast_recv_v2(tf.shape(flat), dtype, self.size, self._group_key(device),
                                                           key, self._hint, self._timeout)
            previous = out
            for i, value in zip(indices, fusion.unpack(out, layout)):
                results[i] = value
        return results

    @watchdog.watched
    def alltoall(self, tensor: Tensorish, splits: Tensorish | None = None,
                 device: str | None = None) -> tuple[tf.Tensor, tf.Tensor]:
        """Sends rows ``splits[j]`` of ``tensor`` (in order) to rank j; returns what arrived and from whom.

        Args:
            tensor: rank >= 1; its first dimension is ``sum(splits)``.
            splits: rows for each rank (None: the first dimension split evenly).

        Returns:
            ``(received, received_splits)``: the rows every rank sent to this one, in rank
            order, and how many came from each rank.

        Raises:
            ValueError: ``splits`` does not have one entry per rank, or does not add up
                to the first dimension (checked in eager code).
        """
        tensor = tf.convert_to_tensor(tensor)
        self._check_member("alltoall")
        if tensor.shape.rank == 0:
            raise ValueError("alltoall splits the first dimension, so it needs a tensor of rank >= 1; "
                             "received a scalar.")
        rows = tf.shape(tensor, out_type=tf.int32)[0]
        if splits is None:
            if tf.executing_eagerly() and int(rows) % self.size:
                raise ValueError(f"alltoall without splits divides the first dimension evenly between the "
                                 f"{self.size} ranks; received {int(rows)} rows. Pass splits=[...] with one count "
                                 "per rank.")
            splits = tf.fill([self.size], rows // self.size)
        splits = tf.cast(tf.convert_to_tensor(splits), tf.int32)
        if tf.executing_eagerly():
            counts = splits.numpy().tolist()
            if len(counts) != self.size or sum(counts) != int(rows):
                raise ValueError(f"alltoall splits must give one row count per rank ({self.size}) adding up to the "
                                 f"first dimension ({int(rows)}); received splits={counts}.")
        if self.size == 1:
            return tensor, splits
        if tf.executing_eagerly():
            self._agree("alltoall", [tensor], first_dim_free=True)
        received = self._all_to_all(splits, device)
        longest = tf.cast(self.allreduce(tf.reduce_max(splits), op="max", device=device), tf.int32)
        chunks = tf.split(tensor, splits, num=self.size)
        tail = [[0, 0]] * (tensor.shape.rank - 1)
        padded = tf.stack([tf.pad(chunk, [[0, longest - tf.shape(chunk)[0]]] + tail) for chunk in chunks])
        exchanged = self._all_to_all(tf.reshape(padded, [self.size, -1]), device)  # one row per rank
        exchanged = tf.reshape(exchanged, tf.concat([[-1], tf.shape(tensor)[1:]], 0))
        return tf.boolean_mask(exchanged, tf.reshape(tf.sequence_mask(received, longest), [-1])), received

    @watchdog.watched
    def barrier(self) -> None:
        """Returns once every member has called it."""
        self._check_member("barrier")
        if self.size > 1:
            self._agree("barrier", [])

    def root_index(self, root_rank: int) -> int:
        """The index in this group of global rank ``root_rank`` (the job's group: the rank itself).

        Raises:
            ValueError: ``root_rank`` is not one of the group's ranks.
        """
        if not (isinstance(root_rank, (int, np.integer)) and not isinstance(root_rank, bool)
                and root_rank in self.ranks):
            raise ValueError(f"root_rank={root_rank!r} is not among the ranks taking part, {list(self.ranks)}; "
                             "pass one of them.")
        return self.ranks.index(int(root_rank))

    # Internals -------------------------------------------------------------------------------

    def _check_member(self, kind: str) -> None:
        if self.rank is None:
            raise ValueError(f"{kind} on process set {list(self.ranks)}, which this rank is not part of; call it only "
                             "on the ranks of the set.")

    def _device(self, device: str | None) -> str:
        if device is None:
            device = "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
        return f"/device:{device.upper()}:0"

    def _group_key(self, device: str | None) -> int:
        return self.group_key_base + (1 if self._device(device).endswith("GPU:0") else 0)

    def _instance_key(self, keys: KeyCache | None, slot: tuple) -> int:
        """A key from ``keys`` inside a tf.function; a fresh one eagerly (every rank calls in the same order)."""
        if keys is None or tf.executing_eagerly() or any(part is None for part in slot):
            return self.new_instance_key()
        return keys.key(self, slot)

    def _reduce_dense(self, tensors: list, op: str, compression, keys: KeyCache | None, device) -> list:
        if self.size == 1 or not tensors:
            return tensors
        compressed, contexts = zip(*[compression.compress(t) for t in tensors])
        results: list = [None] * len(tensors)
        previous = None
        for pack, (dtype, indices) in enumerate(fusion.by_wire_dtype(compressed).items()):
            flat, layout = fusion.pack([compressed[i] for i in indices])
            slot = ("allreduce", op, self._device(device), dtype.name, pack, flat.shape.num_elements())
            with tf.control_dependencies(_after(previous)), tf.device(self._device(device)):
                out = collective_ops.all_reduce_v2(flat, self.size, self._group_key(device),
                                                   self._instance_key(keys, slot), merge_op=_MERGE_OPS[op],
                                                   final_op="Id", communication_hint=self._hint,
                                                   timeout=self._timeout, ordering_token=self._token(device))
            previous = out
            for i, value in zip(indices, fusion.unpack(out, layout)):
                results[i] = compression.decompress(value, contexts[i])
        return results

    def _reduce_sparse(self, tensor: tf.IndexedSlices, op: str, scale: float, keys: KeyCache | None,
                       slot: tuple) -> tf.IndexedSlices:
        if op not in ("sum", "mean"):
            raise ValueError(f"allreduce of tf.IndexedSlices gathers them, so only op 'sum' and 'mean' apply; "
                             f"received op={op!r}. Densify the gradient (sparse_as_dense=True) for other ops.")
        values = self._allgather(tensor.values, None, keys, (*slot, "values"))
        indices = self._allgather(tensor.indices, None, keys, (*slot, "indices"))
        values = _scale(_divide(values, self.size) if op == "mean" else values, scale)
        return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)

    def _gather(self, tensor: tf.Tensor, device, key: int | None = None) -> tf.Tensor:
        return self._exchange(collective_ops.all_gather_v2, tensor, device, key)

    def _all_to_all(self, tensor: tf.Tensor, device) -> tf.Tensor:
        return self._exchange(collective_ops.all_to_all_v2, tensor, device)

    def _exchange(self, collective, tensor: tf.Tensor, device, key: int | None = None) -> tf.Tensor:
        """``collective`` (all_gather_v2 or all_to_all_v2) of ``tensor``, sent as a dtype TF's collectives carry."""
        wire = fusion.wire_dtype(tensor.dtype)
        with tf.device(self._device(device)):
            out = collective(tf.cast(tensor, wire), self.size, self._group_key(device),
                             self.new_instance_key() if key is None else key,
                             self._hint, self._timeout, ordering_token=self._token(device))
        return tf.cast(out, tensor.dtype)

    def _token(self, device) -> tf.Tensor:
        """A resource on the collective's device that orders this group's collectives within a tf.function.

        TensorFlow's automatic control dependencies run ops sharing a resource in program
        order, so every rank launches the same collectives in the same order (NCCL needs it).
        """
        name = self._device(device)
        if name not in self._tokens:
            with tf.init_scope(), tf.device(name):  # a plain variable, also under a strategy (as MWMS makes its own)
                self._tokens[name] = resource_variable_ops.ResourceVariable(0.0, trainable=False,
                                                                            name="tfdist_collective_order")
        return self._tokens[name].handle

    def _agree(self, kind: str, tensors: Sequence[tf.Tensor], op: str = "sum", root: int = -1,
               first_dim_free: bool = False) -> list[list[tuple]]:
        """Checks that every rank makes this call with matching tensors; returns shapes[rank][tensor].

        Two small all-gathers on the CPU: the call itself (kind, op, root, tensor count),
        then each tensor's dtype and shape (``first_dim_free``: the first dimension may
        differ). Raises ``CollectiveMismatchError`` on every rank alike.
        """
        header = np.array([_KINDS.index(kind), REDUCE_OPS.index(op), root, len(tensors)], np.int64)
        headers = self._gather(tf.constant(header[np.newaxis]), "CPU").numpy()
        if (headers != header).any():
            raise CollectiveMismatchError(self._describe_calls(headers))
        if not tensors:
            return [[] for _ in range(self.size)]
        signatures = np.stack([_signature(t) for t in tensors])
        everyone = self._gather(tf.constant(signatures[np.newaxis]), "CPU").numpy()
        compared = everyone[:, :, [0, 1] + list(range(3 if first_dim_free else 2, 2 + _SIGNATURE_DIMS))]
        if (compared != compared[0]).any():
            raise CollectiveMismatchError(self._describe_tensors(kind, everyone, first_dim_free))
        return [[tuple(int(d) for d in row[2:2 + row[1]]) for row in rows] for rows in everyone]

    def _describe_calls(self, headers: np.ndarray) -> str:
        calls = "; ".join(
            f"rank {self.ranks[i]}: {_KINDS[k]}" + (f"(op={REDUCE_OPS[o]!r})" if _KINDS[k] == "allreduce" else "")
            + (f"(root_rank={r})" if _KINDS[k] == "broadcast" else "") + f" of {n} tensor(s)"
            for i, (k, o, r, n) in enumerate(headers.tolist()))
        return (f"The ranks made different collective calls at the same point ({calls}). Every rank must make the "
                "same collective calls, with the same op, root and number of tensors, in the same order.")

    def _describe_tensors(self, kind: str, everyone: np.ndarray, first_dim_free: bool) -> str:
        per_rank = "; ".join(f"rank {self.ranks[i]}: " + ", ".join(_show(row) for row in rows)
                             for i, rows in enumerate(everyone))
        rule = ("the same dtype and the same dimensions after the first" if first_dim_free
                else "the same shape and dtype")
        hint = "." if first_dim_free else " (allgather accepts a different first dimension)."
        return f"Mismatched {kind} tensors: every rank must pass {rule}; received {per_rank}. Make the tensors " \
               f"agree on every rank{hint}"


# Which workers a strategy spans ---------------------------------------------------------------

_groups: dict[int, "ProcessGroup"] = {}


def for_strategy(strategy: tf.distribute.Strategy) -> "ProcessGroup":
    """The group of ``strategy``'s worker processes (one group per strategy, kept)."""
    workers = num_workers(strategy)
    key = id(strategy) if workers > 1 else 0
    if key not in _groups:
        options = getattr(strategy.extended, "_communication_options", None) if workers > 1 else None
        timeout = getattr(options, "timeout_seconds", None)
        hint = options.implementation.value if options is not None else "auto"
        _groups[key] = ProcessGroup(range(workers), worker_rank(strategy), timeout, hint)
    return _groups[key]


def is_multi_worker(strategy: tf.distribute.Strategy | None) -> bool:
    """Whether ``strategy`` spans more than one worker process."""
    return strategy is not None and num_workers(strategy) > 1


def num_workers(strategy: tf.distribute.Strategy | None) -> int:
    """Worker processes that ``strategy`` spans (1 for every single-process strategy, and for None)."""
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return strategy.extended._num_workers  # TF keeps no public count of workers
    return 1


def worker_rank(strategy: tf.distribute.Strategy | None) -> int:
    """This process's rank among ``strategy``'s workers (0 is the chief; 0 for None)."""
    return strategy.extended._id_in_cluster if num_workers(strategy) > 1 else 0


# Helpers --------------------------------------------------------------------------------------

def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"Unknown reduce op={op!r}; choose one of {list(REDUCE_OPS)}.")


def _scale(tensor, factor: float):
    if factor == 1.0:
        return tensor
    if isinstance(tensor, tf.IndexedSlices):
        return tf.IndexedSlices(_scale(tensor.values, factor), tensor.indices, tensor.dense_shape)
    if tensor.dtype.is_floating or tensor.dtype.is_complex:
        return tensor * tf.cast(factor, tensor.dtype)
    return tf.cast(tf.cast(tensor, tf.float64) * factor, tensor.dtype)


def _divide(tensor: tf.Tensor, count: int) -> tf.Tensor:
    if tensor.dtype.is_floating or tensor.dtype.is_complex:
        return tensor / tf.cast(count, tensor.dtype)
    return tf.cast(tensor, tf.float64) / count


def _after(previous) -> list:
    """Control inputs that keep the collectives of one call in one order on every rank."""
    return [] if previous is None else [previous]


def _signature(tensor: tf.Tensor) -> np.ndarray:
    """[dtype enum, rank, dims padded with -1 (-2 for unknown)] of one tensor."""
    dims = [-2 if d is None else d for d in tensor.shape.as_list()] if tensor.shape.rank is not None else []
    if len(dims) > _SIGNATURE_DIMS:
        dims = dims[:_SIGNATURE_DIMS - 1] + [int(np.prod(dims[_SIGNATURE_DIMS - 1:]))]
    return np.array([tensor.dtype.as_datatype_enum, len(dims)] + dims + [-1] * (_SIGNATURE_DIMS - len(dims)), np.int64)


def _show(row: np.ndarray) -> str:
    dtype = tf.dtypes.as_dtype(int(row[0])).name
    return f"{dtype} {list(int(d) for d in row[2:2 + row[1]])}"
