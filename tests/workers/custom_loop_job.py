"""A custom training loop with tfdist.should_stop: 24 steps of SGD, a tf.train.Checkpoint at the agreed step.

`custom_loop_job.py OUT_DIR`: at step 10 of the first run (no OUT_DIR/signalled yet) worker 1
SIGTERMs itself; every worker stops after the same step, saves, and exits 85
(tfdist.exit_if_preempted); under --max-restarts 1 the restarted job resumes from the
checkpoint. Each worker appends its steps to OUT_DIR/steps<rank>-<pid>.json and writes its
final weights.
"""

import json
import os
import signal
import sys

import tfdist

out_dir = sys.argv[1]
with tfdist.scope() as strategy:
    pass
import keras  # noqa: E402  (after the strategy)
import tensorflow as tf  # noqa: E402

from tests.workers import common  # noqa: E402

TOTAL, AT = 24, 10
rank, marker = tfdist.rank(), os.path.join(out_dir, "signalled")
with strategy.scope():
    model = common.equivalence_model()
    optimizer = keras.optimizers.SGD(learning_rate=0.05)
    optimizer.build(model.trainable_variables)
    step = tf.Variable(0, dtype=tf.int64)
checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
shared = os.path.join(out_dir, "ckpt")
if tf.train.latest_checkpoint(shared):
    checkpoint.read(tf.train.latest_checkpoint(shared)).expect_partial()
manager = tf.train.CheckpointManager(checkpoint, shared if rank == 0 else os.path.join(out_dir, f"ckpt-w{rank}"), 1)

x, y = common.regression_data(common.GLOBAL_BATCH * TOTAL)
start = int(step.numpy())
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH).skip(start)
iterator = iter(strategy.experimental_distribute_dataset(data))
train_step = common.sgd_train_step(strategy, model, optimizer)

done, path = [], os.path.join(out_dir, f"steps{rank}-{os.getpid()}.json")
for current in range(start, TOTAL):
    train_step(next(iterator))
    done.append(current)
    with open(path, "w") as f:
        json.dump(done, f)
    if current == AT and rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGTERM)
    if tfdist.should_stop(current + 1):
        step.assign(current + 1)
        manager.save()
        break
tfdist.exit_if_preempted()
common.write_result(out_dir, {"weights": [w.tolist() for w in model.get_weights()], "start": start})
