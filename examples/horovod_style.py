"""Horovod's Keras MNIST example (tensorflow2_keras_mnist.py), written with tfdist.

    tfdist run -n 2 -- python examples/horovod_style.py [CHECKPOINT_DIR] [EPOCHS]

Same recipe as Horovod: scale the learning rate by the number of replicas, warm it up,
broadcast the initial state from rank 0, average metrics, checkpoint on rank 0 only.
The data is generated (MNIST-shaped 28x28 digits of 10 classes), so nothing downloads.
"""

import os
import sys
import tempfile

import numpy as np

import tfdist

# Horovod: hvd.init() and GPU pinning. Here: build the strategy (GPUs pinned per local
# rank), before any other TensorFlow code runs, and make it the default.
tfdist.init()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

checkpoint_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.gettempdir(), "tfdist-horovod-style")
epochs = int(sys.argv[2]) if len(sys.argv) > 2 else 4


PROTOTYPES = np.random.default_rng(0).normal(size=(10, 28, 28, 1)).astype("float32")


def make_digits(count: int, seed: int):
    """Each image is one of ten fixed 28x28 prototypes plus noise; the label says which."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, count)
    images = PROTOTYPES[labels] + rng.normal(scale=2.0, size=(count, 28, 28, 1)).astype("float32")
    return images, labels


# Horovod batches 128 per worker; with tf.distribute the dataset yields the global batch,
# which fit splits across replicas (and shards across workers).
global_batch = 64 * tfdist.size()
images, labels = make_digits(4096, seed=1)
dataset = tf.data.Dataset.from_tensor_slices((images, labels)).shuffle(4096, seed=1).repeat().batch(global_batch)
steps_per_epoch = 256 // tfdist.size()  # Horovod: fewer steps per worker as workers are added

model = keras.Sequential([
    keras.Input((28, 28, 1)),
    keras.layers.Conv2D(16, 3, activation="relu"),
    keras.layers.MaxPooling2D(2),
    keras.layers.Conv2D(32, 3, activation="relu"),
    keras.layers.MaxPooling2D(2),
    keras.layers.Flatten(),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(10),
])

# Horovod: scale the learning rate by the number of workers; wrap the optimizer.
scaled_lr = tfdist.scale_lr(0.001)
optimizer = tfdist.DistributedOptimizer(keras.optimizers.Adam(scaled_lr))
model.compile(optimizer=optimizer, metrics=["accuracy"],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

callbacks = [
    # Everyone starts from rank 0's weights (and optimizer state, after the first batch).
    tfdist.callbacks.BroadcastGlobalVariablesCallback(0),
    # Average the epoch's metrics over workers, before anything else reads them.
    tfdist.callbacks.MetricAverageCallback(),
    # Goyal et al.: warm up from scaled_lr / size() to scaled_lr over the first epochs.
    tfdist.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=1),
    tfdist.callbacks.Throughput(),
    # Horovod adds ModelCheckpoint on rank 0 only; tfdist's goes on every worker (they all
    # take part in the save) and only rank 0's file is kept, written atomically.
    tfdist.callbacks.ModelCheckpoint(os.path.join(checkpoint_dir, "checkpoint-{epoch}.keras")),
]

# Horovod: verbose only on rank 0.
model.fit(dataset, steps_per_epoch=steps_per_epoch, epochs=epochs, callbacks=callbacks, verbose=tfdist.verbose(2))

test_images, test_labels = make_digits(1024, seed=2)
loss, accuracy = model.evaluate(test_images, test_labels, batch_size=global_batch, verbose=0)
tfdist.print(f"test accuracy {accuracy:.3f}; checkpoints in {checkpoint_dir}: {sorted(os.listdir(checkpoint_dir))}")
