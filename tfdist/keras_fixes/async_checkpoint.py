"""TensorFlow's asynchronous checkpoint (``CheckpointOptions(enable_async=True)``) saves Keras 3 models more than once.

TensorFlow's async helper (``tensorflow/python/checkpoint/async_checkpoint_helper.py``) copies every
variable to the host in a traced function, ``_copy_to_cpu``, then writes in a background thread.
Keras 3's TensorFlow ``Variable`` answers that copy with a new ``tf.Variable`` on every call
(``keras/src/backend/tensorflow/core.py``, ``_copy_trackable_to_cpu``), so the second save retraces
and fails: "tf.function only supports singleton tf.Variables created on the first call" (TF 2.21,
Keras 3.15.1; no upstream issue found). Here a Keras variable's host copy is the host copy of the
``tf.Variable`` it holds, which TensorFlow makes once and refreshes on every save: the checkpoint
holds the same values under the same keys.
"""

from __future__ import annotations

from keras.src.backend.tensorflow import core as keras_tf_core

from tfdist.patching import Patch

patch = Patch(
    "async_checkpoint", "tfdist UPSTREAM.md: Keras 3 variables fail TensorFlow's async checkpoint on the 2nd save",
    without="tf.train.Checkpoint(...).save(..., options=tf.train.CheckpointOptions(enable_async=True)) of a Keras "
            "model fails on its second save (\"tf.function only supports singleton tf.Variables\").")


@patch.replaces(keras_tf_core.Variable, "_copy_trackable_to_cpu", ("self", "object_map"))
def _copy_through_the_tf_variable(original, self, object_map):
    self.value._copy_trackable_to_cpu(object_map)  # makes the host copy once, assigns it on every save
    object_map[self] = object_map[self.value]
