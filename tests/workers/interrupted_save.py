"""Saves a checkpoint, then is SIGKILLed halfway through writing the next one.

argv: checkpoint path, path for the first save's weights (.npy). Used in-process by
tests/test_callbacks.py (no cluster).
"""

import os
import signal
import sys

import keras
import numpy as np

from tests.workers import common
from tfdist import callbacks

path, weights_path = sys.argv[1], sys.argv[2]
model = common.equivalence_model()
x, y = common.regression_data(32)
checkpoint = callbacks.ModelCheckpoint(path)
model.fit(x, y, epochs=1, verbose=0, callbacks=[checkpoint])
np.save(weights_path, np.concatenate([w.ravel() for w in model.get_weights()]))


def save_half_then_die(self, filepath, **kwargs):
    original_save(self, filepath, **kwargs)
    with open(filepath, "r+b") as f:
        f.truncate(os.path.getsize(filepath) // 2)
    os.kill(os.getpid(), signal.SIGKILL)


original_save = keras.Model.save
keras.Model.save = save_half_then_die
model.fit(x, y, epochs=1, verbose=0, callbacks=[checkpoint])
