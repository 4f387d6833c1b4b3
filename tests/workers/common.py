"""Pieces shared by worker scripts and the tests that check them."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np

GLOBAL_BATCH = 16
EQUIVALENCE_STEPS = 5


def write_result(out_dir: str, payload: dict) -> None:
    """Writes this worker's results to ``out_dir/worker<rank>.json``."""
    rank = int(os.environ.get("TFDIST_WORKER_INDEX") or os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or "0")
    pathlib.Path(out_dir, f"worker{rank}.json").write_text(json.dumps(payload))


def regression_data(num_examples: int = GLOBAL_BATCH * EQUIVALENCE_STEPS):
    """A fixed regression problem: 6 features, 1 target."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num_examples, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.1).astype("float32")
    return x, y


def equivalence_model():
    """A small MLP with fixed starting weights, so every process starts equal."""
    import keras

    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    rng = np.random.default_rng(1)
    model.set_weights([rng.normal(scale=0.5, size=w.shape).astype("float32") for w in model.get_weights()])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05), loss="mse")
    return model


def train_equivalence_on_arrays(strategy=None) -> dict:
    """The same steps from NumPy arrays (``fit(x, y, batch_size=GLOBAL_BATCH)``), with validation.

    Returns the weights, the val_loss of ``validation_split=0.25`` and of ``validation_data``.
    """
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    x, y = regression_data()
    with strategy.scope():
        model = equivalence_model()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    weights = [w.tolist() for w in model.get_weights()]
    split = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0, validation_split=0.25)
    data = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0, validation_data=(x, y))
    return {"weights": weights, "val_loss_split": split.history["val_loss"][0],
            "val_loss_data": data.history["val_loss"][0]}


def train_equivalence(strategy=None, steps_per_execution: int = 1) -> list[np.ndarray]:
    """SGD for EQUIVALENCE_STEPS steps at GLOBAL_BATCH, in order; returns the weights."""
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        model = equivalence_model()
        model.compile(optimizer=model.optimizer, loss="mse", steps_per_execution=steps_per_execution)
    x, y = regression_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    model.fit(dataset, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()
