"""Data parallelism as Keras' distribution guide teaches it, with backend-neutral code: never imports tfdist.

``keras.distribution.initialize()`` joins the job (``tfdist run`` describes it on TensorFlow;
KERAS_DISTRIBUTION_* variables on JAX), ``DataParallel`` over every device of every process,
a Functional model, and ``fit`` on a tf.data pipeline batched at the global batch size. The
model's seeded initializers make every run start from the same weights; ``Probe`` notes each
replica's batch size. argv: OUT_DIR; writes ``worker<process_id>.json``.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 32
STEPS = 4
batch_sizes_seen = []


class Probe(keras.layers.Layer):
    """Identity; notes the batch size each replica trains on."""

    def call(self, inputs, training=None):
        if training:
            tf.py_function(lambda n: batch_sizes_seen.append(int(n)), [tf.shape(inputs)[0]], [])
        return inputs


def make_model():
    inputs = keras.Input(shape=(28, 28, 1))
    x = Probe()(inputs)
    x = keras.layers.Conv2D(4, 3, activation="relu", name="conv", kernel_initializer=keras.initializers.GlorotUniform(seed=1))(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(10, name="dense", kernel_initializer=keras.initializers.GlorotUniform(seed=2))(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01),  # Adam: its steps count (bias correction)
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def make_dataset(global_batch_size=GLOBAL_BATCH):
    """MNIST-shaped images (the guide downloads MNIST), every process the same examples in the same order."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, size=GLOBAL_BATCH * STEPS)
    images = (rng.normal(size=(10, 28, 28, 1))[labels] + rng.normal(size=(len(labels), 28, 28, 1))).astype("float32")
    return tf.data.Dataset.from_tensor_slices((images, labels)).batch(global_batch_size)


def main(out_dir):
    keras.distribution.initialize()
    devices = keras.distribution.list_devices()
    data_parallel = keras.distribution.DataParallel(devices=devices)
    keras.distribution.set_distribution(data_parallel)

    model = make_model()
    history = model.fit(make_dataset(), epochs=2, verbose=0)

    result = {
        "devices": devices,
        "num_processes": data_parallel.num_processes,
        "process_id": data_parallel.data_shard_id,  # DataParallel: this process's index
        "batch_sizes": sorted(set(batch_sizes_seen)),
        "steps": len(batch_sizes_seen),
        "loss": history.history["loss"],
        "iterations": int(model.optimizer.iterations.numpy()),
        "weights": [w.tolist() for w in model.get_weights()],
    }
    if keras.backend.backend() == "tensorflow":
        result["replicas"] = model.distribute_strategy.num_replicas_in_sync
    with open(os.path.join(out_dir, f"worker{data_parallel.data_shard_id}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
