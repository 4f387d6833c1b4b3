"""Trains until killed; writes OUT_DIR/training-<rank> once the first epoch is done."""

import os
import pathlib
import sys

import tfdist
from tests.workers import common

out_dir = pathlib.Path(sys.argv[1])
with tfdist.scope() as strategy:
    model = common.equivalence_model()
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402


class MarkTraining(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        (out_dir / f"training-{os.environ['TFDIST_WORKER_INDEX']}").touch()


x, y = common.regression_data(64)
model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat(), steps_per_epoch=20, epochs=10**6,
          verbose=0, callbacks=[MarkTraining()])
