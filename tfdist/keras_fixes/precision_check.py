"""``fit`` checks half-precision outputs (tfdist, not an upstream bug).

Once tfdist set a mixed dtype policy (``tfdist.precision.set_policy``, ``scope(precision=)``),
``Model.fit`` of a model that computes in float16 or bfloat16 adds a
``tfdist.precision.PrecisionCheck``, which warns about each output layer computing in half
precision (softmax and losses want float32).
"""

from __future__ import annotations

import inspect

from keras.src.backend.tensorflow import trainer as keras_tf_trainer

from tfdist import precision
from tfdist.keras_fixes.signatures import FIT_PARAMETERS
from tfdist.patching import Patch


patch = Patch(
    "precision_check", "tfdist: half-precision outputs",
    without="fit does not warn about an output layer that computes in float16.")


@patch.replaces(keras_tf_trainer.TensorFlowTrainer, "fit", FIT_PARAMETERS)
def _fit_with_precision_check(original, self, *args, **kwargs):
    """``Model.fit`` that adds a PrecisionCheck when the model computes in half precision."""
    if precision.checks_outputs() and self.compute_dtype in precision.HALF_DTYPES:
        bound = inspect.signature(original).bind(self, *args, **kwargs)
        callbacks = list(bound.arguments.get("callbacks") or [])
        if not any(isinstance(c, precision.PrecisionCheck) for c in callbacks):
            bound.arguments["callbacks"] = callbacks + [precision.PrecisionCheck()]
        args, kwargs = bound.args[1:], bound.kwargs
    return original(self, *args, **kwargs)
