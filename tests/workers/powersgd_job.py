"""2 workers: PowerSGD (rank 2, start step 2) in ``fit`` past its warm-up, chosen in code and by the environment.

argv: OUT_DIR. Run with ``TFDIST_COMPRESSION=powersgd:2:2``. Writes each worker's weights, loss history, own
error feedback and the compression each optimizer took, for both cases: ``explicit`` (``compression=``) and
``from_env`` (a ``DistributedOptimizer`` given none); then ``resumed``: the explicit case stopped after its first
epoch and resumed through ``BackupAndRestore`` by a new model.
"""

import os
import sys

import keras

import tfdist
from tfdist.compression import Compression
from tests.workers import common

out_dir = sys.argv[1]
payload = {"tfdist_file": tfdist.__file__, "env": os.environ.get("TFDIST_COMPRESSION")}
with tfdist.scope() as strategy:
    payload["replicas"] = strategy.num_replicas_in_sync
    for case, compression in [("explicit", Compression.powersgd(rank=2, start_step=2)), ("from_env", "unset")]:
        model, losses = common.train_powersgd(strategy, compression)
        payload[case] = {
            "compression": repr(model.optimizer.compression),
            "iterations": int(model.optimizer.iterations.numpy()),
            "weights": [w.tolist() for w in model.get_weights()],
            "losses": losses,
            "errors": common.powersgd_local_errors(strategy, model),
        }

    class Preempted(Exception):
        pass

    class PreemptAfterFirstEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                raise Preempted()

    # ``resumed``: the explicit case's fit stopped after epoch 1 of 2 on both workers, then resumed by a new model
    compression, backup = Compression.powersgd(rank=2, start_step=2), os.path.join(out_dir, "backup")
    try:
        common.train_powersgd(strategy, compression, callbacks=[keras.callbacks.BackupAndRestore(backup),
                                                                PreemptAfterFirstEpoch()])
    except Preempted:
        pass
    model, losses = common.train_powersgd(strategy, compression, callbacks=[keras.callbacks.BackupAndRestore(backup)])
    payload["resumed"] = {"iterations": int(model.optimizer.iterations.numpy()), "losses": losses,
                          "weights": [w.tolist() for w in model.get_weights()]}
common.write_result(out_dir, payload)
