"""ZeRO-1 for Keras on TensorFlow: each replica keeps 1/N of every optimizer slot and updates 1/N of the weights.

An optimizer created while ``tfdist.sharding.requested()`` (``tfdist.scope(shard_optimizer_state=True)``,
``TFDIST_SHARD_OPTIMIZER_STATE=1``, ``DistributedOptimizer(..., shard_optimizer_state=True)``) and
built under a strategy of N > 1 replicas (local devices or workers) shards its state:

* every slot Keras makes from a weight (``add_variable_from_reference``: momentum, Adam's moments,
  RMSprop's averages, Adagrad's and Ftrl's accumulators) is a per-replica variable of
  ``ceil(size / N)`` elements: replica r holds elements ``[r*s, (r+1)*s)`` of the flattened weight
  (the last shard padded with zeros);
* a step: the gradients are summed over the replicas one shard row at a time, in the groups of the
  gather below, last layers first (``_reduced_shards``: each replica keeps its own row's sum, so no
  summed gradient is ever whole), or, where the sums must be whole (clipping, a loss scale's finite
  check: exact on the sums), all-reduced as before in buckets and sliced; weight decay acts on the
  whole weights first, as Keras does; each replica takes its shard of
  each weight, runs the optimizer's own ``update_step`` on them (the weight's
  shard is a tensor assigned functionally, ``_Shard``: no variable holds it), and the updated shards
  are all-gathered, a group of weights of up to ``GATHER_BYTES`` at a time, into every replica's copy
  of each weight, so every copy stays bit-identical;
* saving: each slot is a ``_ShardSlot``, which ``save_own_variables``, ``numpy()`` and an eager
  ``tf.train.Checkpoint`` read whole (gathered from every replica, one slot at a time), so a sharded
  optimizer writes the checkpoint of an unsharded one (plain Keras loads it on one device); loading a
  whole slot (saved by any number of replicas, or none) keeps this replica's shard. Under several
  workers a save gathers from every worker, so every worker must save (tfdist's ModelCheckpoint and
  BackupAndRestore do; a save on the chief alone is a ShardingError before the file is opened, naming the worker
  that is not saving: at once when it exited or went on, ``tfdist.save_rounds``).

Only optimizers whose update is element-wise can be sharded exactly (``SHARDABLE``); Lamb (a
per-weight trust ratio), Adafactor (factored moments), Muon (whole matrices) and any other class
are refused with an error naming them, as is gradient accumulation (its accumulators hold unreduced
gradients). ``use_ema``'s moving averages are slots like the others: each replica moves its shard;
the end of ``fit``, ``ema_overwrite_frequency`` and ``SwapEMAWeights`` gather them whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import tensorflow as tf
from keras.src import backend, initializers, optimizers
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.callbacks.callback_list import CallbackList
from keras.src.callbacks.swap_ema_weights import SwapEMAWeights
from keras.src.optimizers.base_optimizer import BaseOptimizer
from keras.src.saving import saving_lib

from tfdist import buckets, kvstore, process_group, replica_collectives, save_rounds, sharding, step_clock
from tfdist import compression as compression_lib
from tfdist.errors import ShardingError
from tfdist.keras_fixes import batch_shares, gradient_buckets
from tfdist.keras_fixes.signatures import FIT_PARAMETERS
from tfdist.patching import Patch

patch = Patch(
    "sharded_state", "keras#18473: no optimizer-state sharding on TensorFlow",
    without="shard_optimizer_state=True keeps a whole copy of the optimizer state on every replica.")

GATHER_BYTES = 16 * 2**20  # whole-weight bytes all-gathered at once (``_gather_groups``)
# Optimizers whose update_step reads and writes each element of a weight and its slots on its own.
SHARDABLE = (optimizers.SGD, optimizers.Adam, optimizers.AdamW, optimizers.Adamax, optimizers.Adagrad,
             optimizers.Adadelta, optimizers.RMSprop, optimizers.Nadam, optimizers.Ftrl, optimizers.Lion)


@dataclasses.dataclass
class _Slot:
    shape: tuple[int, ...]
    size: int


class _Layout:
    """How many replicas share the state: not a trackable (Keras must not save it)."""

    def __init__(self, replicas: int):
        self.replicas = replicas

    def shard_size(self, size: int) -> int:
        return math.ceil(size / self.replicas)


HOROVOD_REFUSAL = (
    "tfdist.horovod does not shard optimizer state: Horovod scripts save on rank 0 alone, which cannot gather the "
    "other ranks' shards. Train with tfdist.scope(shard_optimizer_state=True) (fit or strategy.run), or pass "
    f"shard_optimizer_state=False / leave {sharding.ENV} unset.")


def check(optimizer) -> None:
    """Raises ShardingError when ``optimizer``'s state cannot be sharded exactly, naming what and why."""
    name = type(optimizer).__name__
    if isinstance(optimizer, optimizers.LossScaleOptimizer):
        return check(optimizer.inner_optimizer)
    if getattr(optimizer, "_tfdist_reduction", None) is not None:
        raise ShardingError(HOROVOD_REFUSAL)
    if type(optimizer).update_step not in {cls.update_step for cls in SHARDABLE}:
        kinds = ", ".join(cls.__name__ for cls in SHARDABLE)
        raise ShardingError(
            f"tfdist cannot shard the state of {name}: its update is not element by element "
            f"(Lamb's trust ratio and Adafactor's factored moments read a whole weight, Muon a whole matrix) or "
            f"not one tfdist checked. Shardable: {kinds}. Use one of them, or turn sharding off "
            f"(shard_optimizer_state=False, {sharding.ENV}=0).")
    if optimizer.gradient_accumulation_steps:
        raise ShardingError(
            f"shard_optimizer_state does not shard gradient accumulation ({name}(gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps})): its accumulators hold each replica's own unreduced "
            "gradients, which cannot be split before they are summed without a collective on every micro-batch. "
            "Accumulate with shard_optimizer_state=False, or shard without accumulating (a larger batch).")


def mark(optimizer, value: bool = True) -> None:
    """Makes ``optimizer`` (unbuilt) shard its state when it is built under several replicas."""
    if value:
        check(optimizer)
    target = optimizer.inner_optimizer if isinstance(optimizer, optimizers.LossScaleOptimizer) else optimizer
    target._tfdist_shard_state = value


def is_sharded(optimizer) -> bool:
    """Whether ``optimizer`` (or a LossScaleOptimizer's inner one) was built sharding its state."""
    if isinstance(optimizer, optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return getattr(optimizer, "_tfdist_layout", None) is not None


@patch.replaces(TFOptimizer, "__init__", ("self", "args", "kwargs"))
def _mark_when_requested(original, self, *args, **kwargs):
    """An optimizer created while sharding is requested is marked, to shard when built under several replicas."""
    original(self, *args, **kwargs)
    if getattr(self, "_tfdist_shard_state", None) is None and sharding.requested() and not isinstance(
            self, optimizers.LossScaleOptimizer):
        self._tfdist_shard_state = True  # checked when built (Keras makes optimizers of its own, e.g. saving)


@patch.replaces(BaseOptimizer, "build", ("self", "variables"))
def _lay_out_shards(original, self, variables):
    """A marked optimizer under N > 1 replicas builds per-replica shards of its slots; else Keras' build."""
    strategy = getattr(self, "_distribution_strategy", None)
    replicas = strategy.num_replicas_in_sync if strategy is not None else 1
    if self.built or not getattr(self, "_tfdist_shard_state", False) or replicas <= 1:
        return original(self, variables)
    check(self)
    self._tfdist_layout = _Layout(replicas)
    if process_group.is_multi_worker(strategy):
        save_rounds.track(process_group.worker_rank(strategy))  # its saves are rounds: peers must see its point
    original(self, variables)


@patch.replaces(TFOptimizer, "add_variable_from_reference", ("self", "reference_variable", "name", "initializer"))
def _shard_of_a_slot(original, self, reference_variable, name=None, initializer="zeros"):
    """A slot of a sharded optimizer holds this replica's ``ceil(size / N)`` elements of the weight's shape."""
    layout = getattr(self, "_tfdist_layout", None)
    if layout is None:
        return original(self, reference_variable, name, initializer)
    shape = tuple(int(d) for d in reference_variable.shape)
    size = int(np.prod(shape, dtype=np.int64))
    prefix = (reference_variable.path.replace("/", "_") if hasattr(reference_variable, "path")
              else str(reference_variable.name))
    colocate = reference_variable.value if isinstance(reference_variable, backend.Variable) else reference_variable
    with self._distribution_strategy.extended.colocate_vars_with(colocate), backend.name_scope(self.name, caller=self):
        variable = _ShardSlot(
            initializer=initializers.get(initializer), shape=(layout.shard_size(size),), dtype=reference_variable.dtype,
            trainable=False, aggregation="none", synchronization="on_read", name=f"{prefix}_{name or 'var'}")
    variable._tfdist_slot, variable._tfdist_layout = _Slot(shape, size), layout
    variable._tfdist_strategy = self._distribution_strategy
    self._track_variable(variable)
    return variable


class _Shard:
    """This replica's shard of a weight, as ``update_step`` sees it: read as a tensor, assigned functionally.

    No variable holds it (that would cost 1/N of the weights): the optimizer's update of the shard
    is a tensor, which the all-gather then writes into every replica's weight.
    """

    def __init__(self, value: tf.Tensor, index: int):
        self.value, self.index, self.dtype, self.shape = value, index, value.dtype, value.shape

    def assign(self, value):
        self.value = tf.cast(value, self.dtype)

    def assign_add(self, value):
        self.value = self.value + tf.cast(value, self.dtype)

    def assign_sub(self, value):
        self.value = self.value - tf.cast(value, self.dtype)


tf.register_tensor_conversion_function(
    _Shard, lambda shard, dtype=None, name=None, as_ref=False: tf.convert_to_tensor(shard.value, dtype=dtype))


@patch.replaces(BaseOptimizer, "_get_variable_index", ("self", "variable"))
def _index_of_a_shard(original, self, variable):
    """A weight's shard has the weight's index (``update_step`` finds its slots by it)."""
    return variable.index if isinstance(variable, _Shard) else original(self, variable)


@patch.replaces(TFOptimizer, "_backend_update_step", ("self", "grads", "trainable_variables", "learning_rate"))
def _update_shards(original, self, grads, trainable_variables, learning_rate):
    """Each replica updates its shard of every weight; the shards are all-gathered into every replica's weights."""
    layout = getattr(self, "_tfdist_layout", None)
    if layout is None:
        return original(self, grads, trainable_variables, learning_rate)
    context = _replica_context(self, layout)
    trainable_variables = [v.value if isinstance(v, backend.Variable) else v for v in trainable_variables]
    replica = context.replica_id_in_sync_group
    gradients = _reduced_shards(self, context, grads, trainable_variables, layout)
    if gradients is None:
        reduced = [g for g, _ in self._all_reduce_sum_gradients(list(zip(grads, trainable_variables)))]
        gradients = [_my_shard(g, replica, layout, v.shape)  # sliced as they come: the sums are freed
                     for g, v in zip(reduced, trainable_variables)]
    written = list(gradients)
    # Last layers first, as their gradients are reduced (tfdist.buckets). A group is sliced, updated,
    # gathered and written after the previous one is written: a step holds one group's shards and
    # gathered weights at a time, not the model's.
    for group in reversed(_gather_groups(trainable_variables, layout)):
        with tf.control_dependencies(written):
            shards = []
            for i in group:
                shard = _Shard(_my_shard(trainable_variables[i], replica, layout, trainable_variables[i].shape),
                               self._get_variable_index(
                    trainable_variables[i]))
                self.update_step(gradients[i], shard, learning_rate)
                shards.append(shard.value)
            written = _gather_into_weights(context, shards, [trainable_variables[i] for i in group], layout)


def _reduced_shards(optimizer, context, grads, variables, layout: _Layout) -> list | None:
    """This replica's shard of each summed gradient, summed shard by shard; None where the whole sums are needed.

    Each group of ``_gather_groups`` (last layers first, as the backward pass makes them) is laid out as one row
    per replica's shard (``_rows_of``), and each row is all-reduced on its own: a replica keeps the sum of its
    own row and drops the others' as each arrives. An all-reduce of the whole gradient held its input, its output
    and the ring's pieces at once, for every weight in flight: the step's peak of tensor bytes, higher by the
    same amount with or without sharding (on 2 x Dense(4096) under Adam, 2 workers: 128 MB of a 578 MB peak).
    Each element is summed over the replicas as before (on 2 replicas, the same sum; the order of a ring's
    additions on more depends on where an element falls in the tensor, as it did on the buckets' packing).
    A count that weighs the sums (``batch_shares``) is summed in one more float all-reduce.

    None (the whole sums, then sliced) eagerly, under cross-device ops other than collectives, when the
    gradients are sums already (a LossScaleOptimizer's finite check, clipping), when the optimizer all-reduces
    in a way of its own (``DistributedOptimizer(compression=...)``), or when this replica's index is not known
    when tracing.
    """
    launch = replica_collectives.launcher(grads[0]) if grads else None
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    if launch is None or replica is None or gradient_buckets.already_reduced(optimizer) or _own_wire(optimizer):
        return None
    ops, options = launch
    launcher = ops._launchers[context._replica_id]
    count = batch_shares.count_to_reduce()
    grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    shards: list = [None] * len(grads)

    def reduce_groups(on_ready, on_reduced):
        summed = []
        for b, group in enumerate(reversed(_gather_groups(variables, layout))):
            tensors = on_ready(b, [grads[i] for i in group], sum(buckets.nbytes(grads[i]) for i in group))
            rows = [_rows_of(t, layout, variables[i].shape) for t, i in zip(tensors, group)]
            matrix = rows[0] if len(rows) == 1 else tf.concat(rows, axis=1)
            mine = [launcher.all_reduce(matrix[k], options=options) for k in range(layout.replicas)][int(replica)]
            pieces = [mine] if len(rows) == 1 else tf.split(mine, [int(r.shape[1]) for r in rows])
            pieces = on_reduced(b, pieces)
            for i, piece in zip(group, pieces):
                shards[i] = piece
            summed += pieces
        return summed

    step_clock.buckets_timed(grads, reduce_groups)  # the step's times (tfdist.step_clock)
    if count is None:
        return shards
    dtype = next((s.dtype for s in shards if s.dtype in (tf.float32, tf.float64)), tf.float32)
    total = launcher.all_reduce(tf.cast(count, dtype), options=options)
    return [tf.math.divide_no_nan(s, tf.cast(total, s.dtype)) for s in shards]


def _own_wire(optimizer) -> bool:
    """Whether ``optimizer`` all-reduces its gradients in a way of its own (``DistributedOptimizer(compression=...)``)."""
    return (type(optimizer)._all_reduce_sum_gradients is not TFOptimizer._all_reduce_sum_gradients
            and getattr(optimizer, "compression", None) is not compression_lib.Compression.none)


def sums_shard_rows(optimizer) -> bool:
    """Whether a step of ``optimizer`` (built) under a collective strategy sums the gradients by shard rows
    (``_reduced_shards``), so the gradient buckets' setting plays no part in it (``tfdist.autotune`` has nothing
    to tune). False where the sums are whole, in buckets: a loss scale's finite check, clipping, a wire of the
    optimizer's own."""
    if isinstance(optimizer, optimizers.LossScaleOptimizer) or not is_sharded(optimizer):
        return False
    clips = any(value and value > 0 for value in (optimizer.clipnorm, optimizer.global_clipnorm, optimizer.clipvalue))
    return not clips and not _own_wire(optimizer)


def _rows_of(tensor, layout: _Layout, shape) -> tf.Tensor:
    """``tensor`` (of a weight's ``shape``) flattened, padded with zeros and cut into one row per replica's shard."""
    size = int(np.prod(shape, dtype=np.int64))
    shard = layout.shard_size(size)
    flat = tf.reshape(tensor, [size])
    if shard * layout.replicas != size:
        flat = tf.pad(flat, [[0, shard * layout.replicas - size]])
    return tf.reshape(flat, [layout.replicas, shard])


def _replica_context(optimizer, layout: _Layout):
    """The replica context a sharded step runs in; a ShardingError outside ``strategy.run``."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync != layout.replicas:
        raise ShardingError(
            f"{optimizer.name} shards its state over {layout.replicas} replicas and applies gradients only inside "
            "strategy.run (fit does; a custom loop calls optimizer.apply_gradients in its step function).")
    return context


@patch.replaces(BaseOptimizer, "_update_model_variables_moving_average", ("self", "trainable_variables"))
def _move_average_shards(original, self, trainable_variables):
    """``use_ema``: each replica moves its shard of every moving average towards its shard of the new weight."""
    layout = getattr(self, "_tfdist_layout", None)
    if layout is None or not self.use_ema:
        return original(self, trainable_variables)
    replica = _replica_context(self, layout).replica_id_in_sync_group
    for variable, average in zip(trainable_variables, self._model_variables_moving_average):
        if average is None:
            continue
        shard = _my_shard(variable.value if isinstance(variable, backend.Variable) else variable, replica, layout,
                          variable.shape)
        momentum = tf.cast(tf.not_equal(self.iterations, 0), shard.dtype) * self.ema_momentum  # as Keras moves it
        average.assign(momentum * average.value + (1 - momentum) * shard)


@patch.replaces(TFOptimizer, "_overwrite_model_variables_with_average_value", ("self", "trainable_variables"))
def _overwrite_with_whole_averages(original, self, trainable_variables):
    """The weights become their moving averages, gathered whole (the end of ``fit``; every
    ``ema_overwrite_frequency``-th update, in cross-replica context: tfdist.keras_fixes.accumulation)."""
    averages = getattr(self, "_model_variables_moving_average", ())
    if not any(isinstance(a, _ShardSlot) for a in averages) or len(trainable_variables) != len(averages):
        return original(self, trainable_variables)
    for variable, average in zip(trainable_variables, averages):
        if average is not None:
            variable.assign(average.whole() if tf.executing_eagerly() else average.gathered())


@patch.replaces(SwapEMAWeights, "_tf_swap_variables", ("self", "optimizer"))
def _swap_with_whole_averages(original, self, optimizer):
    """SwapEMAWeights: each weight and its moving average trade values (the average gathered whole)."""
    if not is_sharded(optimizer):
        return original(self, optimizer)
    for variable, average in zip(optimizer._trainable_variables, optimizer._model_variables_moving_average):
        weight = variable.numpy()
        variable.assign(average.whole())
        average.assign_whole(weight)


@patch.replaces(SwapEMAWeights, "_tf_finalize_ema_values", ("self", "optimizer"))
def _averages_from_weights(original, self, optimizer):
    """SwapEMAWeights' last epoch: each replica's shard of every moving average becomes the weight's."""
    if not is_sharded(optimizer):
        return original(self, optimizer)
    for variable, average in zip(optimizer._trainable_variables, optimizer._model_variables_moving_average):
        average.assign_whole(variable.numpy())


def _my_shard(tensor, replica, layout: _Layout, shape) -> tf.Tensor:
    """Replica ``replica``'s ``ceil(size / N)`` elements of ``tensor`` (a weight's ``shape``, which its static
    shape may not tell: a densified sparse gradient), flattened (zeros past its end).

    Copies only the shard: no whole-size padded copy of the weight or gradient.
    """
    if isinstance(tensor, tf.IndexedSlices):
        tensor = tf.convert_to_tensor(tensor)
    size = int(np.prod(shape, dtype=np.int64))
    flat = tf.reshape(tensor, [size])
    shard = layout.shard_size(size)
    if shard * layout.replicas == size:
        return tf.gather(tf.reshape(flat, [layout.replicas, shard]), replica)
    start = tf.minimum(tf.cast(replica, tf.int32) * shard, size)
    piece = tf.slice(flat, [start], [tf.minimum(shard, size - start)])
    return tf.ensure_shape(tf.pad(piece, [[0, shard - tf.shape(piece)[0]]]), [shard])


def _gather_groups(variables, layout: _Layout) -> list[list[int]]:
    """Weights in groups of one dtype and up to ``GATHER_BYTES`` (whole weights), gathered together.

    Bounds what a step holds beyond the weights: one group's gathered copy at a time, not the model's.
    """
    groups: list[list[int]] = []
    open_group: dict[tf.DType, tuple[list[int], int]] = {}
    for i, variable in enumerate(variables):
        dtype = variable.dtype.base_dtype
        nbytes = layout.shard_size(int(np.prod(variable.shape, dtype=np.int64))) * layout.replicas * dtype.size
        members, total = open_group.get(dtype, ([], 0))
        if members and total + nbytes > GATHER_BYTES:
            groups.append(members)
            members, total = [], 0
        open_group[dtype] = (members + [i], total + nbytes)
    groups.extend(members for members, _ in open_group.values())
    return groups


def _gather_into_weights(context, shards, variables, layout: _Layout) -> list:
    """All-gathers one group's updated shards and writes each whole weight into this replica's copy of it.

    Returns the writes (the next group waits for them).

    Every replica writes the same gathered bits into its own copy, so the copies stay identical
    without a cross-replica update (``MirroredVariable``'s per-device component, as TensorFlow's
    own per-device updates write it).
    """
    gathered = _gather_equal_shards(context, shards[0] if len(shards) == 1 else tf.concat(shards, axis=0))
    if len(shards) > 1:
        gathered = tf.reshape(gathered, [layout.replicas, -1])
    offset, writes = 0, []
    for shard, variable in zip(shards, variables):
        size = int(np.prod(variable.shape, dtype=np.int64))
        width = int(shard.shape[0])
        flat = gathered if len(shards) == 1 else tf.reshape(gathered[:, offset:offset + width], [-1])
        if width * layout.replicas != size:
            flat = flat[:size]
        writes.append(_this_replicas_copy(variable).assign(tf.reshape(flat, variable.shape)))
        offset += width
    return writes


def _gather_equal_shards(context, shard: tf.Tensor) -> tf.Tensor:
    """Every replica's ``shard`` (one length on all), concatenated in replica order along axis 0.

    Under collective cross-device ops (workers; CPUs), one gather launched from this replica's own thread, as
    TensorFlow launches its replica-context all-reduce for XLA: ``ReplicaContext.all_gather`` (a merge_call)
    allows shards of unequal lengths by gathering them padded, then slicing and concatenating, which holds
    about three copies of the weight at once (on 2 x Dense(4096) under Adam, 2 workers, it cost a third of the
    memory sharding saves). Eagerly or under other cross-device ops: ``all_gather``. Shards of no elements (a
    weight of size 0) are not gathered: TensorFlow's all-gather of no elements kills the process (2.21).
    """
    if shard.shape.num_elements() == 0:
        return tf.zeros([0], shard.dtype)
    launch = replica_collectives.launcher(shard)
    if launch is None:
        return context.all_gather(shard, axis=0)
    ops, options = launch
    return ops._launchers[context._replica_id]._all_gather(shard, options)


def _this_replicas_copy(variable):
    """The component of a distributed variable that the current replica reads."""
    return variable._get_on_device_or_primary() if hasattr(variable, "_get_on_device_or_primary") else variable


class _ShardSlot(backend.Variable):
    """A slot of a sharded optimizer: this replica's shard, which reads and saves as the whole slot.

    ``numpy()`` and a ``tf.train.Checkpoint`` give the whole slot (gathered from every replica: under
    several workers every worker must read or save it, as every worker must call a save); restoring
    a whole slot keeps each replica's shard. SavedModel cannot hold it (its graph would hold the shard).
    """

    def whole(self) -> np.ndarray:
        """The whole slot, in the reference weight's shape (a collective under several workers)."""
        strategy, slot = self._tfdist_strategy, self._tfdist_slot
        if slot.size == 0:  # nothing to gather (TensorFlow's all-gather of no elements kills the process)
            return np.zeros(slot.shape, self.dtype)
        _every_worker_gathers(strategy, self.name)
        gathered = strategy.gather(strategy.run(lambda: tf.identity(self.value)), axis=0)
        return gathered[:slot.size].numpy().reshape(slot.shape)

    def gathered(self) -> tf.Tensor:
        """The whole slot as a tensor, in cross-replica context inside a ``tf.function`` (every worker runs it)."""
        if self._tfdist_slot.size == 0:  # as ``whole``
            return tf.zeros(self._tfdist_slot.shape, self.dtype)
        whole = self._tfdist_strategy.gather(self.value, axis=0)
        return tf.reshape(whole[:self._tfdist_slot.size], self._tfdist_slot.shape)

    def assign_whole(self, value) -> None:
        """Keeps each local replica's shard of ``value``, a whole slot."""
        slot, layout, strategy = self._tfdist_slot, self._tfdist_layout, self._tfdist_strategy
        value = np.asarray(value)
        if tuple(value.shape) != slot.shape:
            raise ValueError(f"The optimizer slot {self.path} is {slot.shape} (sharded over {layout.replicas} "
                             f"replicas); received a value of {tuple(value.shape)}: it was saved for another model.")
        rows = _rows(value, layout)
        replica_ids = strategy.experimental_local_results(
            strategy.run(lambda: tf.distribute.get_replica_context().replica_id_in_sync_group))
        for replica, component in zip(replica_ids, strategy.experimental_local_results(self.value)):
            component.assign(rows[int(replica)])

    def numpy(self):
        return self.whole()

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.whole(), dtype=dtype)

    def _serialize_to_tensors(self):
        if not tf.executing_eagerly():
            raise ShardingError(_NOT_IN_A_GRAPH)
        return {"VARIABLE_VALUE": tf.constant(self.whole())}

    def _restore_from_tensors(self, restored_tensors):
        if not tf.executing_eagerly():
            raise ShardingError(_NOT_IN_A_GRAPH)
        self.assign_whole(restored_tensors["VARIABLE_VALUE"].numpy())
        return self.value

    def _export_to_saved_model_graph(self, object_map, tensor_map, options, **kwargs):
        raise ShardingError(_NOT_IN_A_GRAPH)


_NOT_IN_A_GRAPH = (
    "A sharded optimizer's slots are saved whole by Keras (model.save, save_weights, ModelCheckpoint, "
    "BackupAndRestore) and by an eager tf.train.Checkpoint; a SavedModel (tf.saved_model.save) or a checkpoint "
    "saved inside a tf.function cannot hold them. Save the model with model.save('model.keras') (or export it "
    "for serving with model.export(), which holds no optimizer), or train with shard_optimizer_state=False.")
GATHER_AGREEMENT_S = 120.0  # how long a gather of whole slots waits for a worker that may still take part
_agreed = [False]  # inside a save every worker agreed to: its gathers need no agreement of their own


def _every_worker_gathers(strategy, name: str) -> None:
    """Under several workers, waits until every worker gathers this slot (a round of ``tfdist.save_rounds``);
    a ShardingError names a worker that cannot be taking part.

    A save on the chief alone (``if rank == 0: model.save(...)``) would otherwise wait in the
    gather for the other workers forever. It fails at once when a worker exited or went on past this point
    (a later fit or epoch), within ``save_rounds.SKEW_S`` when one is alive outside fit and not saving, and
    after ``GATHER_AGREEMENT_S`` when one may still come (frozen, or still in the fit).
    """
    if _agreed[0] or not process_group.is_multi_worker(strategy) or not kvstore.available():
        return
    rank = process_group.worker_rank(strategy)
    why = save_rounds.agree(rank, process_group.num_workers(strategy), GATHER_AGREEMENT_S)
    if why:
        raise ShardingError(
            f"Worker {rank} reads or saves the sharded optimizer state of {name} whole, which gathers it from every "
            f"worker, but {why}. Call model.save / save_weights / checkpoint.save on every worker, not only on the "
            "chief, each worker to a path of its own, and give a ModelCheckpoint or BackupAndRestore to every "
            "worker's fit (tfdist keeps the chief's files).")


@patch.replaces(CallbackList, "on_epoch_end", ("self", "epoch", "logs"))
def _epoch_end_is_a_point(original, self, epoch, logs=None):
    """A multi-worker fit's epoch whose callbacks ended moves this worker's point (``save_rounds``), before the
    collectives that end an epoch (``points_patch`` is applied after them): a worker past it did not save in them."""
    original(self, epoch, logs)
    if process_group.is_multi_worker(getattr(getattr(self, "model", None), "distribute_strategy", None)):
        save_rounds.epoch_ended(epoch)


points_patch = Patch(
    "sharded_save_points", "tfdist: a sharded save on some workers only",
    without="a sharded save on the chief alone, while another worker began its next fit, waits "
            f"GATHER_AGREEMENT_S ({GATHER_AGREEMENT_S:g} s) for it instead of failing at once.")


@points_patch.replaces(keras_tf_trainer.TensorFlowTrainer, "fit", FIT_PARAMETERS)
def _fit_is_a_point(original, self, *args, **kwargs):
    """A multi-worker fit moves this worker's point as it begins, before any collective of it (applied last of
    tfdist's patches: the outermost ``fit``), and as it ends."""
    if not process_group.is_multi_worker(self.distribute_strategy):
        return original(self, *args, **kwargs)
    save_rounds.fit_began()
    try:
        return original(self, *args, **kwargs)
    finally:
        save_rounds.fit_ended()


@patch.replaces(saving_lib, "save_model", ("model", "filepath", "weights_format", "zipped"))
def _agree_before_writing_a_model(original, model, filepath, *args, **kwargs):
    """A save of a model with sharded state first waits for every worker to save: a save on the chief alone is a
    ShardingError before the file is opened (a file it replaced would be left half written)."""
    with _every_worker_saves(model):
        return original(model, filepath, *args, **kwargs)


@patch.replaces(saving_lib, "save_weights_only", ("model", "filepath", "max_shard_size", "objects_to_skip"))
def _agree_before_writing_weights(original, model, filepath, *args, **kwargs):
    """``save_weights``: as ``_agree_before_writing_a_model``."""
    with _every_worker_saves(model):
        return original(model, filepath, *args, **kwargs)


@contextlib.contextmanager
def _every_worker_saves(model):
    """Agrees once for the whole save (its slots' gathers then need no agreement of their own)."""
    optimizer = getattr(model, "optimizer", None)
    slots = [v for v in getattr(optimizer, "variables", ()) if isinstance(v, _ShardSlot)]
    if not slots or _agreed[0]:
        yield
        return
    _every_worker_gathers(slots[0]._tfdist_strategy, f"{model.name} (saving it)")
    _agreed[0] = True
    try:
        yield
    finally:
        _agreed[0] = False


@patch.replaces(BaseOptimizer, "save_own_variables", ("self", "store"))
def _save_whole_slots(original, self, store):
    """Each sharded slot is saved whole, one at a time: the checkpoint of an unsharded optimizer.

    A LossScaleOptimizer saves its inner optimizer's slots among its own variables: each is known
    by its class, whichever optimizer saves it.
    """
    if not any(isinstance(v, _ShardSlot) for v in self.variables):
        return original(self, store)
    for i, variable in enumerate(self.variables):
        store[str(i)] = variable.whole() if isinstance(variable, _ShardSlot) else variable.numpy()


@patch.replaces(BaseOptimizer, "load_own_variables", ("self", "store"))
def _load_my_shards(original, self, store):
    """Whole slots (as any optimizer of the class saves them) are loaded; each replica keeps its shard."""
    if not any(isinstance(v, _ShardSlot) for v in self.variables) or len(store.keys()) != len(self.variables):
        return original(self, store)  # Keras warns and skips a store of another optimizer
    for i, variable in enumerate(self.variables):
        if isinstance(variable, _ShardSlot):
            variable.assign_whole(store[str(i)])
        else:
            variable.assign(store[str(i)])


def _rows(value: np.ndarray, layout: _Layout) -> np.ndarray:
    """``value`` flattened, padded with zeros and cut into one row per replica."""
    flat = value.reshape(-1)
    shard = layout.shard_size(flat.size)
    return np.pad(flat, (0, shard * layout.replicas - flat.size)).reshape(layout.replicas, shard)


def replicated_variables(optimizer) -> list:
    """``optimizer.variables`` that every replica holds whole (its step count, learning rate), not the shards."""
    return [v for v in optimizer.variables if not isinstance(v, _ShardSlot)]


def each_copy(variable) -> tuple:
    """Every local replica's copy of ``variable`` (its shard, for a sharded slot), to read or assign one by one."""
    value = variable.value if isinstance(variable, backend.Variable) else variable
    return tuple(getattr(value, "values", (value,)))


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state one replica holds: one replica's copy of every variable in ``optimizer.variables``."""
    return sum(int(np.prod(each_copy(v)[0].shape, dtype=np.int64)) * tf.as_dtype(v.dtype).size
               for v in optimizer.variables)


def is_shard_slot(variable) -> bool:
    """Whether ``variable`` is a slot of a sharded optimizer (``_ShardSlot``)."""
    return isinstance(variable, _ShardSlot)


def slot_shape(slot) -> tuple[int, ...]:
    """A sharded slot's whole shape (its weight's)."""
    return slot._tfdist_slot.shape


def slot_replicas(slot) -> int:
    """The replicas a sharded slot is split over."""
    return slot._tfdist_layout.replicas


def local_shards(slot) -> list[tuple[int, object]]:
    """``(replica id, component)`` of each of this process's replicas' shards of a sharded slot (a worker's local
    replicas follow those of the workers before it, as TensorFlow numbers them)."""
    strategy = slot._tfdist_strategy
    components = strategy.experimental_local_results(slot.value)
    first = process_group.worker_rank(strategy) * len(components)
    return [(first + k, component) for k, component in enumerate(components)]
