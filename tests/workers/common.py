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


def train_equivalence_on_arrays_of(num_examples: int, sample_weight=None, strategy=None) -> list[list]:
    """One epoch of ``fit(x, y, batch_size=4)`` on ``num_examples`` (49: a last batch of 1); returns the weights."""
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    x, y = regression_data(num_examples)
    with strategy.scope():
        model = equivalence_model()
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, sample_weight=sample_weight)
    return [w.tolist() for w in model.get_weights()]


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


def step_counts(strategy=None, steps_per_execution=1, wrap_optimizer=lambda optimizer: optimizer) -> dict:
    """Step counts K does not divide: fit(steps_per_epoch=10, validation_steps=3), evaluate/predict(steps=5),
    and 2 epochs over 11 batches with no step count. Returns what a user would compare with K=1.

    ``steps_per_execution=None`` leaves it out of ``compile`` (tfdist's default); ``wrap_optimizer``
    makes e.g. a Horovod DistributedOptimizer.
    """
    import keras
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    k = {} if steps_per_execution is None else {"steps_per_execution": steps_per_execution}
    with strategy.scope():
        model = equivalence_model()
        model.compile(optimizer=wrap_optimizer(keras.optimizers.SGD(learning_rate=0.05)), loss="mse",
                      metrics=["mae"], **k)
    x, y = regression_data(GLOBAL_BATCH * 11)
    eleven = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    six = eleven.take(6).repeat()
    batches: dict[str, list[list[int]]] = {"train": [], "test": [], "train_to_the_data_end": []}
    train = "train"  # the recorder reads it when called: the last fit's epochs, which their data ends, go apart
    recorder = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: batches[train].append([]),
        on_train_batch_end=lambda batch, logs: batches[train][-1].append(batch),
        on_test_begin=lambda logs: batches["test"].append([]),
        on_test_batch_end=lambda batch, logs: batches["test"][-1].append(batch))
    history = model.fit(six, epochs=3, steps_per_epoch=10, validation_data=eleven.repeat(), validation_steps=3,
                        verbose=0, callbacks=[recorder])
    result = {"fit_iterations": int(model.optimizer.iterations.numpy()), "history": history.history}
    result["evaluate"] = model.evaluate(eleven.repeat(), steps=5, verbose=0, callbacks=[recorder])
    result["predict_shape"] = list(model.predict(eleven.repeat(), steps=5, verbose=0).shape)
    train = "train_to_the_data_end"
    model.fit(eleven, epochs=2, verbose=0, callbacks=[recorder])
    result["iterations"] = int(model.optimizer.iterations.numpy())
    result["batches"] = batches
    result["weights"] = [w.tolist() for w in model.get_weights()]
    return result


def assert_same_steps(one: dict, k: dict) -> None:
    """What a user compares between a K=1 run and a K-steps-per-call run of ``step_counts``."""
    assert k["fit_iterations"] == one["fit_iterations"] == 3 * 10  # not 3 * ceil(10/K) * K
    assert k["iterations"] == one["iterations"] == 30 + 2 * 11
    assert k["predict_shape"] == one["predict_shape"] == [5 * GLOBAL_BATCH, 1]
    for key in one["history"]:
        np.testing.assert_allclose(k["history"][key], one["history"][key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(k["evaluate"], one["evaluate"], rtol=1e-5)
    for a, b in zip(k["weights"], one["weights"]):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for kind in ("train", "test", "train_to_the_data_end"):  # callbacks see every K-th batch
        assert len(k["batches"][kind]) == len(one["batches"][kind])
        for seen, every in zip(k["batches"][kind], one["batches"][kind]):
            steps = seen[0] + 1  # K: a call reports its last batch
            # a step count ends the epoch: the true last batch, never past it; the data ends it: Keras' number, the
            # batch a whole call would end at (its call stops at the data's end, as tfdist's does)
            last = every[-1] if kind != "train_to_the_data_end" else every[-1] // steps * steps + steps - 1
            assert set(seen[:-1]) <= set(every) and seen[-1] == last, (kind, seen, every)


def batchnorm_data():
    """64 small images in 4 brightness groups (so batch statistics differ per shard), 3 classes."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 8, 8, 1)).astype("float32") + np.repeat(np.arange(4), 16)[:, None, None, None]
    return x, rng.integers(0, 3, size=64)


def train_batchnorm_cnn(strategy=None, synchronized: bool = False, epochs: int = 2, callbacks=()):
    """A MobileNetV2-like block at toy size (Conv2D, BatchNormalization, ReLU, pooling, Dense), global batch 16.

    Returns the model and its loss history.
    """
    import keras
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    x, y = batchnorm_data()
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([
            keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3),
            keras.layers.BatchNormalization(synchronized=synchronized), keras.layers.ReLU(),
            keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))
    return model, history.history["loss"]


JOIN_BATCH = 4
JOIN_LR = 0.05


def join_start():
    """The linear model's starting weights (kernel 3x1, bias) for the join tests."""
    return [np.array([[0.5], [-0.3], [0.1]], "float32"), np.array([0.2], "float32")]


def join_data(seed: int, batches: int):
    """``batches`` batches of JOIN_BATCH rows of a linear regression, different per seed."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batches * JOIN_BATCH, 3)).astype("float32")
    return x, (x @ np.array([[1.0], [2.0], [-1.0]]) + 0.5).astype("float32")


def join_by_hand(datasets, lr: float = JOIN_LR, per_example: bool = False):
    """SGD on a linear model, Horovod's mean of each rank's gradient; a rank out of batches adds zeros (join).

    ``per_example``: one device's mean over every rank's rows of the step instead (tfdist's fit weighs each
    replica by its share of the step's examples: a rank out of batches adds nothing).
    """
    kernel, bias = (w.astype("float64") for w in join_start())
    for step in range(-(-max(len(x) for x, _ in datasets) // JOIN_BATCH)):
        grads, rows_seen = [], 0
        for x, y in datasets:
            rows = slice(step * JOIN_BATCH, (step + 1) * JOIN_BATCH)
            if rows.start >= len(x):
                grads.append((np.zeros_like(kernel), np.zeros_like(bias)))
                continue
            error = x[rows] @ kernel + bias - y[rows]  # a partial last batch: the mean over its own rows
            weight = 1 if per_example else len(error)
            grads.append((2 * x[rows].T @ error / weight, 2 * error.sum(0) / weight))
            rows_seen += len(error)
        divisor = rows_seen if per_example else len(datasets)
        kernel = kernel - lr * sum(g[0] for g in grads) / divisor
        bias = bias - lr * sum(g[1] for g in grads) / divisor
    return [kernel, bias]


def sync_bn_data():
    """48 rows, 3 features with different scales: 3 global batches of 16."""
    rng = np.random.default_rng(5)
    x = (rng.normal(size=(48, 3)) * [1.0, 3.0, 0.5] + [0.0, 5.0, -2.0]).astype("float32")
    return x, rng.normal(size=(48, 1)).astype("float32")


def sync_bn_model(batch_norm):
    """BatchNormalization first, then Dense(1) with fixed weights."""
    import keras

    model = keras.Sequential([keras.Input((3,)), batch_norm, keras.layers.Dense(1)])
    weights = model.get_weights()
    weights[-2:] = [np.array([[0.3], [-0.2], [0.4]], "float32"), np.zeros(1, "float32")]
    model.set_weights(weights)
    return model


def embedding_model():
    """Embedding(8, 2) -> mean over the sequence -> Dense(1), fixed weights (sparse gradients for the table)."""
    import keras

    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(8, 2),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    rng = np.random.default_rng(7)
    model.set_weights([rng.normal(scale=0.5, size=w.shape).astype("float32") for w in model.get_weights()])
    return model


def embedding_data(seed: int, rows: int):
    """``rows`` sequences of 3 token ids in [0, 8) and a target each."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 8, size=(rows, 3)).astype("int32"), rng.normal(size=(rows, 1)).astype("float32")


def mean_of_gradients(model, rank_batches, lr: float = JOIN_LR) -> list:
    """Plain SGD on ``model`` in one process: each step applies the mean of the ranks' mean-squared-error gradients.

    ``rank_batches[rank]`` is that rank's list of (x, y) batches; all ranks have as many.
    """
    import tensorflow as tf

    for step in zip(*rank_batches):
        total = [tf.zeros_like(v) for v in model.trainable_variables]
        for x, y in step:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            total = [t + tf.convert_to_tensor(g) for t, g in zip(total, grads)]
        for variable, gradient in zip(model.trainable_variables, total):
            variable.assign_sub(lr * gradient / len(step))
    return [w for w in model.get_weights()]


def collectives_waited_for(graph) -> dict:
    """Each collective op of a traced ``graph``, in creation order -> the collectives it waits for (data or control)."""
    collectives = [op for op in graph.get_operations() if op.type.startswith("Collective")]
    waits = {}
    for op in collectives:
        seen, stack = set(), [op]
        while stack:
            current = stack.pop()
            for parent in [t.op for t in current.inputs] + list(current.control_inputs):
                if parent.name not in seen:
                    seen.add(parent.name)
                    stack.append(parent)
        waits[op] = [other for other in collectives if other.name in seen]
    return waits


SHARDED_STEPS, SHARDED_EPOCHS = 6, 2  # tests/workers/sharded_state_job.py


def resumable_model(use_ema: bool = False):
    """``equivalence_model`` with Adam on a decaying learning rate: optimizer state a resumed run must restore.

    ``use_ema``: Adam also keeps moving averages of the weights, which overwrite them every 4th update.
    """
    import keras

    model = equivalence_model()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=5, decay_rate=0.9)
    ema = {"use_ema": True, "ema_momentum": 0.8, "ema_overwrite_frequency": 4} if use_ema else {}
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=schedule, **ema), loss="mse")
    return model


def sgd_train_step(strategy, model, optimizer):
    """A custom loop's tf.function step: mean squared error over GLOBAL_BATCH, the optimizer's update."""
    import keras
    import tensorflow as tf

    @tf.function
    def train_step(batch):
        def replica_step(features, labels):
            with tf.GradientTape() as tape:
                per_example = keras.losses.mean_squared_error(labels, model(features, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        strategy.run(replica_step, args=batch)

    return train_step


def tape_step(hvd, model, optimizer, x, y):
    """A Horovod custom loop's ``tf.function`` step: mean squared error of ``model`` on (x, y) through
    ``hvd.DistributedGradientTape``; returns the loss."""
    import tensorflow as tf

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


UNEVEN_EPOCHS = 3
UNEVEN_CASES = ((49, 4, "sgd"), (5, 5, "adam"), (45, 6, "sgd"))  # examples, global batch, optimizer
# examples, global batch, the MeanSquaredError's reduction (issue 49: a sum, and a mean over random sample weights,
# each replica's divided by its own weights' sum, on even and uneven splits)
REDUCTION_CASES = ((20, 10, "sum"), (45, 6, "sum"), (40, 10, "mean_with_sample_weight"),
                   (45, 6, "mean_with_sample_weight"))


def uneven_data(examples: int):
    """A linear regression of ``examples`` rows (the same on every worker)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(examples, 6)).astype("float32")
    return x, (x @ rng.normal(size=(6, 1))).astype("float32")


def uneven_model(optimizer: str, reduction: str = "sum_over_batch_size"):
    """A seeded MLP with an L2 regularizer (regularization keeps its per-step weight): SGD, Adam, SGD with a
    ``loss_scale_factor`` of 3, or a slow SGD; the mean squared error reduced by ``reduction``."""
    import keras

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh", kernel_regularizer="l2"),
                              keras.layers.Dense(1)])
    optimizers = {"adam": lambda: keras.optimizers.Adam(0.01), "sgd": lambda: keras.optimizers.SGD(0.05),
                  "sgd_scaled": lambda: keras.optimizers.SGD(0.05, loss_scale_factor=3.0),
                  "sgd_slow": lambda: keras.optimizers.SGD(0.005)}  # a sum's gradients grow with the batch
    model.compile(optimizers[optimizer](), keras.losses.MeanSquaredError(reduction=reduction), metrics=["mae"])
    return model


def uneven_run(model, examples: int, batch: int, weighted: bool = False) -> dict:
    """fit for UNEVEN_EPOCHS, evaluate and predict on global batches of ``batch`` (with random sample weights if
    ``weighted``): what a user compares."""
    import tensorflow as tf

    x, y = uneven_data(examples)
    weights = (np.random.default_rng(5).uniform(0.1, 2.0, size=examples).astype("float32"),) if weighted else ()
    dataset = tf.data.Dataset.from_tensor_slices((x, y, *weights)).batch(batch)
    history = model.fit(dataset, epochs=UNEVEN_EPOCHS, verbose=0)
    return {"weights": [w.tolist() for w in model.get_weights()], "loss": history.history["loss"],
            "evaluate": model.evaluate(dataset, verbose=0), "predict": model.predict(dataset, verbose=0).tolist(),
            "iterations": int(model.optimizer.iterations.numpy())}


def reduction_run(examples: int, batch: int, reduction: str, strategy=None) -> dict:
    """``uneven_run`` of a slow SGD on the mean squared error reduced by ``reduction`` (REDUCTION_CASES), under
    ``strategy`` (None: one device)."""
    import contextlib

    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = uneven_model("sgd_slow", reduction)
    return uneven_run(model, examples, batch, weighted=reduction == "mean_with_sample_weight")


def assert_uneven_run_equal(got: dict, want: dict, examples: int, batch: int) -> None:
    """``got`` (several replicas) is one device's ``want``: weights and predictions to 1e-6."""
    assert got["iterations"] == want["iterations"] == UNEVEN_EPOCHS * -(-examples // batch)
    for a, b in zip(got["weights"], want["weights"]):
        np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["evaluate"], want["evaluate"], rtol=1e-5)
    np.testing.assert_allclose(got["predict"], want["predict"], atol=1e-6)


def uneven_loop_start() -> list:
    """The custom loop's start: a Dense(6 -> 1), the same on every worker."""
    rng = np.random.default_rng(3)
    return [rng.normal(size=(6, 1)).astype("float32"), np.zeros(1, "float32")]


def uneven_loop_by_hand(examples: int = 11, batch: int = 5, lr: float = 0.1) -> list:
    """One device's SGD on the mean squared error of each batch (float64)."""
    x, y = (a.astype("float64") for a in uneven_data(examples))
    kernel, bias = (w.astype("float64") for w in uneven_loop_start())
    for i in range(0, examples, batch):
        error = x[i:i + batch] @ kernel + bias - y[i:i + batch]
        kernel = kernel - lr * 2 * x[i:i + batch].T @ error / len(error)
        bias = bias - lr * 2 * error.mean(0)
    return [kernel, bias]


def uneven_loop(strategy) -> list:
    """A custom loop under ``strategy`` whose loss is ``tfdist.compute_average_loss``, over batches of 5 of
    ``uneven_data(11)`` (2 replicas: 3/2, then 1/0); returns the weights (``uneven_loop_by_hand``'s on one device)."""
    import keras
    import tensorflow as tf

    import tfdist

    x, y = uneven_data(11)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        model.set_weights(uneven_loop_start())
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)

    @tf.function
    def step(xb, yb):
        def replica(xr, yr):
            with tf.GradientTape() as tape:
                loss = tfdist.compute_average_loss(tf.square(model(xr) - yr)[:, 0])
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        strategy.run(replica, args=(xb, yb))

    for xb, yb in strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(5)):
        step(xb, yb)
    return [w.tolist() for w in model.get_weights()]


CHECKPOINT_BATCH = 12  # splits evenly over 1, 2, 3 and 4 workers


def checkpoint_model(strategy=None, sharded: bool = False):
    """A seeded MLP under AdamW with weight decay and global clipping (tfdist.CheckpointManager's tests)."""
    import contextlib

    import keras

    from tfdist import sharding

    with strategy.scope() if strategy is not None else contextlib.nullcontext(), sharding.scoped(sharded):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(9, activation="tanh"), keras.layers.Dense(3)])
        model.compile(keras.optimizers.AdamW(0.01, weight_decay=0.01, global_clipnorm=1.0), "mse")
    return model


def checkpoint_data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(48, 5)).astype("float32"), rng.normal(size=(48, 3)).astype("float32")


def checkpoint_state(model) -> list[list]:
    """The weights, then the optimizer's variables, whole (a sharded slot is gathered: every worker calls it)."""
    return [np.asarray(v).tolist() for v in model.weights] + [np.asarray(v).tolist() for v in model.optimizer.variables]


def fit_two_steps_saying_when_the_first_began(model, dataset) -> None:
    """``fit`` of 2 steps that prints "worker N began its first step" (the file-check jobs: it must never print)."""
    import keras

    import tfdist

    class FirstStep(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            print(f"worker {tfdist.rank()} began its first step", flush=True)

    model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[FirstStep()])


# PowerSGD (issue 52): one model and task for the 2-worker job and its one-process references ------------------

POWERSGD_BATCH = 32  # global: 16 per worker, or per logical device
POWERSGD_EXAMPLES = 256  # 8 steps an epoch: compression starts at step 2 (start_step) of the first


def powersgd_data(examples: int = POWERSGD_EXAMPLES, features: int = 24, classes: int = 4, seed: int = 0):
    """A learnable task: labels from a fixed random linear map of the features (plus a little noise)."""
    rng = np.random.RandomState(seed)
    x = rng.randn(examples, features).astype("float32")
    y = np.argmax(x @ rng.randn(features, classes) + 0.3 * rng.randn(examples, classes), axis=1).astype("int32")
    return x, y


def powersgd_model(compression="unset"):
    """An MLP 24-64-64-4 (kernels 24x64 and 64x64 compressed at rank 2; 64x4 gains too little), fixed start,
    compiled with ``tfdist.DistributedOptimizer(SGD(0.05, momentum=0.9), compression=compression)``; "unset"
    passes no ``compression=`` (``TFDIST_COMPRESSION`` decides). Build it inside the strategy's scope."""
    import keras

    import tfdist

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((24,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)])
    chosen = {} if compression == "unset" else {"compression": compression}
    optimizer = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), **chosen)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def train_powersgd(strategy=None, compression="unset", epochs: int = 2, callbacks=(), model=None):
    """``fit`` of ``powersgd_model`` on ``powersgd_data`` at POWERSGD_BATCH (unshuffled); returns the model and
    its loss history."""
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    if model is None:
        with strategy.scope():
            model = powersgd_model(compression)
    x, y = powersgd_data()
    history = model.fit(x, y, batch_size=POWERSGD_BATCH, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=list(callbacks))
    return model, history.history.get("loss", [])


def powersgd_local_errors(strategy, model) -> list[list]:
    """This process's error feedback of each compressed kernel (its replicas' copies; no collective)."""
    return [[t.numpy().tolist() for t in strategy.experimental_local_results(error.value)]
            for error, _ in model.optimizer._tfdist_powersgd.values()]
