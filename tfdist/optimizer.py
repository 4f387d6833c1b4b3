"""``DistributedOptimizer``: Horovod's name for a Keras optimizer that accumulates and compresses.

Under tf.distribute, Keras already all-reduces gradients inside ``optimizer.apply`` (in
buckets, ``tfdist.buckets``), and Keras' own ``gradient_accumulation_steps`` works under
any strategy once tfdist is imported (``tfdist.keras_fixes.accumulation``, keras#20582):
between updates each replica accumulates its own gradients locally; every k-th
micro-batch the sums are all-reduced once and their mean applied. Accumulating k
micro-batches of global size b equals one step at k*b, for any Keras optimizer (Adam's
step count included). ``DistributedOptimizer`` adds Horovod's spelling
(``backward_passes_per_step``) and ``compression=Compression.fp16``, which all-reduces the
gradients in float16 (half the bytes; about 3 significant digits) and updates in their
own dtype, or ``compression=Compression.powersgd(rank=4)``, which all-reduces two thin factors
of each gradient matrix with error feedback (``tfdist.compression.PowerSGD``): its state (each
replica's error feedback, the warm-started Q of each matrix) is optimizer state, built with the
optimizer's slots and saved with them. ``TFDIST_COMPRESSION`` (``none``, ``fp16``,
``powersgd:RANK[:START_STEP]``) is the compression of a ``DistributedOptimizer`` given none.
"""

from __future__ import annotations

from typing import Callable

import keras
import tensorflow as tf

from keras.src.backend.tensorflow.optimizer import TFOptimizer

from tfdist import compression as compression_lib
from tfdist.compression import Compression
from tfdist.errors import CompressionError, KerasCompatibilityError
from tfdist.keras_fixes import accumulation, batch_shares, gradient_buckets, sharded_state
from tfdist import buckets, patching, sharding, step_clock
from tfdist.patching import Patch

# The Keras methods _DistributedMixin overrides: if Keras stopped calling them, gradients would
# silently not be reduced or accumulated, so a changed signature refuses to build the optimizer.
keras_internals = Patch(
    "distributed_optimizer", "keras#20582",
    without="tfdist.DistributedOptimizer would not compress its gradients as documented.")
keras_internals.overrides(TFOptimizer, "_all_reduce_sum_gradients", ("self", "grads_and_vars"))

_classes: dict[tuple[type, type], type] = {}


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer,  # noqa: N802  (Horovod's name)
                         backward_passes_per_step: int = 1,
                         compression=None,
                         shard_optimizer_state: bool | None = None) -> keras.optimizers.Optimizer:
    """Returns a copy of ``optimizer`` that accumulates gradients and works under any strategy.

    The copy is an instance of a subclass of ``type(optimizer)``, made from its config, so
    it composes with ``LossScaleOptimizer`` and saves as the original class (with
    ``gradient_accumulation_steps`` set). ``opt.backward_passes_per_step`` holds k and
    ``opt.tfdist_distributed`` is True. Call it inside the strategy scope, where Keras
    optimizers must be created. Clipping applies to the all-reduced (mean) gradient.

    Args:
        optimizer: an unbuilt Keras optimizer (not yet used to train).
        backward_passes_per_step: k, the micro-batches whose mean gradient makes one
            update (accumulated locally, all-reduced once); 1 disables accumulation. An
            optimizer created with ``gradient_accumulation_steps=k`` means the same.
        compression: ``Compression.none``, or ``Compression.fp16`` to all-reduce the
            gradients in float16 (opt-in: results differ from float32 by about 1e-3), or
            ``Compression.powersgd(rank=...)`` (low-rank factors with error feedback; not with
            accumulation or sharded state). None: ``TFDIST_COMPRESSION``, else none.
        shard_optimizer_state: True: under N > 1 replicas each keeps 1/N of the optimizer's
            state (ZeRO-1, ``tfdist.keras_fixes.sharded_state``); None: as ``tfdist.scope`` or
            ``TFDIST_SHARD_OPTIMIZER_STATE`` say.

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer or is a ``MultiOptimizer``, or ``compression`` is
            not a compression.
        CompressionError: a bad ``TFDIST_COMPRESSION``; PowerSGD with k > 1 or sharded state.
        ValueError: k is not a positive int, disagrees with the optimizer's own
            ``gradient_accumulation_steps``, or the optimizer was already built.
        KerasCompatibilityError: k > 1 with a Keras whose accumulation tfdist cannot fix.
        ShardingError: ``shard_optimizer_state=True`` for an optimizer or option it cannot shard.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer; received "
                        f"{type(optimizer).__name__}.")
    check_one_optimizer(optimizer, "tfdist.DistributedOptimizer")
    check_backward_passes(backward_passes_per_step)
    own = optimizer.gradient_accumulation_steps
    if own and backward_passes_per_step not in (1, own):
        raise ValueError(f"The optimizer already has gradient_accumulation_steps={own}, but "
                         f"backward_passes_per_step={backward_passes_per_step}; pass one of them.")
    steps = own or backward_passes_per_step
    if optimizer.built:
        raise ValueError(f"DistributedOptimizer needs an unbuilt optimizer, but {optimizer.name} already "
                         "holds variables; wrap it before compile() or the first training step.")
    if steps > 1 and not accumulation.patch.apply():
        raise KerasCompatibilityError(
            f"backward_passes_per_step={steps} needs tfdist's fix of Keras' accumulation, which this Keras does not "
            f"allow: {accumulation.patch.problem}. Install Keras {patching.TESTED_KERAS}, or pass "
            "backward_passes_per_step=1.")
    compression = compression_lib.check(resolve_compression(compression))
    if shard_optimizer_state is not None:
        sharding.check(shard_optimizer_state)
    check_powersgd(compression, steps, shard_optimizer_state)
    config = optimizer.get_config()
    config["gradient_accumulation_steps"] = steps if steps > 1 else None
    distributed = _distributed_class(type(optimizer)).from_config(config)
    distributed.compression = compression
    if shard_optimizer_state is not None:
        sharded_state.mark(distributed, shard_optimizer_state)
    return distributed


def resolve_compression(compression):
    """``compression``, or when None the one ``TFDIST_COMPRESSION`` names (default none); shared with tfdist.horovod."""
    if compression is None:
        compression = compression_lib.from_env() or Compression.none
    return compression


def check_powersgd(compression, steps: int, shard_optimizer_state: bool | None) -> None:
    """Raises CompressionError for PowerSGD with accumulation or sharded optimizer state (not built yet)."""
    if not compression_lib.is_powersgd(compression):
        return
    if steps > 1:
        raise CompressionError(f"{compression!r} does not work with gradient accumulation yet (backward_passes_per_step="
                               f"{steps}): pass backward_passes_per_step=1, or compression=Compression.fp16.")
    if shard_optimizer_state:
        raise CompressionError(f"{compression!r} does not work with shard_optimizer_state=True yet (its error feedback "
                               "is a whole matrix per replica): pass shard_optimizer_state=False, or "
                               "compression=Compression.fp16.")


def check_one_optimizer(optimizer, wrapper: str) -> None:
    """Raises TypeError for a ``MultiOptimizer``, which ``wrapper`` cannot rebuild (shared with tfdist.horovod)."""
    if isinstance(optimizer, keras.optimizers.MultiOptimizer):
        raise TypeError(f"{wrapper} wraps one optimizer; received a MultiOptimizer. Under tfdist a MultiOptimizer "
                        "works as it is (gradients all-reduced once); for accumulation or compression wrap its "
                        f"inner optimizers: keras.optimizers.OptimizerMap({wrapper}(opt, ...), ...).")


def check_backward_passes(backward_passes_per_step) -> None:
    """Raises ValueError unless ``backward_passes_per_step`` is an int >= 1 (shared with tfdist.horovod)."""
    if not (isinstance(backward_passes_per_step, int) and backward_passes_per_step >= 1):
        raise ValueError(f"backward_passes_per_step must be an int >= 1; received "
                         f"backward_passes_per_step={backward_passes_per_step!r}.")


class _DistributedMixin:
    """Keras' all-reduce through ``compression``; accumulation is Keras' own (``keras_fixes.accumulation``)."""

    tfdist_distributed = True
    keras_internals = keras_internals

    @property
    def backward_passes_per_step(self) -> int:
        return self.gradient_accumulation_steps or 1

    compression = Compression.none

    def build(self, variables):
        """Keras' build, then PowerSGD's state for each compressed weight (``powersgd_state``)."""
        super().build(variables)
        if compression_lib.is_powersgd(self.compression):
            if sharded_state.is_sharded(self):
                check_powersgd(self.compression, 1, True)
            # past Keras' attribute tracking: the variables are tracked once, as the optimizer's own
            object.__setattr__(self, "_tfdist_powersgd", powersgd_state(self, self.compression, variables))

    def _all_reduce_sum_gradients(self, grads_and_vars):
        """Keras' all-reduce (every micro-batch when there is no accumulation), through ``compression``."""
        grads_and_vars = list(grads_and_vars)
        if gradient_buckets.already_reduced(self):
            return grads_and_vars
        if compression_lib.is_powersgd(self.compression):
            return self._powersgd_all_reduce(grads_and_vars)
        packed = [self.compression.compress(g) if g is not None else (None, None) for g, _ in grads_and_vars]
        reduced = super()._all_reduce_sum_gradients([(g, v) for (g, _), (_, v) in zip(packed, grads_and_vars)])
        return [(self.compression.decompress(g, context) if g is not None else None, v)
                for (g, v), (_, context) in zip(reduced, packed)]

    def _powersgd_all_reduce(self, grads_and_vars):
        """Matrices through ``PowerSGD.reduce_with``; the rest rides in P's collective when the step weighs by examples.

        In ``fit`` with tfdist's weighting (``batch_shares``: the gradients are sums over each
        replica's examples, divided by the global count after) the rest (vectors, small tensors;
        sparse ones made dense, as in Keras' buckets) and the step's example count ride in P's
        all-reduce: a compressed step launches P's and Q's and no other (each collective has a
        fixed CPU cost that dominated a compressed step: benchmarks/RESULTS.md, issue 52).
        Otherwise (a loss scale, a custom loop) the rest goes first through Keras' buckets, then P
        and Q, as before: under ``LossScaleOptimizer`` the rest launched in the replica's own
        thread with P deadlocked the step (its finite check runs in a merge_call).
        """
        context = tf.distribute.get_replica_context()
        states = getattr(self, "_tfdist_powersgd", {})
        if context is None or not states:
            return super()._all_reduce_sum_gradients(grads_and_vars)
        chosen = [i for i, (g, v) in enumerate(grads_and_vars) if g is not None and self._var_key(v) in states]
        if not chosen:  # nothing compressed in this step: Keras' buckets (which carry the count, if any)
            return super()._all_reduce_sum_gradients(grads_and_vars)
        exact = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None and i not in chosen]
        result = list(grads_and_vars)
        pairs = [states[self._var_key(grads_and_vars[i][1])] for i in chosen]
        count = batch_shares.count_to_reduce()  # this replica's examples, when the sums weigh by them
        # Keras refuses a call with no gradient at all (and, on one replica, warns wrongly of a None one): only the rest
        if count is None and exact:
            for i, pair in zip(exact, super()._all_reduce_sum_gradients([grads_and_vars[i] for i in exact])):
                result[i] = pair
        riding = exact if count is not None else []
        # an Embedding's sparse gradient as the dense matrix it travels as in the buckets anyway
        gradients = [tf.convert_to_tensor(grads_and_vars[i][0]) for i in chosen + riding]

        def reduce(on_ready, on_reduced):
            ready = on_ready(0, gradients, sum(buckets.nbytes(g) for g in gradients))
            reduced, errors, qs, rest = self.compression.reduce_with(
                ready[:len(chosen)], [e.value for e, _ in pairs], [q.value for _, q in pairs], self.iterations,
                _replica_all_reduce(context), share=1.0 / context.num_replicas_in_sync, exact=ready[len(chosen):],
                count=count,
                # an overflow in a gradient sent exact apart skips the step (LossScaleOptimizer): the state stays too
                others_finite=None if riding else compression_lib.all_finite([result[i][0] for i in exact]))
            for (error, q), new_error, new_q in zip(pairs, errors, qs):
                error.assign(new_error)
                q.assign(new_q)
            return on_reduced(0, reduced + rest)

        # timed as one bucket (tfdist.step_clock: the straggler report, the timeline) unless Keras' buckets timed the
        # step already (the rest sent apart): with the rest riding along, or with no rest (a model with no bias)
        timed = step_clock.buckets_timed(gradients, reduce) if riding or not exact else \
            reduce(lambda b, t, n=0: t, lambda b, t: t)
        for i, gradient in zip(chosen + riding, timed):
            result[i] = (gradient, grads_and_vars[i][1])
        return result


def powersgd_state(optimizer, compression, variables) -> dict:
    """PowerSGD's state of ``optimizer`` (shared with tfdist.horovod): {variable key: (error, Q)}.

    For each weight whose gradient ``compression`` compresses: this replica's error feedback
    (the weight's shape, zeros) and Q (``[m, r]``, ``first_q``). Both are sync-on-read variables
    tracked as the optimizer's own, so Keras saves and loads them with its slots and each
    replica writes its own copy inside the step with no cross-replica call: the error as a SUM
    (a checkpoint holds the replicas' total, restored as total / N on each, which the next
    update depends on alone: every step is linear in the sum of the errors), Q as the first
    replica's (all hold the same).
    """
    states = {}
    strategy = getattr(optimizer, "_distribution_strategy", None) or tf.distribute.get_strategy()
    with strategy.scope():
        for variable in variables:
            if compression.matrix_shape(variable.shape, variable.dtype) is None:
                continue
            name = variable.path.replace("/", "_") if hasattr(variable, "path") else variable.name
            index = len(states)
            with keras.name_scope(optimizer.name, caller=optimizer):
                error = keras.Variable(tf.zeros(variable.shape, variable.dtype), trainable=False, aggregation="sum",
                                       synchronization="on_read", name=f"powersgd_error_{name}")
                q = keras.Variable(compression.first_q(variable.shape, variable.dtype, index), trainable=False,
                                   aggregation="only_first_replica", synchronization="on_read",
                                   name=f"powersgd_q_{name}")
            optimizer._track_variable(error)
            optimizer._track_variable(q)
            states[optimizer._var_key(variable)] = (error, q)
    return states


def _replica_all_reduce(context) -> Callable[[list], list]:
    """The sum over the replicas of ``context`` as a function of a list of tensors; with one replica, the identity.

    One replica (one device, or a job restarted on fewer devices) runs PowerSGD as N do, so a
    run's result does not depend on its replica count. ``ReplicaContext.all_reduce`` goes
    through ``merge_call`` under MirroredStrategy and MultiWorkerMirroredStrategy, which fails
    inside the ``tf.cond`` of PowerSGD's warm-up;
    their collective cross-device ops launch from one replica as TensorFlow's own replica-context
    path does (``MirroredExtended._replica_ctx_all_reduce``, used without merge_call under XLA).
    """
    if context.num_replicas_in_sync == 1:
        return list
    strategy = tf.distribute.get_strategy()
    ops = getattr(strategy.extended, "_cross_device_ops", None) or getattr(
        strategy.extended, "_get_cross_device_ops", lambda value: None)(None)
    if not callable(getattr(ops, "_all_reduce", None)):
        raise CompressionError(
            f"Compression.powersgd needs collective all-reduce under {type(strategy).__name__}; this one uses "
            f"{type(ops).__name__}. On CPUs build it with no cross_device_ops (TensorFlow's choice there is collective), "
            "use tf.distribute.MultiWorkerMirroredStrategy, or use Compression.fp16.")
    options = tf.distribute.experimental.CommunicationOptions()

    def all_reduce(tensors):
        # one collective per dtype (a collective concatenates its tensors), in the order of first appearance: the
        # same on every worker, as the dtypes are the weights'
        tensors, result = list(tensors), [None] * len(tensors)
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            indices = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            reduced = ops._all_reduce(tf.distribute.ReduceOp.SUM, [tensors[i] for i in indices], context._replica_id,
                                      options)
            for i, value in zip(indices, reduced):
                result[i] = value
        return result
    return all_reduce


def _distributed_class(base: type, mixin: type = _DistributedMixin) -> type:
    """``mixin`` over ``base``, named and placed like ``base`` so saved models load as ``base``.

    ``tfdist.horovod`` passes its own mixin (gradients averaged across processes).
    """
    if not mixin.keras_internals.apply():
        raise KerasCompatibilityError(
            f"{mixin.__name__} overrides Keras internals that this Keras changed: {mixin.keras_internals.problem}. "
            f"Without them, {mixin.keras_internals.without} Install Keras {patching.TESTED_KERAS}.")
    if (mixin, base) not in _classes:
        _classes[mixin, base] = type(base.__name__, (mixin, base),
                                     {"__module__": base.__module__, "__qualname__": base.__qualname__})
    return _classes[mixin, base]
