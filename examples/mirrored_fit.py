"""Train a small CNN on every device of one machine (MirroredStrategy) with one line.

    python examples/mirrored_fit.py                       # all GPUs, else the CPU
    tfdist run -n 1 --cpu-devices 2 -- python examples/mirrored_fit.py   # 2 replicas on a CPU

The global batch grows with the replicas (32 per replica); tfdist splits it.
"""

import keras
import numpy as np

import tfdist

PER_REPLICA_BATCH = 32


def bar_images(num_examples: int = 4096, size: int = 16):
    """Noise images; class 1 has a bright vertical bar. Small, offline, learnable."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, num_examples)
    images = rng.normal(size=(num_examples, size, size, 1)).astype("float32")
    images[labels == 1, :, size // 2 - 2:size // 2 + 2, :] += 1.5
    return images, labels


with tfdist.scope() as strategy:
    model = keras.Sequential([
        keras.Input((16, 16, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(2, activation="softmax"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])

replicas = strategy.num_replicas_in_sync
print(f"{type(strategy).__name__} with {replicas} replica(s)")
images, labels = bar_images()
history = model.fit(images, labels, batch_size=PER_REPLICA_BATCH * replicas, epochs=3, verbose=2)
print(f"final accuracy: {history.history['accuracy'][-1]:.3f}")
