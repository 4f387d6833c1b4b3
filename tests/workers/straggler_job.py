"""Three fits of a small CNN on 2 workers, each worker reading its own pipeline
(``distribute_datasets_from_function``), for the straggler report worker 0 prints after each:

1. "input": worker 1's pipeline sleeps 100 ms a batch in a ``map`` (several steps' time: its prefetched batches run out);
2. "compute": worker 1 trains on batches 8 times larger;
3. "balanced": the same pipeline on both, with a TensorBoard callback on worker 0 only (as Horovod's examples do)
   writing to OUT_DIR/logs; worker 0 would wait up to 120 s for a peer's epoch medians (it waited 10 s an epoch
   for those of a worker without a TensorBoard, which publishes none).

`straggler_job.py OUT_DIR [balanced]` (a timeline comes from ``tfdist run --timeline``); with
"balanced", only the third fit.
"""

import sys
import time

import tfdist

out_dir = sys.argv[1]
with tfdist.scope() as strategy:
    pass
import keras  # noqa: E402  (after the strategy)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.workers import common  # noqa: E402
from tfdist.keras_fixes import step_report  # noqa: E402  (once Keras is imported: tfdist patches it then)

step_report.COLLECT_S = 120.0

rank, STEPS, BATCH = tfdist.rank(), 24, 16
images = np.random.default_rng(rank).random((BATCH * 8 * STEPS, 32, 32, 3), dtype=np.float32)
labels = np.arange(len(images)) % 10


def slow(batch_images, batch_labels):
    def sleep(x):
        time.sleep(0.1)
        return x

    slowed = tf.py_function(sleep, [batch_images], tf.float32)
    slowed.set_shape(batch_images.shape)
    return slowed, batch_labels


def pipeline(kind: str):
    def make(context):
        batch = BATCH * 8 if kind == "compute" and rank == 1 else BATCH
        data = tf.data.Dataset.from_tensor_slices((images, labels)).batch(batch).take(STEPS)
        if kind == "input" and rank == 1:
            data = data.map(slow)
        return data.repeat()

    return strategy.distribute_datasets_from_function(make)


with strategy.scope():
    model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
                              keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
                              keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
for kind in ("input", "compute", "balanced")[2 if sys.argv[2:] == ["balanced"] else 0:]:
    if tfdist.is_chief():
        print(f"fit: {kind}", file=sys.stderr, flush=True)
    callbacks = [keras.callbacks.TensorBoard(f"{out_dir}/logs")] if kind == "balanced" and rank == 0 else []
    began = time.monotonic()
    model.fit(pipeline(kind), epochs=2, steps_per_epoch=STEPS // 2, verbose=0, callbacks=callbacks)
    seconds = time.monotonic() - began
common.write_result(out_dir, {"steps": int(model.optimizer.iterations.numpy()), "balanced_s": seconds})
