"""examples/multi_worker_fit.py without tfdist: plain MultiWorkerMirroredStrategy from TF_CONFIG.

The baseline of benchmarks/plain_vs_tfdist.py: the same model, data, epochs, evaluate and chief's save,
with nothing of tfdist imported. Start one per worker with TF_CONFIG set by hand.
"""

import json
import os
import sys
import tempfile

import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()  # before any op: it reads TF_CONFIG
task = json.loads(os.environ["TF_CONFIG"])["task"]
is_chief = task["index"] == 0

import keras  # noqa: E402
from keras.src.backend.tensorflow import trainer as _trainer  # noqa: E402


# Plain Keras 3.x fit fails under MultiWorkerMirroredStrategy (keras#20585, tensorflow#72388); the two
# smallest user-side workarounds, what tfdist/keras_fixes/multi_worker.py does without its extras.
def _build_from_first_local_batch(self, iterator=None, data_batch=None):
    if iterator is not None:
        for *_, batches in iterator:
            data_batch = tf.nest.map_structure(lambda v: v.values[0], next(batches))
            break
    with self.distribute_strategy.scope():
        self._symbolic_build(data_batch=data_batch)


_reduce = _trainer.reduce_per_replica


def _reduce_scalars_with_axis_none(values, strategy, reduction):
    if reduction not in ("auto", "mean"):
        return _reduce(values, strategy, reduction)
    return tf.nest.map_structure(
        lambda v: strategy.reduce("MEAN", v, axis=None if strategy.experimental_local_results(v)[0].shape.rank == 0 else 0),
        values)


_trainer.TensorFlowTrainer._maybe_symbolic_build = _build_from_first_local_batch
_trainer.reduce_per_replica = _reduce_scalars_with_axis_none

with strategy.scope():
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")

rng = tf.random.Generator.from_seed(0)  # the same data on every worker; tf.data shards it
features = rng.normal((4096, 10))
targets = tf.reduce_sum(features[:, :3], axis=1, keepdims=True)
dataset = tf.data.Dataset.from_tensor_slices((features, targets)).shuffle(4096, seed=0).batch(64)

if is_chief:
    print(f"worker {task['index']}: {strategy.num_replicas_in_sync} replicas in sync")
history = model.fit(dataset, epochs=3, verbose=2 if is_chief else 0)
loss = model.evaluate(dataset, verbose=0)

if is_chief:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.gettempdir()
    path = os.path.join(out_dir, "multi_worker_model.keras")
    model.save(path)
    print(f"loss {history.history['loss'][0]:.4f} -> {loss:.4f}; saved {path}")
