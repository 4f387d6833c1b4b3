"""Worker 1 stops taking part (alive, heartbeats flowing) after epoch 2; the chief must not hang.

`stuck_peer_job.py OUT_DIR TIMEOUT`: collectives time out after TIMEOUT seconds.
"""

import sys
import time

import tfdist
from tests.workers import common

out_dir, timeout = sys.argv[1], float(sys.argv[2])
with tfdist.scope(collective_timeout=timeout) as strategy:
    pass
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402


class StuckPeer(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1 and tfdist.rank() == 1:
            common.write_result(out_dir, {"stuck_at": time.time()})
            time.sleep(600)


with strategy.scope():
    model = common.equivalence_model()
x, y = common.regression_data(64)
try:
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat(), steps_per_epoch=4, epochs=4,
              verbose=0, callbacks=[StuckPeer()])
except tf.errors.DeadlineExceededError:
    common.write_result(out_dir, {"timed_out_at": time.time()})
    raise
