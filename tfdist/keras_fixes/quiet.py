"""``fit`` warns only about arguments the caller gave (Keras' noise, not an upstream bug report).

Keras 3's ``fit`` defaults to ``shuffle=True`` and then warns on every call whose data ignores
it ("`shuffle=True` was passed, but will be ignored since the data `x` was provided as a
tf.data.Dataset"), on every worker, though the caller passed no ``shuffle``. Here a ``fit`` whose
caller did not pass ``shuffle`` and whose data is a ``tf.data.Dataset`` (a distributed one too) or
a Python generator (data that Keras never shuffles) runs with ``shuffle=False``: the same training, no warning. A
``shuffle=True`` the caller did pass still warns.
"""

from __future__ import annotations

import inspect

from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.trainers import data_adapters

from tfdist.keras_fixes.signatures import FIT_PARAMETERS
from tfdist.patching import Patch

patch = Patch(
    "quiet_fit", "tfdist: warnings about arguments the caller never gave",
    without="fit(tf.data.Dataset) warns \"`shuffle=True` was passed, but will be ignored\" on every worker, though "
            "no shuffle was passed.")


@patch.replaces(keras_tf_trainer.TensorFlowTrainer, "fit", FIT_PARAMETERS)
def _fit_without_an_unasked_shuffle(original, self, *args, **kwargs):
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    data = bound.arguments.get("x")
    if "shuffle" not in bound.arguments and (data_adapters.is_tf_dataset(data) or inspect.isgenerator(data)):
        bound.arguments["shuffle"] = False  # Keras ignores it for such data; it only warns
        args, kwargs = bound.args[1:], bound.kwargs
    return original(self, *args, **kwargs)
