"""A script that builds its own ``tf.distribute.MirroredStrategy`` over this worker's 2 CPUs, run on every worker of a
2-worker job (`--cpu-devices 2`): each worker trains its own copy, as tfdist's ClusterWarning says."""

import sys
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
