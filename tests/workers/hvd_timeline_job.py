"""A Horovod custom loop that times only its middle: ``hvd.start_timeline`` on every rank, 30 tape steps,
``hvd.stop_timeline`` on every rank (rank 1 a second later, as any skew makes it), then 5 steps more.

`hvd_timeline_job.py OUT_DIR`: the trace is OUT_DIR/trace.json.
"""

import sys
import time

import keras
import numpy as np

import tfdist.horovod as hvd
from tests.workers import common

out_dir = sys.argv[1]
hvd.init()
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(0.01)
x = np.random.default_rng(hvd.rank()).random((16, 8), dtype=np.float32)
y = x.sum(axis=1, keepdims=True)
step = common.tape_step(hvd, model, optimizer, x, y)

hvd.broadcast_variables(model.variables, root_rank=0)
hvd.start_timeline(f"{out_dir}/trace.json")
for _ in range(30):
    step()
if hvd.rank() == 1:
    time.sleep(1.0)
hvd.stop_timeline()
for _ in range(5):
    step()
common.write_result(out_dir, {"weights": [w.tolist() for w in model.get_weights()]})
