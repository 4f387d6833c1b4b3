"""What Horovod's published Keras code does that Keras 3 removed, accepted again under tfdist.horovod.

Applied when ``tfdist.horovod`` is imported (so only in Horovod scripts):

* ``model.compile(..., experimental_run_tf_function=False)``: every Horovod Keras example
  passes it (TF 2.0-2.3 needed it); Keras 3's ``compile`` takes no such keyword and raises
  TypeError. The keyword is accepted and ignored: there is nothing left for it to switch.
* ``opt.variables()``: Horovod's examples call it; in Keras 3 ``variables`` is a property
  holding a list, so the call fails. The property now holds a list that can also be called.
* ``opt.lr``: Horovod's elastic examples read and assign it (``opt.lr.assign(x)``,
  ``tf.keras.backend.set_value(opt.lr, x)``); Keras 3 only has ``learning_rate``. ``lr``
  is the TensorFlow variable behind it; assigning ``opt.lr = x`` sets ``learning_rate``.

Each replacement checks the Keras internal it wraps (``tfdist.patching``).
"""

from __future__ import annotations

from keras.src.backend.common.variables import Variable as KerasVariable
from keras.src.optimizers.base_optimizer import BaseOptimizer
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras.src.trainers.trainer import Trainer

from tfdist.keras_fixes.signatures import COMPILE_PARAMETERS
from tfdist.patching import Patch

patch = Patch(
    "horovod_keras_names", "Keras 3 API removals (Horovod's examples)",
    without="Horovod's Keras examples fail on Keras 3: compile() rejects experimental_run_tf_function and "
            "opt.variables() is not callable.")


class CallableList(list):
    """A list that returns itself when called, so ``opt.variables`` and ``opt.variables()`` both work."""

    def __call__(self) -> "CallableList":
        return self


@patch.replaces(Trainer, "compile", COMPILE_PARAMETERS)
def _compile_accepting_horovods_keyword(original, self, *args, experimental_run_tf_function=None, **kwargs):
    return original(self, *args, **kwargs)


@patch.replaces(BaseOptimizer, "variables", ("self",))
def _callable_variables(original, self):
    return CallableList(original(self))


@patch.replaces(LossScaleOptimizer, "variables", ("self",))
def _callable_loss_scale_variables(original, self):
    return CallableList(original(self))


def _get_lr(optimizer):
    """The learning rate as the TensorFlow variable behind it, so ``tf.keras.backend.set_value`` and
    ``.assign`` work on it as they did in Keras 2 (a schedule's current rate is a plain tensor)."""
    rate = optimizer.learning_rate
    return rate.value if isinstance(rate, KerasVariable) else rate


patch.adds(BaseOptimizer, "lr", property(_get_lr, lambda self, value: setattr(self, "learning_rate", value),
                                         doc="Keras 2's name for learning_rate (Horovod's examples use it)."))


def apply() -> None:
    """Applies the patch, the ``lr`` alias included (idempotent)."""
    patch.apply()
