"""Train one model on several worker processes (MultiWorkerMirroredStrategy).

    tfdist run -n 2 -- python examples/multi_worker_fit.py [OUT_DIR]

On a real cluster, start the same script on every machine with TF_CONFIG set, or with
srun under SLURM; tfdist reads either. Only the chief prints and saves.
"""

import os
import sys
import tempfile

import tfdist

# Build the strategy first: TensorFlow must not start before a multi-worker strategy.
with tfdist.scope() as strategy:
    import keras
    import tensorflow as tf

    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")

rng = tf.random.Generator.from_seed(0)  # the same data on every worker; tf.data shards it
features = rng.normal((4096, 10))
targets = tf.reduce_sum(features[:, :3], axis=1, keepdims=True)
dataset = tf.data.Dataset.from_tensor_slices((features, targets)).shuffle(4096, seed=0).batch(64)

if tfdist.is_chief():
    print(f"worker {tfdist.rank()} of {tfdist.num_workers()}: {tfdist.size()} replicas in sync")
history = model.fit(dataset, epochs=3, verbose=2 if tfdist.is_chief() else 0)
loss = model.evaluate(dataset, verbose=0)

if tfdist.is_chief():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.gettempdir()
    path = os.path.join(out_dir, "multi_worker_model.keras")
    model.save(path)
    print(f"loss {history.history['loss'][0]:.4f} -> {loss:.4f}; saved {path}")
