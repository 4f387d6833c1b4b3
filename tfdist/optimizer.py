"""``DistributedOptimizer``: Horovod's name, and gradient accumulation that works under a strategy.

Under tf.distribute, Keras already all-reduces gradients inside ``optimizer.apply``; what
is missing is accumulation. Keras' own ``gradient_accumulation_steps`` puts the update,
which calls ``merge_call``, inside a ``tf.cond`` in replica context, and every strategy
then fails with "merge_call called while defining a new graph" (keras#20582).

The fix keeps Keras' accumulation (its accumulator variables, its ``iterations`` that
counts real updates) and reorders one method, ``_backend_apply_gradients``:

1. in replica context, add this micro-batch's gradients to this replica's accumulator
   (local arithmetic, no collective);
2. one ``merge_call``; in cross-replica context, a ``tf.cond`` either stores each
   replica's new sums in its accumulators, or, every k-th micro-batch, all-reduces the
   sums (the only collective of the k steps), applies their mean (clipping, weight decay,
   the wrapped optimizer's own ``update_step``) and zeroes the accumulators. Both
   branches only touch variables through ``strategy.extended.update``, legal inside a
   ``cond``; both take the same branch on every replica and worker.

Between updates each replica's accumulators hold its own sums; the weights stay identical.
Accumulating k micro-batches of global size b equals one step at k*b, for any Keras
optimizer (Adam's step count included). ``compression=Compression.fp16`` all-reduces the
gradients in float16 (half the bytes; about 3 significant digits) and updates in their
own dtype.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.optimizers.base_optimizer import BaseOptimizer

from tfdist import buckets
from tfdist import compression as compression_lib
from tfdist.compression import Compression
from tfdist.errors import KerasCompatibilityError
from tfdist.keras_fixes import gradient_buckets
from tfdist import patching, process_group
from tfdist.patching import Patch

# The Keras methods _DistributedMixin overrides: if Keras stopped calling them, gradients would
# silently not be reduced or accumulated, so a changed signature refuses to build the optimizer.
keras_internals = Patch(
    "distributed_optimizer", "keras#20582",
    without="tfdist.DistributedOptimizer would neither all-reduce nor accumulate gradients as documented.")
keras_internals.overrides(BaseOptimizer, "_backend_apply_gradients", ("self", "grads", "trainable_variables"))
keras_internals.overrides(TFOptimizer, "_all_reduce_sum_gradients", ("self", "grads_and_vars"))

_classes: dict[tuple[type, type], type] = {}


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer,  # noqa: N802  (Horovod's name)
                         backward_passes_per_step: int = 1,
                         compression=Compression.none) -> keras.optimizers.Optimizer:
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
            gradients in float16 (opt-in: results differ from float32 by about 1e-3).

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer, or ``compression`` is not a compression.
        ValueError: k is not a positive int, disagrees with the optimizer's own
            ``gradient_accumulation_steps``, the optimizer was already built, or it uses
            ``use_ema`` together with accumulation.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer; received "
                        f"{type(optimizer).__name__}.")
    check_backward_passes(backward_passes_per_step)
    own = optimizer.gradient_accumulation_steps
    if own and backward_passes_per_step not in (1, own):
        raise ValueError(f"The optimizer already has gradient_accumulation_steps={own}, but "
                         f"backward_passes_per_step={backward_passes_per_step}; pass one of them.")
    steps = own or backward_passes_per_step
    if optimizer.built:
        raise ValueError(f"DistributedOptimizer needs an unbuilt optimizer, but {optimizer.name} already "
                         "holds variables; wrap it before compile() or the first training step.")
    if steps > 1 and optimizer.use_ema:
        raise ValueError("DistributedOptimizer does not combine use_ema=True with gradient accumulation "
                         f"(backward_passes_per_step={steps}); drop one of them.")
    compression_lib.check(compression)
    config = optimizer.get_config()
    config["gradient_accumulation_steps"] = steps if steps > 1 else None
    distributed = _distributed_class(type(optimizer)).from_config(config)
    distributed.compression = compression
    return distributed


def check_backward_passes(backward_passes_per_step) -> None:
    """Raises ValueError unless ``backward_passes_per_step`` is an int >= 1 (shared with tfdist.horovod)."""
    if not (isinstance(backward_passes_per_step, int) and backward_passes_per_step >= 1):
        raise ValueError(f"backward_passes_per_step must be an int >= 1; received "
                         f"backward_passes_per_step={backward_passes_per_step!r}.")


class _DistributedMixin:
    """Overrides the one Keras method whose ``cond`` breaks under tf.distribute."""

    tfdist_distributed = True
    keras_internals = keras_internals

    @property
    def backward_passes_per_step(self) -> int:
        return self.gradient_accumulation_steps or 1

    compression = Compression.none

    def _all_reduce_sum_gradients(self, grads_and_vars):
        """Keras' all-reduce (every micro-batch when there is no accumulation), through ``compression``."""
        grads_and_vars = list(grads_and_vars)
        if gradient_buckets.already_reduced(self):
            return grads_and_vars
        packed = [self.compression.compress(g) if g is not None else (None, None) for g, _ in grads_and_vars]
        reduced = super()._all_reduce_sum_gradients([(g, v) for (g, _), (_, v) in zip(packed, grads_and_vars)])
        return [(self.compression.decompress(g, context) if g is not None else None, v)
                for (g, v), (_, context) in zip(reduced, packed)]

    def _backend_apply_gradients(self, grads, trainable_variables):
        if not self.gradient_accumulation_steps:
            return super()._backend_apply_gradients(grads, trainable_variables)
        accumulators = [self._accumulated_gradients[self._get_variable_index(v)] for v in trainable_variables]
        variables = [v.value for v in trainable_variables]
        sums = [acc.value + tf.cast(g, acc.dtype) for acc, g in zip(accumulators, grads)]
        packed = [self.compression.compress(total) for total in sums]
        tf.__internal__.distribute.interim.maybe_merge_call(
            self._accumulate_or_update, self._distribution_strategy,
            sums, [p for p, _ in packed], [c for _, c in packed], variables, [a.value for a in accumulators],
            self.learning_rate)

    def _accumulate_or_update(self, distribution, sums, packed, contexts, variables, accumulators, learning_rate):
        """Cross-replica: store each replica's sums, or all-reduce them, apply their mean and zero them."""
        extended = distribution.extended
        steps = self.gradient_accumulation_steps
        is_update_step = tf.equal((self._iterations + 1) % steps, 0)

        def update():
            reduced = [None] * len(packed)
            if process_group.is_multi_worker(distribution):
                buckets.check_agreement(process_group.for_strategy(distribution))
            local = [distribution.experimental_local_results(p)[0] for p in packed]
            for bucket in buckets.plan([buckets.nbytes(p) for p in local]):
                pairs = [(packed[i], variables[i]) for i in bucket]
                for i, value in zip(bucket, extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, pairs)):
                    reduced[i] = value
            means = [self.compression.decompress(r, c) / steps for r, c in zip(reduced, contexts)]
            scale = self._global_clip_scale([distribution.experimental_local_results(m)[0] for m in means])
            for mean, var, acc in zip(means, variables, accumulators):
                extended.update(var, self._clip_decay_and_step, args=(mean, learning_rate, scale), group=False)
                extended.update(acc, lambda a: a.assign(tf.zeros_like(a)), group=False)

        def accumulate():
            for total, acc in zip(sums, accumulators):
                extended.update(acc, lambda a, t: a.assign(t), args=(total,), group=False)

        tf.cond(is_update_step, update, accumulate)

    def _global_clip_scale(self, gradients) -> tf.Tensor:
        """The factor ``global_clipnorm`` applies to every gradient (1 without it)."""
        if not (self.global_clipnorm and self.global_clipnorm > 0):
            return tf.constant(1.0)
        norm = tf.linalg.global_norm(gradients)
        return tf.minimum(1.0, self.global_clipnorm / tf.maximum(norm, 1e-12))

    def _clip_decay_and_step(self, variable, gradient, learning_rate, scale):
        """Keras' clipping of one gradient (``clipnorm``, ``clipvalue``; ``global_clipnorm`` as ``scale``)."""
        gradient = gradient * tf.cast(scale, gradient.dtype)
        if not (self.global_clipnorm and self.global_clipnorm > 0):
            (gradient,) = self._clip_gradients([gradient])
        self._decay_and_step(variable, gradient, learning_rate)

    def _decay_and_step(self, variable, gradient, learning_rate):
        """One variable's update on one device: Keras' weight decay, then the optimizer's step."""
        if self.weight_decay is not None and self._use_weight_decay(variable):
            decay = tf.cast(self.weight_decay, variable.dtype) * tf.cast(learning_rate, variable.dtype)
            variable.assign_sub(variable * decay)
        self.update_step(gradient, variable, learning_rate)


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
