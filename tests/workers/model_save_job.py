"""Keras' own saves on every worker of a job with sharded optimizer state (issue 50): ModelCheckpoint and
BackupAndRestore in fit, then model.save and save_weights 10 times each. Writes worker<rank>.json (the state)."""

import pathlib
import sys

import keras

import tfdist
from tests.workers import common

out_dir = pathlib.Path(sys.argv[1])
with tfdist.scope(shard_optimizer_state=True) as strategy:
    pass
model = common.checkpoint_model(strategy, sharded=True)
x, y = common.checkpoint_data()
model.fit(x, y, batch_size=common.CHECKPOINT_BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[
    keras.callbacks.ModelCheckpoint(str(out_dir / "checkpoint-{epoch}.keras")),
    keras.callbacks.BackupAndRestore(str(out_dir / "backup"), delete_checkpoint=False)])
for i in range(10):
    model.save(out_dir / f"model-{i}.keras")
    model.save_weights(out_dir / f"weights-{i}.weights.h5")
common.write_result(str(out_dir), {"state": common.checkpoint_state(model)})
