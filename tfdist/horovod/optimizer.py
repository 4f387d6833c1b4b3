"""``hvd.DistributedOptimizer``, ``hvd.DistributedGradientTape`` and ``hvd.load_model``.

Horovod's semantics, outside any strategy: each process computes gradients on its own
batch, and they are averaged across processes before they are applied. Where tfdist knows
each process's examples in the step (``fit``'s batch; a tape's ``tfdist.compute_average_loss``)
the average weighs each process by them, as one device weighs every example (Horovod
averages the processes' means; ``TFDIST_BATCH_WEIGHTING=keras`` gives that back).

* ``DistributedOptimizer(opt)`` returns a copy of ``opt`` (same Keras class, same config,
  so it saves and loads as ``opt`` would) whose update all-reduces the gradients first:
  in ``model.fit`` and in ``optimizer.apply_gradients``. The all-reduce sits where Keras
  applies clipping, so clipping sees the averaged gradient, and with
  ``backward_passes_per_step=k`` it runs once per k micro-batches (Keras' own
  accumulation adds them up locally; there is no strategy here, so it works).
* ``DistributedGradientTape(tape)`` all-reduces in ``tape.gradient``; given a
  ``LossScaleOptimizer``'s ``scale_loss(loss)``, a float16 wire carries the gradients
  unscaled (``tfdist.keras_fixes.scaled_loss``), as the optimizer's does.

Both fuse the gradients into buckets, one all-reduce per bucket and dtype, last layers
first, so inside a ``tf.function`` communication overlaps the backward pass
(``tfdist.buckets``; Horovod's tensor fusion, on the backward pass's schedule), and keep
their collective keys across retraces (``tfdist.process_group.KeyCache``).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras.src.optimizers.base_optimizer import BaseOptimizer

from tfdist import buckets, step_clock
from tfdist import compression as compression_lib
from tfdist import optimizer as optimizer_lib
from tfdist import process_group, sharding
from tfdist.compression import Compression
from tfdist.horovod import uneven as join_lib
from tfdist.horovod.basics import Average, Sum, global_process_set, group_of
from tfdist.horovod.ops import check_op
from tfdist.errors import CompressionError, ShardingError
from tfdist.keras_fixes import batch_shares, scaled_loss, sharded_state
from tfdist.patching import Patch

# The Keras method _AllReduceBeforeUpdate overrides: if Keras stopped calling it, each process
# would train alone; a changed signature refuses to build the optimizer.
keras_internals = Patch(
    "horovod_distributed_optimizer", "tfdist.horovod",
    without="hvd.DistributedOptimizer would not average gradients across processes: each would train alone.")
keras_internals.overrides(BaseOptimizer, "_clip_gradients", ("self", "grads"))
keras_internals.overrides(BaseOptimizer, "_backend_apply_gradients", ("self", "grads", "trainable_variables"))


_LOCAL_VARS = ("tfdist.horovod all-reduces every gradient; it has no worker-local variables. Compute the "
               "local layers' gradients with a second, plain tf.GradientTape and apply them with their own "
               "optimizer.")


class GradientReduction:
    """How one DistributedOptimizer or DistributedGradientTape combines gradients across processes.

    Args:
        op: Average or Sum.
        compression: ``Compression.none`` or ``Compression.fp16``.
        sparse_as_dense: densify ``tf.IndexedSlices`` gradients before reducing them.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size() / factor`` after it.
        process_set: the ranks that average together.
        aggregation_scale: multiplies the result (``backward_passes_per_step`` summed,
            not averaged, as Horovod does by default).
        groups: Horovod's explicit fusion groups (accepted; gradients are fused by dtype).
        per_tape: made for one tape (created anew every step or trace): its collective keys
            and its ``hvd.join()`` stand-in go by ``name``, which every rank computes alike.

    Raises:
        ValueError: Adasum or an unknown op, a predivide factor with op != Average, bad groups.
        TypeError: a compression without compress/decompress.
    """

    def __init__(self, op: str = Average, compression=Compression.none, sparse_as_dense: bool = False,
                 gradient_predivide_factor: float = 1.0, process_set=global_process_set,
                 aggregation_scale: float = 1.0, groups: Any = None, per_tape: bool = False):
        self.op = check_op(op, allowed=(Average, Sum))
        if gradient_predivide_factor != 1.0 and self.op != Average:
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} needs op=hvd.Average "
                             f"(it splits the average before and after the sum); received op={op!r}.")
        if not (isinstance(gradient_predivide_factor, (int, float)) and gradient_predivide_factor > 0):
            raise ValueError(f"gradient_predivide_factor must be a positive number; received "
                             f"{gradient_predivide_factor!r}.")
        if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups >= 0)):
            raise ValueError(f"groups must be a non-negative integer or a list of lists of variables; received "
                             f"groups={groups!r}.")
        self.compression = compression_lib.check(compression)
        self.sparse_as_dense = sparse_as_dense
        self.prescale = 1.0 / gradient_predivide_factor
        self.postscale = gradient_predivide_factor * aggregation_scale
        self.process_set = process_set
        self.keys: dict[int, process_group.KeyCache] = {}  # per bucket
        self.per_tape = per_tape
        self.name: tuple = ()
        self._flag_keys = process_group.KeyCache()
        self._signature: list = []  # (shape, dtype) of the gradients of the last step, for hvd.join()
        self._sparse = self._finite_checked = self._eager = False
        self._stand_in = None
        self._flag, self._last_count = join_lib.ACTIVE, None
        self._weighed = False  # the last step weighed each process by its examples (``reduce``)
        self.optimizer = None  # the DistributedOptimizer it belongs to, if any (hvd.join applies its updates)
        self.reduced_already = False  # hvd.join's stand-in applies gradients it has reduced itself
        self.variables: list = []  # a tape's: the variables its gradients were of (hvd.join makes them equal)

    def reduce(self, gradients: list, loss_scale=None) -> list:
        """The gradients combined across the process set; None entries stay None.

        ``loss_scale``: the gradients are of a loss scaled by it; on a lossy wire (fp16) they
        travel divided by it (scaled ones overflow float16 where one device would not).
        """
        present = [i for i, g in enumerate(gradients) if g is not None]
        tensors = [gradients[i] for i in present]
        if self.sparse_as_dense or not tf.executing_eagerly():
            # Inside a tf.function always dense, as on the Keras path (keras_fixes.gradient_buckets._dense): a
            # gathered IndexedSlices has the step's row count as its shape, and a step or retrace with another
            # count (a partial batch) would meet the shape TensorFlow recorded for that collective's key.
            tensors = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in tensors]
        if self.compression is Compression.none:
            loss_scale = None
        if loss_scale is not None:
            tensors = [_times(t, 1 / loss_scale) for t in tensors]
        self.name = self._name(tensors)
        if self.per_tape and not tf.executing_eagerly():
            self.name, self.keys = process_group.trace_key_caches(self.name)  # the same keys in every trace
        join_lib.record(self)
        self._sparse = self._sparse or any(isinstance(t, tf.IndexedSlices) for t in tensors)
        self._signature = [(t.shape, t.dtype) for t in tensors]
        self._eager = tf.executing_eagerly()
        join_lib.count_step(self)
        matrices = self._powersgd_matrices(tensors)
        if matrices:  # reduced apart (two collectives), the rest below as before
            compressed = self._powersgd_reduce([tensors[i] for i in matrices], [self.optimizer._tfdist_powersgd[k]
                                                                                for k in matrices.values()])
            tensors = [tf.zeros([0], t.dtype) if i in matrices else t for i, t in enumerate(tensors)]
        if self._flag == join_lib.JOINED:  # hvd.join's stand-in (an apply of zeros): no examples, weighed as before
            examples = tf.constant(0.0) if self._weighed else None
        else:
            examples = batch_shares.examples_to_weigh()
            self._weighed = examples is not None and self.op == Average and not matrices and not (
                self.optimizer is not None and (self.optimizer.gradient_accumulation_steps or 1) > 1)
            examples = examples if self._weighed else None
        reduced, self._last_count = self._reduce(tensors, self._flag, examples)
        if matrices:
            for i, value in zip(matrices, compressed):
                reduced[i] = value
        if loss_scale is not None:
            reduced = [_times(t, loss_scale) for t in reduced]
        result = list(gradients)
        for i, value in zip(present, reduced):
            result[i] = value
        return result

    def _powersgd_matrices(self, tensors: list) -> dict:
        """{index in ``tensors``: state key} of the gradients PowerSGD reduces (a DistributedOptimizer's, built)."""
        states = getattr(self.optimizer, "_tfdist_powersgd", None)
        variables = getattr(self.optimizer, "_tfdist_applying", None)
        if not states or variables is None or len(variables) != len(tensors):
            return {}
        keys = [self.optimizer._var_key(v) for v in variables]
        return {i: key for i, key in enumerate(keys) if key in states}

    def _powersgd_reduce(self, gradients: list, states: list) -> list:
        """``PowerSGD.reduce`` over the process set, each process one replica; updates the optimizer's state."""
        group = group_of(self.process_set, "DistributedOptimizer")
        calls = iter(range(3))  # the warm-up's exact all-reduce, P's and Q's: keys of their own, kept across retraces
        scale = self.prescale * self.postscale / (group.size if self.op == Average else 1)

        def allreduce(tensors):
            return group.grouped_allreduce(list(tensors), self.op, self.prescale, self.postscale,
                                           keys=self._keys(f"powersgd{next(calls)}"))

        reduced, errors, qs = self.compression.reduce(
            [tf.convert_to_tensor(g) for g in gradients], [e.value for e, _ in states], [q.value for _, q in states],
            self.optimizer.iterations, allreduce, share=1.0 / (group.size * scale))
        for (error, q), new_error, new_q in zip(states, errors, qs):
            error.assign(new_error)
            q.assign(new_q)
        return reduced

    def _name(self, tensors: list) -> tuple:
        """What this reduction does, the same on every rank: options and gradient shapes (a tape's), or its id."""
        if not self.per_tape:
            return ("optimizer", id(self))
        shapes = tuple((("rows", *t.values.shape[1:]) if isinstance(t, tf.IndexedSlices) else tuple(t.shape),
                        t.dtype.name) for t in tensors)
        compression = getattr(self.compression, "__name__", type(self.compression).__name__)
        return ("tape", tuple(self.process_set.ranks), self.op, self.prescale, self.postscale, compression, shapes)

    def _reduce(self, tensors: list, joined: float, examples=None) -> tuple[list, tf.Tensor | None]:
        """All-reduces ``tensors`` plus the join flag (``tfdist.horovod.uneven``); returns them and the joined count.

        ``examples``: this process's examples in the step; each process's gradients then weigh by its share
        of the processes' examples, as one device weighs every example: the count rides with the join flag
        (``_count_rides``), or the counts are all-reduced first (``_weigh_apart``).
        """
        group = group_of(self.process_set, "DistributedOptimizer")
        op, flags = self.op, [tf.constant(joined, tf.float32)] if group.size > 1 else []
        riding = examples is not None and group.size > 1 and self._count_rides(tensors)
        if examples is not None and group.size > 1:
            if riding:  # the count travels with the join flag; the sums are divided by the total after
                tensors, op, flags = [_times(t, examples) for t in tensors], Sum, flags + [examples]
            else:
                tensors = self._weigh_apart(group, tensors, examples)
        # Bucket by bucket, last layers first, so each all-reduce overlaps the rest of the backward pass
        # (tfdist.buckets); eagerly nothing overlaps, so one call (each eager call also checks shapes).
        if tf.executing_eagerly():
            plan = [list(range(len(tensors)))]
        else:
            buckets.check_agreement(group)
            plan = buckets.plan([buckets.nbytes(t) for t in tensors])
        plan = plan or [[]]
        reduced: list = [None] * len(tensors)
        joined_count = []

        def reduce_buckets(on_ready, on_reduced):
            summed = []
            for number, bucket in enumerate(plan):
                extra = flags if number == 0 else []  # the join flag travels with the first bucket
                inputs = on_ready(number, [tensors[i] for i in bucket], sum(buckets.nbytes(tensors[i]) for i in bucket))
                out = on_reduced(number, group.grouped_allreduce(inputs + extra, op, self.prescale,
                                                                 self.postscale, self.compression,
                                                                 keys=self._keys(number)))
                for i, value in zip(bucket, out):
                    reduced[i] = value
                joined_count.extend(out[len(bucket):])
                summed += out[:len(bucket)]
            return summed

        step_clock.buckets_timed(tensors, reduce_buckets)  # the step's times (tfdist.step_clock)
        if not flags:
            return reduced, None
        scale = self.prescale * self.postscale / (group.size if op == Average else 1)
        if riding:
            total = joined_count[1] / scale
            reduced = [_times(t, tf.math.divide_no_nan(1.0, total)) for t in reduced]
        return reduced, joined_count[0] / scale

    def _count_rides(self, tensors: list) -> bool:
        """Whether gradients times the example count may travel as they are: not on a float16 wire or in float16."""
        return self.compression is Compression.none and all(
            tf.as_dtype(t.dtype) in (tf.float32, tf.float64) for t in tensors)

    def _weigh_apart(self, group, tensors: list, examples) -> list:
        """The processes add their counts up first (one scalar all-reduce), and each process's gradients are
        multiplied by count * processes / total: near 1, so a float16 wire or float16 gradients do not overflow."""
        total = group.grouped_allreduce([examples], Sum, keys=self._keys("examples"))[0]  # kept across retraces
        factor = tf.math.divide_no_nan(examples * group.size, total)
        return [_times(t, factor) for t in tensors]

    def _keys(self, bucket: int | str) -> process_group.KeyCache:
        """The instance keys of one bucket's (or the examples') all-reduce, kept across retraces."""
        return self.keys.setdefault(bucket, process_group.KeyCache())

    def stand_in(self) -> tf.Tensor:
        """One step with zero gradients, flagged joined; returns how many ranks have joined.

        With a DistributedOptimizer the step is its ``apply``: the joined rank applies the
        average the others computed, so every rank ends with the same weights and slots.
        Otherwise (a DistributedGradientTape) it is the all-reduce alone, and ``join`` then
        broadcasts the tape's variables from the last rank to join.
        """
        if self._stand_in is None:
            step = self._apply_zeros if self._can_apply() else self._reduce_zeros
            # Eagerly when the rank's own steps ran eagerly: the collectives (and their checks) must match.
            self._stand_in = step if self._eager else tf.function(step)
        self._flag = join_lib.JOINED
        try:
            return self._stand_in()
        finally:
            self._flag = join_lib.ACTIVE

    def applies_in_join(self) -> bool:
        """Whether ``stand_in`` applies the others' updates (a DistributedOptimizer's); else ``join`` broadcasts
        the variables of the tapes of this name."""
        return self._can_apply()

    def _can_apply(self) -> bool:
        optimizer = self.optimizer
        if optimizer is None or (optimizer.gradient_accumulation_steps or 1) > 1:
            return False
        variables = list(getattr(optimizer, "_trainable_variables", None) or [])
        # a gradient traced from inputs of a dynamic shape may not know its static shape: compatible is enough
        return len(variables) == len(self._signature) and all(
            tf.TensorShape(shape).is_compatible_with(v.shape) and tf.as_dtype(dtype) == tf.as_dtype(v.dtype)
            for v, (shape, dtype) in zip(variables, self._signature))

    def _apply_zeros(self) -> tf.Tensor:
        """The joined rank's step: all-reduce zeros, then apply the others' average, unless every rank has
        joined (then nobody trained in this round: an apply of zeros would still move Adam's weights)."""
        variables = list(self.optimizer._trainable_variables)
        reduced = self.reduce([tf.zeros(v.shape, v.dtype) for v in variables])
        everyone = self._last_count > group_of(self.process_set, "DistributedOptimizer").size - 0.5

        def apply():  # what the training ranks apply: their gradients were unscaled before they were reduced
            optimizer, scale = self.optimizer, self.optimizer.loss_scale_factor
            self.reduced_already, optimizer.loss_scale_factor = True, None
            try:
                optimizer.apply(reduced, variables)
            finally:
                self.reduced_already, optimizer.loss_scale_factor = False, scale
            return tf.constant(True)

        if tf.executing_eagerly():
            if not bool(everyone):
                apply()
        else:
            tf.cond(everyone, lambda: tf.constant(False), apply)
        return self._last_count

    def _reduce_zeros(self) -> tf.Tensor:
        return self._reduce([tf.zeros(shape, dtype) for shape, dtype in self._signature], join_lib.JOINED,
                            tf.constant(0.0) if self._weighed else None)[1]

    def check_joinable(self) -> None:
        """Raises ValueError when ``hvd.join()`` cannot stand in for this reduction."""
        if self._sparse:
            raise ValueError("hvd.join() cannot stand in for all-reduces of sparse gradients (tf.IndexedSlices, "
                             "gathered, not summed): pass sparse_as_dense=True to hvd.DistributedOptimizer or "
                             "hvd.DistributedGradientTape.")
        if self._finite_checked:
            raise ValueError("hvd.join() cannot stand in for a LossScaleOptimizer's all-reduced finite check: give "
                             "every rank the same number of steps, or train without loss scaling.")

    def all_finite(self, finite: tf.Tensor) -> tf.Tensor:
        """True when ``finite`` is True on every rank of the process set (loss scaling's skip decision)."""
        group = group_of(self.process_set, "DistributedOptimizer")
        if group.size == 1:
            return finite
        self._finite_checked = True
        flag = tf.cast(tf.logical_not(finite), tf.float32)
        not_finite = group.grouped_allreduce([flag], "sum", keys=self._flag_keys)[0]
        return tf.equal(not_finite, 0.0)


def _times(gradient, factor):
    """``gradient`` (a tensor or ``tf.IndexedSlices``) times ``factor``, in the gradient's dtype."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(_times(gradient.values, factor), gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype) if gradient.dtype.is_floating else gradient


class _AllReduceBeforeUpdate:
    """Keras optimizer mixin: averages gradients across processes just before each update."""

    _tfdist_reduction: GradientReduction
    keras_internals = keras_internals

    def build(self, variables):
        """Keras' build, then PowerSGD's state for each compressed weight (``tfdist.optimizer.powersgd_state``)."""
        super().build(variables)
        compression = self._tfdist_reduction.compression
        if compression_lib.is_powersgd(compression):
            # past Keras' attribute tracking: the variables are tracked once, as the optimizer's own
            object.__setattr__(self, "_tfdist_powersgd", optimizer_lib.powersgd_state(self, compression, variables))

    def _backend_apply_gradients(self, grads, trainable_variables):
        # The variables of the gradients _clip_gradients reduces (PowerSGD keeps state per variable); set past
        # Keras' attribute tracking, which would make a list of variables part of what the optimizer saves.
        object.__setattr__(self, "_tfdist_applying", tuple(trainable_variables))
        try:
            return super()._backend_apply_gradients(grads, trainable_variables)
        finally:
            object.__setattr__(self, "_tfdist_applying", None)

    def _clip_gradients(self, grads):
        # Keras calls this once per update, with the gradients about to be applied (after
        # local accumulation, before clipping and weight decay): the one place to reduce.
        reduction = self._tfdist_reduction
        return super()._clip_gradients(list(grads) if reduction.reduced_already else reduction.reduce(list(grads)))

    def register_local_var(self, var):
        """Horovod's per-variable opt-out; not supported (every gradient is all-reduced)."""
        raise NotImplementedError(_LOCAL_VARS)


def DistributedOptimizer(optimizer, name=None, *, device_dense="", device_sparse="",  # noqa: N802
                         compression=None, sparse_as_dense=False, gradient_predivide_factor=1.0,
                         op=Average, backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True,
                         use_locking=False, shard_optimizer_state=None):
    """A copy of a Keras optimizer whose updates average gradients across processes first.

    Args:
        optimizer: a Keras optimizer (``tf.optimizers.Adam(lr)``, ``keras.optimizers.SGD``,
            a ``LossScaleOptimizer``). A built one is re-created from its config, as
            Horovod does (its slot values are not kept).
        name: accepted (Horovod names its ops with it).
        compression: ``hvd.Compression.none``, ``hvd.Compression.fp16`` or ``hvd.Compression.powersgd(...)``
            (its state is this optimizer's; not with backward_passes_per_step > 1); None: ``TFDIST_COMPRESSION``,
            else none. Under PowerSGD the processes' gradients are averaged unweighted by their examples.
        sparse_as_dense: densify sparse gradients before reducing them.
        gradient_predivide_factor: see ``GradientReduction``.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        backward_passes_per_step: k: gradients of k batches are added up locally, then
            all-reduced once and applied (their sum, as Horovod; the optimizer's own
            ``gradient_accumulation_steps`` keeps Keras' mean).
        average_aggregated_gradients: divide those k summed gradients by k.
        num_groups, groups: accepted; gradients are fused into one all-reduce per dtype.
        process_set: the ranks that average together.
        device_dense, device_sparse, scale_local_gradients, use_locking: accepted, no effect.
        shard_optimizer_state: True (or ``TFDIST_SHARD_OPTIMIZER_STATE=1``) is a ShardingError:
            Horovod scripts save on rank 0 alone, which cannot gather the other ranks' shards.

    Returns:
        An optimizer of the same Keras class.

    Raises:
        TypeError: not a Keras optimizer (a ``tf.compat.v1`` optimizer is named), or a ``MultiOptimizer``.
        ValueError: Adasum, an unknown op, bad ``backward_passes_per_step``, or one that
            disagrees with the optimizer's own ``gradient_accumulation_steps``.
        ShardingError: ``shard_optimizer_state`` asked for.
    """
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise TypeError(f"tfdist.horovod.DistributedOptimizer wraps Keras optimizers; received the TF1 optimizer "
                        f"{type(optimizer).__name__}. Use a Keras one, e.g. tf.optimizers.SGD(lr) or "
                        "tf.optimizers.Adam(lr).")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a Keras optimizer; received {type(optimizer).__name__}: "
                        f"{optimizer!r}.")
    optimizer_lib.check_one_optimizer(optimizer, "hvd.DistributedOptimizer")
    optimizer_lib.check_backward_passes(backward_passes_per_step)
    if sharding.check(shard_optimizer_state):
        raise ShardingError(sharded_state.HOROVOD_REFUSAL)
    compression = optimizer_lib.resolve_compression(compression)
    optimizer_lib.check_powersgd(compression, backward_passes_per_step, False)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):  # reduce in the inner optimizer
        inner = DistributedOptimizer(
            optimizer.inner_optimizer, name, compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, groups=_groups(groups, num_groups),
            process_set=process_set, shard_optimizer_state=False)
        config = optimizer.get_config()
        return keras.optimizers.LossScaleOptimizer(inner, initial_scale=config["initial_scale"],
                                                   dynamic_growth_steps=config["dynamic_growth_steps"])
    config = optimizer.get_config()
    own = config.get("gradient_accumulation_steps")
    if own and backward_passes_per_step not in (1, own):
        raise ValueError(f"The optimizer already has gradient_accumulation_steps={own}, but "
                         f"backward_passes_per_step={backward_passes_per_step}; pass one of them.")
    steps = own or backward_passes_per_step
    config["gradient_accumulation_steps"] = steps if steps > 1 else None
    reduction = GradientReduction(op, compression, sparse_as_dense, gradient_predivide_factor, process_set,
                                  aggregation_scale=1.0 if average_aggregated_gradients or own else float(steps),
                                  groups=_groups(groups, num_groups))
    distributed = optimizer_lib._distributed_class(type(optimizer), _AllReduceBeforeUpdate).from_config(config)
    distributed._tfdist_reduction = reduction
    reduction.optimizer = distributed
    return distributed


class _AllReduceGradients:
    """``tf.GradientTape`` mixin: ``gradient`` returns gradients combined across processes."""

    _tfdist_reduction: GradientReduction

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        # What hvd.join() makes equal on every rank (the last rank to join's values) after a tape loop.
        self._tfdist_reduction.variables = [s for s in tf.nest.flatten(sources) if hasattr(s, "assign")]
        flat = tf.nest.flatten(grads, expand_composites=False)
        return tf.nest.pack_sequence_as(grads, self._tfdist_reduction.reduce(flat, scaled_loss.scale_of(target)))

    def register_local_source(self, source):
        """Horovod's per-variable opt-out; not supported (every gradient is all-reduced)."""
        raise NotImplementedError(_LOCAL_VARS)


def _groups(groups, num_groups: int):
    """Horovod's ``groups``, or its older ``num_groups`` (0: none)."""
    return groups if groups is not None else (num_groups or None)


_tape_classes: dict[type, type] = {}


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,  # noqa: N802
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Wraps a ``tf.GradientTape`` so ``tape.gradient`` returns gradients averaged across processes.

    Arguments as ``DistributedOptimizer``'s. The returned tape is an instance of (a
    subclass of) ``type(gradtape)`` that shares its recording.
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape; received {type(gradtape).__name__}.")
    if compression_lib.is_powersgd(compression):
        raise CompressionError(f"hvd.DistributedGradientTape does not take {compression!r} yet: its error feedback "
                               "and Q are state kept from step to step, which a tape made anew each step has no "
                               "place for. Use hvd.DistributedOptimizer(opt, compression=...) with "
                               "optimizer.apply_gradients, or compression=hvd.Compression.fp16.")
    base = type(gradtape)
    if base not in _tape_classes:
        _tape_classes[base] = type(base.__name__, (_AllReduceGradients, base), {"__module__": base.__module__})
    tape = object.__new__(_tape_classes[base])
    tape.__dict__.update(gradtape.__dict__)
    tape._tfdist_reduction = GradientReduction(op, compression, sparse_as_dense, gradient_predivide_factor,
                                               process_set, groups=_groups(groups, num_groups), per_tape=True)
    return tape


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts=False):
    """Loads a saved Keras model and wraps its optimizer in ``DistributedOptimizer``, keeping its state.

    Args:
        filepath: a ``.keras`` or ``.h5`` file.
        custom_optimizers: optimizer classes the file may name besides Keras' own.
        custom_objects: as ``keras.saving.load_model``.
        compression: the wrapped optimizer's compression.
        legacy_opts: accepted (Keras 3 has no legacy optimizers).

    Returns:
        The model, its optimizer all-reducing gradients (Average), with its saved slot values.
    """
    if compression_lib.is_powersgd(compression):
        raise CompressionError(f"hvd.load_model does not take {compression!r} yet (a loaded optimizer is built "
                               "without PowerSGD's state): build a new hvd.DistributedOptimizer(opt, compression=...) "
                               "and load the weights into it.")
    objects = {cls.__name__: cls for cls in custom_optimizers or []}
    objects.update(custom_objects or {})
    model = keras.saving.load_model(filepath, custom_objects=objects or None)
    optimizer = model.optimizer
    if optimizer is not None:
        target = optimizer.inner_optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else optimizer
        steps = target.gradient_accumulation_steps or 1
        # Same variables and config, new behaviour: the mixin adds methods only, so the
        # loaded slot values stay as they are.
        target.__class__ = optimizer_lib._distributed_class(type(target), _AllReduceBeforeUpdate)
        target._tfdist_reduction = GradientReduction(compression=compression, aggregation_scale=float(steps))
        target._tfdist_reduction.optimizer = target
    return model
