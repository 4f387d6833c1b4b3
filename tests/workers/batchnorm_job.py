"""2 workers: a small CNN with BatchNormalization, plain and synchronized; the chief saves the plain one.

argv: OUT_DIR. Writes each worker's weights, its own (not yet averaged) moving statistics at the
last batch, and, on the chief, ``bn.keras``.
"""

import os
import sys

import keras
import numpy as np

import tfdist
from tests.workers import common

out_dir = sys.argv[1]


class LocalStatistics(keras.callbacks.Callback):
    """This worker's own moving statistics after the last batch (before the epoch-end average)."""

    def on_train_batch_end(self, batch, logs=None):
        bn = self.model.layers[1]
        self.values = [bn.moving_mean.numpy().tolist(), bn.moving_variance.numpy().tolist()]


strategy = tfdist.get_strategy()
local = LocalStatistics()
plain, plain_loss = common.train_batchnorm_cnn(strategy, synchronized=False, callbacks=[local])
if tfdist.is_chief():
    plain.save(os.path.join(out_dir, "bn.keras"))  # chief only: reading the statistics needs no collective
synced, synced_loss = common.train_batchnorm_cnn(strategy, synchronized=True)
common.write_result(out_dir, {
    "plain_weights": [w.tolist() for w in plain.get_weights()], "plain_loss": plain_loss, "local": local.values,
    "synced_weights": [w.tolist() for w in synced.get_weights()], "synced_loss": synced_loss,
    "replicas": strategy.num_replicas_in_sync})
