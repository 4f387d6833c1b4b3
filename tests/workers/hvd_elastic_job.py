"""hvd.elastic.run under an elastic `tfdist run --nnodes MIN:MAX`: `hvd_elastic_job.py OUT_DIR STEPS`.

A TensorFlowState of one variable and ``step``; each step adds hvd.allreduce(1.0, Sum) (the
world size) to the variable and commits; 0.3 s a step. Worker 0 appends "STEP SIZE VALUE" to
OUT_DIR/steps. SIGTERM stops after the step in progress (exit 85). The reset callback notes
the world size it sees in OUT_DIR/resets.
"""

import os
import signal
import sys
import time

import tensorflow as tf

import tfdist.horovod as hvd

EXIT_PREEMPTED = 85
out_dir, steps = sys.argv[1], int(sys.argv[2])
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
hvd.init()


def append(name: str, line: str) -> None:
    if hvd.rank() == 0:
        with open(os.path.join(out_dir, name), "a") as f:
            f.write(line + "\n")


total = tf.Variable(0.0)
state = hvd.elastic.TensorFlowState([total], step=0)
state.register_reset_callbacks([lambda: append("resets", f"{state.step} {hvd.size()}")])


@hvd.elastic.run
def train(state):
    while state.step < steps:
        if stopping:
            os._exit(EXIT_PREEMPTED)
        total.assign_add(hvd.allreduce(tf.constant(1.0), op=hvd.Sum))
        state.step += 1
        state.commit()
        append("steps", f"{state.step} {hvd.size()} {total.numpy():g}")
        time.sleep(0.3)


train(state)
