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
own dtype.
"""

from __future__ import annotations

import keras

from keras.src.backend.tensorflow.optimizer import TFOptimizer

from tfdist import compression as compression_lib
from tfdist.compression import Compression
from tfdist.errors import KerasCompatibilityError
from tfdist.keras_fixes import accumulation, gradient_buckets, sharded_state
from tfdist import patching, sharding
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
                         compression=Compression.none,
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
            gradients in float16 (opt-in: results differ from float32 by about 1e-3).
        shard_optimizer_state: True: under N > 1 replicas each keeps 1/N of the optimizer's
            state (ZeRO-1, ``tfdist.keras_fixes.sharded_state``); None: as ``tfdist.scope`` or
            ``TFDIST_SHARD_OPTIMIZER_STATE`` say.

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer or is a ``MultiOptimizer``, or ``compression`` is
            not a compression.
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
    compression_lib.check(compression)
    if shard_optimizer_state is not None:
        sharding.check(shard_optimizer_state)
    config = optimizer.get_config()
    config["gradient_accumulation_steps"] = steps if steps > 1 else None
    distributed = _distributed_class(type(optimizer)).from_config(config)
    distributed.compression = compression
    if shard_optimizer_state is not None:
        sharded_state.mark(distributed, shard_optimizer_state)
    return distributed


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

    def _all_reduce_sum_gradients(self, grads_and_vars):
        """Keras' all-reduce (every micro-batch when there is no accumulation), through ``compression``."""
        grads_and_vars = list(grads_and_vars)
        if gradient_buckets.already_reduced(self):
            return grads_and_vars
        packed = [self.compression.compress(g) if g is not None else (None, None) for g, _ in grads_and_vars]
        reduced = super()._all_reduce_sum_gradients([(g, v) for (g, _), (_, v) in zip(packed, grads_and_vars)])
        return [(self.compression.decompress(g, context) if g is not None else None, v)
                for (g, v), (_, context) in zip(reduced, packed)]


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
