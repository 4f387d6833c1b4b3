"""A script that builds its own ``tf.distribute.MirroredStrategy`` over this worker's 2 CPUs, run on every worker of a
2-worker job (`--cpu-devices 2`): each worker trains its own copy, as tfdist's ClusterWarning says. Worker 0, which
resolves every worker's collective groups (the warning says so too), exits once worker 1 has written its result: a
worker 1 that started later failed its first all-reduce, worker 0 gone ("Connection refused", a loaded machine)."""

import os
import sys
import time
import warnings

import numpy as np
import tensorflow as tf

from tests.workers import common

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
with strategy.scope():
    model = common.equivalence_model()
    model.compile(optimizer="sgd", loss="mse")
x, y = common.regression_data()
model.fit(x, y, batch_size=common.GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
common.write_result(sys.argv[1], {"weights": [w.tolist() for w in model.get_weights()],
                                  "warnings": [str(w.message) for w in caught]})
if os.environ.get("TFDIST_WORKER_INDEX") == "0":
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(sys.argv[1], "worker1.json")) and time.monotonic() < deadline:
        time.sleep(0.1)
