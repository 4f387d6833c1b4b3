"""Which loss a ``LossScaleOptimizer`` scaled, so ``hvd.DistributedGradientTape`` can send its gradients unscaled.

A tape all-reduces the gradients of whatever it is given. Given ``opt.scale_loss(loss)``,
they are multiplied by the loss scale (up to 2^15 and more), and on a float16 wire
(``compression=fp16``) they overflow where one device's float32 would not: every step is
skipped (Horovod behaves so). Here ``scale_loss`` remembers the tensor it returned (weakly,
the last one per thread); ``scale_of(target)`` gives the tape that loss' scale, and the tape
divides by it before the float16 cast and multiplies after, as the optimizer path (which
reduces after Keras unscaled) does. The scale is a power of 2, so both are exact.
"""

from __future__ import annotations

import threading
import weakref

from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

from tfdist.patching import Patch

patch = Patch(
    "scaled_loss", "tfdist.horovod: DistributedGradientTape with an fp16 wire under loss scaling (Horovod overflows)",
    without="hvd.DistributedGradientTape(compression=fp16) sends a LossScaleOptimizer's scaled gradients in "
            "float16, where they overflow: every step is skipped.")

_last = threading.local()


@patch.replaces(LossScaleOptimizer, "scale_loss", ("self", "loss"))
def _remember(original, self, loss):
    scaled = original(self, loss)
    _last.loss, _last.optimizer = weakref.ref(scaled), weakref.ref(self)
    return scaled


def scale_of(target):
    """The scale of ``target`` if it is what a LossScaleOptimizer's ``scale_loss`` returned last; else None."""
    remembered = getattr(_last, "loss", None)
    optimizer = _last.optimizer() if remembered is not None else None
    if optimizer is None or remembered() is not target:
        return None
    return optimizer.dynamic_scale if optimizer.built else optimizer.initial_scale
