"""Optimizer state sharded over the workers: `sharded_state_job.py OUT_DIR train|resume|chief_saves`.

train: ``common.resumable_model(use_ema=True)`` (Adam on a decaying learning rate, moving averages) under
``tfdist.scope(shard_optimizer_state=True)``, ``SHARDED_EPOCHS`` epochs of ``SHARDED_STEPS`` global
batches, with a ModelCheckpoint to OUT_DIR/model.keras at each epoch's end (every worker saves; the
chief's file is kept). resume: the same scope loads OUT_DIR/model.keras and trains one epoch more.
chief_saves: trains one epoch, then only worker 0 saves (a Horovod habit) while worker 1 waits 20 s;
worker 0 writes the error it got (the wait for the others' gather cut to 3 s).
Each worker writes its weights, iterations, whether the optimizer is sharded, its state's bytes and
the replicas to worker<rank>.json. (Run by tests/test_sharded_state_multi_worker.py.)
"""

import os
import sys
import time

import keras
import tensorflow as tf

import tfdist
from tests.workers import common
from tfdist.keras_fixes import sharded_state

out_dir, phase = sys.argv[1], sys.argv[2]
checkpoint = os.path.join(out_dir, "model.keras")
x, y = common.regression_data(common.GLOBAL_BATCH * common.SHARDED_STEPS)
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH)
with tfdist.scope(shard_optimizer_state=True) as strategy:
    model = keras.models.load_model(checkpoint) if phase == "resume" else common.resumable_model(use_ema=True)
callbacks = [keras.callbacks.ModelCheckpoint(checkpoint)] if phase == "train" else []
model.fit(data, epochs=common.SHARDED_EPOCHS if phase == "train" else 1, verbose=0, callbacks=callbacks)
if phase == "chief_saves":
    sharded_state.GATHER_AGREEMENT_S = 3.0
    if tfdist.rank() == 0:
        try:
            model.save(checkpoint)
        except tfdist.ShardingError as error:
            common.write_result(out_dir, {"error": str(error)})
    else:
        time.sleep(20)
        common.write_result(out_dir, {"error": None})
    sys.exit(0)
common.write_result(out_dir, {"weights": [w.tolist() for w in model.get_weights()],
                              "iterations": int(model.optimizer.iterations.numpy()),
                              "sharded": sharded_state.is_sharded(model.optimizer),
                              "state_bytes": tfdist.optimizer_state_bytes(model.optimizer),
                              "replicas": strategy.num_replicas_in_sync})
