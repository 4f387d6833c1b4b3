"""PowerSGD gradient compression (issue 52) in one process: 2 or 4 replicas on logical CPUs.

Oracles: a NumPy PowerSGD step (Vogels et al. 2019, PyTorch's powerSGD_hook) for the per-replica
state; exact training (``Compression.none``) for rank >= min(n, m) and for accuracy.
"""

import collections
import itertools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.jobs import run_job
from tests.workers import common
from tfdist import compression as compression_lib
from tfdist.compression import Compression

_key_bases = itertools.count(1)


@pytest.fixture
def strategy_of(fresh_tfdist_strategy, monkeypatch):
    """A MirroredStrategy over the first ``replicas`` logical CPUs, with collective keys of its own (one test may
    make several)."""
    from tfdist import state

    def make(replicas=2):
        monkeypatch.setattr(state, "built", None)
        monkeypatch.setattr(tf.distribute.MirroredStrategy, "_collective_key_base", 7_000_000 + 1000 * next(_key_bases))
        return tfdist.get_strategy("mirrored", devices=f"CPU:[0-{replicas - 1}]")
    return make


def powersgd(rank=2, start_step=0, min_compression_rate=0.0):
    return Compression.powersgd(rank=rank, start_step=start_step, min_compression_rate=min_compression_rate)


def copies(strategy, variable):
    value = variable.value if isinstance(variable, keras.Variable) else variable
    return [t.numpy() for t in strategy.experimental_local_results(value)]


def assert_bit_equal_everywhere(strategy, variables):
    for variable in variables:
        first, *others = copies(strategy, variable)
        for other in others:
            np.testing.assert_array_equal(first, other, err_msg=variable.path)


# A custom loop of apply_gradients with gradients chosen per replica, and a NumPy oracle --------------

def apply_steps(strategy, optimizer, variables, tables, steps):
    """``steps`` updates; replica r's gradient of variable i at step s is ``tables[i][s, r]``."""
    step = step_function(strategy, optimizer, variables, tables)
    for _ in range(steps):
        step()


def step_function(strategy, optimizer, variables, tables):
    """The ``tf.function`` of one ``apply_steps`` update (each call the next step of ``tables``)."""
    constants = [tf.constant(t) for t in tables]
    step_index = tf.Variable(0)

    @tf.function
    def step():
        def on_replica():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            grads = [tf.gather(tf.gather(c, step_index), r) for c in constants]
            optimizer.apply_gradients(zip(grads, variables))
        strategy.run(on_replica)
        step_index.assign_add(1)

    return step


def collectives_by_device(function) -> dict:
    """The collective ops a traced ``tf.function`` launches (cond branches included), by the device's last part."""
    graph = function.get_concrete_function().graph.as_graph_def()
    library = {f.signature.name: f for f in graph.library.function}
    counts = collections.Counter()

    def walk(nodes):
        for node in nodes:
            if node.op.startswith("Collective"):
                counts[node.device.rpartition("device:")[2]] += 1
            for attr in node.attr.values():
                for name in [attr.func.name, *(f.name for f in attr.list.func)]:
                    if name in library:
                        walk(library[name].node_def)

    walk(graph.node)
    return dict(counts)


def numpy_powersgd(grads, error, q):
    """One step of PowerSGD for one matrix over replicas (sum convention): approx, new errors, new Q."""
    replicas = len(grads)
    ms = [g.reshape(-1, q.shape[0]) + e.reshape(-1, q.shape[0]) for g, e in zip(grads, error)]
    p = sum(m @ q for m in ms)
    p = np.linalg.qr(p)[0]
    new_q = sum(m.T @ p for m in ms)
    approx = p @ new_q.T
    return approx, [(m - approx / replicas).reshape(g.shape) for m, g in zip(ms, grads)], new_q


def test_two_steps_match_numpy_powersgd_with_error_feedback_and_a_warm_start(strategy_of):
    strategy = strategy_of(2)
    rng = np.random.RandomState(0)
    shape, steps = (6, 5), 2
    table = rng.randn(steps, 2, *shape).astype("float32")
    with strategy.scope():
        kernel = keras.Variable(np.zeros(shape, "float32"), name="kernel")
        optimizer = tfdist.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=powersgd(rank=2))
        optimizer.build([kernel])
    (error, q), = optimizer._tfdist_powersgd.values()
    q0 = q.numpy().copy()
    np.testing.assert_array_equal(q0, powersgd(rank=2).first_q(shape, tf.float32, 0).numpy())

    apply_steps(strategy, optimizer, [kernel], [table], 1)
    approx, errors, q1 = numpy_powersgd(list(table[0]), [np.zeros(shape)] * 2, q0)
    np.testing.assert_allclose(kernel.numpy(), -approx, atol=1e-5)
    for got, want in zip(copies(strategy, error), errors):
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert np.abs(got).max() > 0.1  # error feedback holds what the rank-2 factors left out
    # Q is the all-reduced M^T P (QR's signs may differ from NumPy's: compare up to a sign per column)
    got_q = q.numpy()
    np.testing.assert_allclose(np.abs(got_q), np.abs(q1), atol=1e-4)
    assert not np.allclose(got_q, q0)

    apply_steps(strategy, optimizer, [kernel], [table[1:]], 1)  # starts from the Q kept: warm start
    approx2, errors2, _ = numpy_powersgd(list(table[1]), errors, got_q)
    np.testing.assert_allclose(kernel.numpy(), -approx - approx2, atol=1e-4)
    for got, want in zip(copies(strategy, error), errors2):
        np.testing.assert_allclose(got, want, atol=1e-4)
    # a cold start (the first Q again) would give another update
    cold, _, _ = numpy_powersgd(list(table[1]), errors, q0)
    assert not np.allclose(approx2, cold, atol=1e-3)


def test_warm_up_steps_are_exact_and_keep_the_error_zero(strategy_of):
    strategy = strategy_of(2)
    rng = np.random.RandomState(1)
    table = rng.randn(3, 2, 8, 7).astype("float32")
    with strategy.scope():
        kernel = keras.Variable(np.zeros((8, 7), "float32"), name="kernel")
        optimizer = tfdist.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=powersgd(rank=1, start_step=2))
        optimizer.build([kernel])
    (error, _), = optimizer._tfdist_powersgd.values()
    apply_steps(strategy, optimizer, [kernel], [table], 2)
    np.testing.assert_allclose(kernel.numpy(), -table[:2].sum(axis=(0, 1)), atol=1e-5)
    assert all(not c.any() for c in copies(strategy, error))
    apply_steps(strategy, optimizer, [kernel], [table[2:]], 1)
    assert any(np.abs(c).max() > 0.1 for c in copies(strategy, error))


# Training with fit ------------------------------------------------------------------------------

def classification_data(examples=2048, features=24, classes=4, seed=0):
    """A learnable task: labels from a fixed random linear map of the features (plus a little noise)."""
    rng = np.random.RandomState(seed)
    x = rng.randn(examples, features).astype("float32")
    w = rng.randn(features, classes)
    y = np.argmax(x @ w + 0.3 * rng.randn(examples, classes), axis=1).astype("int32")
    return x, y


def mlp(features=24, classes=4):
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((features,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(64, activation="relu"), keras.layers.Dense(classes)])


def train(strategy, compression, make_optimizer, epochs=1, batch=64, data=None, make_model=mlp):
    x, y = data or classification_data()
    with strategy.scope():
        model = make_model()
        model.compile(tfdist.DistributedOptimizer(make_optimizer(), compression=compression),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=False)
    return model


@pytest.mark.parametrize("replicas, make_optimizer", [
    (2, lambda: keras.optimizers.SGD(0.05, momentum=0.9)),
    (4, lambda: keras.optimizers.Adam(1e-3)),
])
def test_every_replica_holds_bit_equal_weights_and_q_after_training(strategy_of, replicas, make_optimizer):
    strategy = strategy_of(replicas)
    model = train(strategy, powersgd(rank=2), make_optimizer, data=classification_data(512))
    optimizer = model.optimizer
    assert len(optimizer._tfdist_powersgd) == 3  # the three kernels
    assert_bit_equal_everywhere(strategy, model.weights)
    assert_bit_equal_everywhere(strategy, [v for v in optimizer.variables if "powersgd_error" not in v.path])
    errors = [copies(strategy, e) for e, _ in optimizer._tfdist_powersgd.values()]
    assert all(np.abs(c).max() > 0 for each in errors for c in each)
    assert any(not np.array_equal(each[0], each[1]) for each in errors)  # each replica keeps its own


def test_a_rank_of_at_least_min_n_m_trains_as_exact(strategy_of):
    """Rank >= min(n, m) spans each matrix: every step equals the exact all-reduce (float tolerance)."""
    strategy = strategy_of(2)

    def small():
        keras.utils.set_random_seed(5)  # kernels 24x6 and 6x4: rank 6 spans both
        return keras.Sequential([keras.Input((24,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(4)])

    data = classification_data(512)
    exact = train(strategy, Compression.none, lambda: keras.optimizers.SGD(0.1), data=data, make_model=small)
    full = train(strategy, powersgd(rank=6), lambda: keras.optimizers.SGD(0.1), data=data, make_model=small)
    assert len(full.optimizer._tfdist_powersgd) == 2
    for got, want in zip(full.get_weights(), exact.get_weights()):
        np.testing.assert_allclose(got, want, atol=2e-5)
    low = train(strategy, powersgd(rank=1), lambda: keras.optimizers.SGD(0.1), data=data, make_model=small)
    assert not all(np.allclose(a, b, atol=1e-3) for a, b in zip(low.get_weights(), exact.get_weights()))


def test_a_learnable_task_reaches_the_exact_accuracy_within_one_point(strategy_of):
    strategy = strategy_of(2)
    x, y = classification_data(6144, seed=0)  # the same linear map: 4096 to train, 2048 held out
    data, x_test, y_test = (x[:4096], y[:4096]), x[4096:], y[4096:]
    results = {}
    for name, compression in [("exact", Compression.none),
                              ("powersgd", Compression.powersgd(rank=2, start_step=10))]:
        model = train(strategy, compression, lambda: keras.optimizers.SGD(0.05, momentum=0.9), epochs=3, data=data)
        results[name] = model.evaluate(x_test, y_test, batch_size=256, verbose=0)[1]
        if name == "powersgd":
            assert len(model.optimizer._tfdist_powersgd) == 2  # 24x64 and 64x64 compressed; 64x4 gains too little
    assert results["exact"] > 0.85, results
    assert results["powersgd"] >= results["exact"] - 0.01, results


def collectives_in_a_train_step(strategy, model, x, y) -> dict:
    """The collectives replica 0 launches in one traced ``train_step`` of a compiled, built ``model``, by where:
    "step" (outside any cond), "warm-up" and "compressed" (the branches of PowerSGD's cond on its start step)."""

    @tf.function
    def step(x, y):
        return strategy.run(model.train_step, args=((x, y),))

    graph = step.get_concrete_function(tf.constant(x), tf.constant(y)).graph.as_graph_def()
    library = {f.signature.name: f for f in graph.library.function}
    counts = collections.Counter()

    def walk(nodes, where):
        for node in nodes:
            if node.op.startswith("Collective") and node.device.endswith("CPU:0"):
                counts[where] += 1
            for attr in node.attr.values():
                for name in [attr.func.name, *(f.name for f in attr.list.func)]:
                    if name in library:
                        branch = re.search(r"_cond(_\d+)?_(true|false)_\d+$", name)
                        walk(library[name].node_def, where if branch is None else
                             {"true": "warm-up", "false": "compressed"}[branch.group(2)])

    walk(graph.node, "step")
    return dict(counts)


@pytest.mark.parametrize("start_step, expected", [
    (0, {"step": 2}),
    (3, {"warm-up": 1, "compressed": 2}),
])
def test_a_compressed_fit_step_launches_two_collectives_p_with_the_rest_and_the_count_then_q(
        strategy_of, start_step, expected):
    """Each collective has a fixed CPU cost that dominated a compressed step (issue 52): the vectors travelling exact
    and the step's example count ride in P's all-reduce, the loss tracker needs no global count; the warm-up
    all-reduces everything in one call."""
    strategy = strategy_of(2)
    x, y = classification_data(128)
    with strategy.scope():
        model = mlp()
        model.compile(tfdist.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=powersgd(
            rank=2, start_step=start_step)), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    assert collectives_in_a_train_step(strategy, model, x[:64], y[:64]) == expected


def test_an_exact_fit_step_launches_no_collective_but_the_gradient_bucket(strategy_of):
    """The example count rides in the gradient bucket; the loss tracker weighs each replica's loss by its own count
    and launches no collective of its own (it did: one more per step, issue 52)."""
    strategy = strategy_of(2)
    x, y = classification_data(128)  # the MLP's 25 KB of gradients: one bucket
    with strategy.scope():
        model = mlp()
        model.compile(keras.optimizers.SGD(0.05), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    assert collectives_in_a_train_step(strategy, model, x[:64], y[:64]) == {"step": 1}


@pytest.mark.parametrize("start_step", [0, 2])
def test_batches_split_unevenly_with_a_partial_last_one_train_at_full_rank_as_exact(strategy_of, start_step):
    """Every example weighs as on one device however the batch splits (the gradients are sums divided by the count
    that rode in P's all-reduce): full rank spans every matrix, so each step equals exact training's."""
    strategy = strategy_of(2)

    def small():
        keras.utils.set_random_seed(5)
        return keras.Sequential([keras.Input((24,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(4)])

    data = classification_data(500)  # batches of 63 (32 + 31 examples), the last of 59
    exact = train(strategy, Compression.none, lambda: keras.optimizers.SGD(0.1), data=data, make_model=small, batch=63)
    full = train(strategy, powersgd(rank=6, start_step=start_step), lambda: keras.optimizers.SGD(0.1), data=data,
                 make_model=small, batch=63)
    for got, want in zip(full.get_weights(), exact.get_weights()):
        np.testing.assert_allclose(got, want, atol=2e-5)
    assert_bit_equal_everywhere(strategy, full.weights)


# Two real workers (tests/workers/powersgd_job.py) -----------------------------------------------------------

@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """One 2-worker job: fit with PowerSGD chosen in code, then by ``TFDIST_COMPRESSION`` (both rank 2, start 2)."""
    return run_job("powersgd_job.py", tmp_path_factory.mktemp("powersgd"), timeout=240,
                   env={"TFDIST_COMPRESSION": "powersgd:2:2"}).check().results


def test_two_workers_train_past_the_warm_up_to_bit_equal_weights_with_their_own_error_feedback(two_workers):
    first, second = two_workers[0]["explicit"], two_workers[1]["explicit"]
    assert two_workers[0]["replicas"] == 2
    assert first["compression"] == repr(Compression.powersgd(rank=2, start_step=2))
    assert first["iterations"] == 2 * common.POWERSGD_EXAMPLES // common.POWERSGD_BATCH  # 16 steps, 14 compressed
    for a, b in zip(first["weights"], second["weights"]):
        np.testing.assert_array_equal(a, b)
    assert first["losses"] == second["losses"] and first["losses"][-1] < 0.8 * first["losses"][0], first["losses"]
    assert len(first["errors"]) == 2  # the 24x64 and 64x64 kernels (64x4 gains too little at rank 2)
    for mine, theirs in zip(first["errors"], second["errors"]):
        assert np.abs(mine).max() > 0 and np.abs(theirs).max() > 0
        assert not np.array_equal(mine, theirs)  # each worker keeps its own


def test_two_workers_equal_two_logical_devices_in_one_process(two_workers, strategy_of):
    """The same global batch on 2 replicas in one process: each update depends on the replicas' sums alone."""
    strategy = strategy_of(2)
    reference, losses = common.train_powersgd(strategy, Compression.powersgd(rank=2, start_step=2))
    for rank in (0, 1):
        got = two_workers[rank]["explicit"]
        for a, b in zip(got["weights"], reference.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5)
        np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
    exact, _ = common.train_powersgd(strategy, Compression.none)  # and compression did change the training
    assert not all(np.allclose(a, b, atol=1e-3) for a, b in zip(exact.get_weights(), reference.get_weights()))


def test_two_workers_take_powersgd_from_the_environment(two_workers):
    """``TFDIST_COMPRESSION=powersgd:2:2`` and a DistributedOptimizer given no compression: the same training."""
    for rank in (0, 1):
        explicit, from_env = two_workers[rank]["explicit"], two_workers[rank]["from_env"]
        assert from_env["compression"] == explicit["compression"]
        for a, b in zip(from_env["weights"], explicit["weights"]):
            np.testing.assert_array_equal(a, b)
        assert from_env["errors"] == explicit["errors"]


def test_two_workers_preempted_after_an_epoch_resume_through_backup_and_restore_to_the_uninterrupted_weights(
        two_workers):
    """Each worker's error feedback comes back as the workers' total / 2 (see the one-process test below)."""
    for rank in (0, 1):
        resumed, whole = two_workers[rank]["resumed"], two_workers[rank]["explicit"]
        assert resumed["iterations"] == whole["iterations"] and len(resumed["losses"]) == 1
        for a, b in zip(resumed["weights"], whole["weights"]):
            np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=0, atol=1e-6)
    for a, b in zip(two_workers[0]["resumed"]["weights"], two_workers[1]["resumed"]["weights"]):
        np.testing.assert_array_equal(a, b)


# Shapes -------------------------------------------------------------------------------------------

def test_conv_kernels_and_vectors_and_an_embeddings_gradient(strategy_of):
    """A 4-D conv kernel is a [kh*kw*in, out] matrix; biases travel exact; an Embedding's sparse gradient is
    densified and compressed (it travels dense in tfdist's buckets anyway); a 3x2 matrix under rank 4 uses
    rank 2."""
    strategy = strategy_of(2)
    rng = np.random.RandomState(2)
    images = rng.rand(256, 8, 8, 3).astype("float32")
    tokens = rng.randint(0, 50, size=(256, 5)).astype("int32")
    labels = (images.mean(axis=(1, 2, 3)) > 0.5).astype("int32")

    def make_model():
        keras.utils.set_random_seed(4)
        image = keras.Input((8, 8, 3))
        token = keras.Input((5,), dtype="int32")
        a = keras.layers.Conv2D(8, 3, activation="relu")(image)
        a = keras.layers.GlobalAveragePooling2D()(a)
        b = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 3)(token))
        b = keras.layers.Dense(2)(b)  # a 3x2 kernel: smaller than the rank
        out = keras.layers.Dense(2)(keras.layers.Concatenate()([a, b]))
        return keras.Model([image, token], out)

    with strategy.scope():
        model = make_model()
        model.compile(tfdist.DistributedOptimizer(keras.optimizers.Adam(1e-2),
                                                  compression=Compression.powersgd(rank=4, start_step=0,
                                                                                   min_compression_rate=0)),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit([images, tokens], labels, batch_size=32, epochs=1, verbose=0)
    states = model.optimizer._tfdist_powersgd
    shapes = sorted(tuple(e.shape) + tuple(q.shape) for e, q in states.values())
    assert shapes == [(3, 2, 2, 2), (3, 3, 3, 8, 8, 4), (10, 2, 2, 2), (50, 3, 3, 3)], shapes
    assert_bit_equal_everywhere(strategy, model.weights)
    for error, q in states.values():
        assert all(np.isfinite(c).all() for c in copies(strategy, error) + copies(strategy, q))
    conv_error = next(e for e, _ in states.values() if len(e.shape) == 4)
    assert np.abs(copies(strategy, conv_error)[0]).max() > 0
    embedding_error = next(e for e, _ in states.values() if tuple(e.shape) == (50, 3))
    assert np.abs(copies(strategy, embedding_error)[0]).max() > 0


def test_which_weights_are_compressed():
    c = Compression.powersgd(rank=4)  # min_compression_rate 2: 4*(n+m)*2 < n*m
    assert c.matrix_shape((2304, 128), tf.float32) == (2304, 128)
    assert c.matrix_shape((3, 3, 32, 64), tf.float32) == (288, 64)
    assert c.matrix_shape((128,), tf.float32) is None  # a vector
    assert c.matrix_shape((16, 16), tf.float32) is None  # 4*32*2 = 256 is not < 256
    assert c.matrix_shape((64, 64), tf.int32) is None
    assert Compression.powersgd(rank=4, min_compression_rate=0).matrix_shape((3, 2), tf.float32) == (3, 2)
    assert c.matrix_shape((17, 17), tf.float32) == (17, 17)  # 4*34*2 = 272 < 289
    for shape, dtype in [((), tf.float32), ((0, 5), tf.float32), ((64, 64), tf.float16), ((64, 64), tf.bfloat16)]:
        assert c.matrix_shape(shape, dtype) is None, (shape, dtype)
    assert Compression.powersgd(rank=10 ** 9).first_q((6, 5), tf.float32, 0).shape == (5, 5)


def test_every_kind_of_weight_in_one_step_scalar_empty_half_precision_small_sparse_and_conv(strategy_of):
    """Two steps over weights of every kind: the ones PowerSGD leaves out move as exact training moves them; a 3x2
    matrix under rank 4 and a [3, 3, 2, 4] kernel at rank 4 are spanned (exact too); replicas stay bit-equal; a
    compressed weight whose gradient is None keeps its value and a zero error feedback."""
    strategy = strategy_of(2)
    specs = [((), "float32"), ((0, 5), "float32"), ((8, 7), "float16"), ((8, 7), "bfloat16"), ((7,), "float32"),
             ((3, 2), "float32"), ((3, 3, 2, 4), "float32"), ((10, 3), "float32")]
    rng = np.random.RandomState(4)
    tables = [rng.randn(2, 2, *shape).astype("float32") for shape, _ in specs]
    with strategy.scope():
        weights = [keras.Variable(np.zeros(shape), dtype=dtype, name=f"w{i}") for i, (shape, dtype) in enumerate(specs)]
        unused = keras.Variable(np.ones((6, 5), "float32"), name="unused")  # a frozen or unused branch: None
        optimizer = tfdist.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=powersgd(rank=4))
        optimizer.build(weights + [unused])
    assert sorted(tuple(e.shape) for e, _ in optimizer._tfdist_powersgd.values()) == [
        (3, 2), (3, 3, 2, 4), (6, 5), (10, 3)]
    constants = [tf.cast(t, dtype) for t, (_, dtype) in zip(tables, specs)]
    step_index = tf.Variable(0)

    @tf.function
    def step():
        def on_replica():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            grads = [c[step_index][r] for c in constants]
            rows = tf.constant([1, 4])  # the last, an Embedding's kind of gradient: two rows
            grads[-1] = tf.IndexedSlices(tf.gather(grads[-1], rows), rows, tf.constant([10, 3]))
            optimizer.apply_gradients(zip(grads + [None], weights + [unused]))
        strategy.run(on_replica)
        step_index.assign_add(1)

    with pytest.warns(UserWarning, match="Gradients do not exist"):
        step()
    step()
    assert_bit_equal_everywhere(strategy, weights)
    np.testing.assert_array_equal(unused.numpy(), np.ones((6, 5)))
    assert not any(c.any() for error, _ in optimizer._tfdist_powersgd.values() if error.shape == (6, 5)
                   for c in copies(strategy, error))
    for weight, table, (shape, dtype) in zip(weights[:-1], tables, specs):
        np.testing.assert_allclose(np.asarray(weight.numpy(), "float32"), -table.sum(axis=(0, 1)),
                                   atol=2e-2 if dtype in ("float16", "bfloat16") else 1e-5, err_msg=f"{shape} {dtype}")
    assert np.isfinite(weights[-1].numpy()).all() and np.abs(weights[-1].numpy()).max() > 0


def test_two_models_in_one_process_keep_their_own_state_through_retraces_and_a_second_compile(strategy_of):
    """Model 1 trained between model 2's fits (same layer shapes, same optimizer class) ends as when trained alone:
    a second fit at another batch size, steps_per_execution=3, and compile again with the same optimizer."""
    strategy = strategy_of(2)
    x, y = classification_data(384)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def fits(model, between=lambda: None):
        with strategy.scope():
            optimizer = tfdist.DistributedOptimizer(keras.optimizers.Adam(1e-3), compression=powersgd(rank=2))
            model.compile(optimizer, loss, steps_per_execution=3)
        model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
        between()
        model.fit(x, y, batch_size=48, epochs=1, verbose=0, shuffle=False)
        with strategy.scope():
            model.compile(optimizer, loss)
        model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
        return model

    with strategy.scope():
        alone = fits(mlp())
        first, second = mlp(), mlp()
    fits(first, between=lambda: fits(second))
    for got, want in zip(first.get_weights(), alone.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    paths = [v.path for model in (first, second) for v in model.optimizer.variables]
    assert len(paths) == len(set(paths))
    assert int(first.optimizer.iterations.numpy()) == 6 + 8 + 6
    assert_bit_equal_everywhere(strategy, first.weights + second.weights)


# Checkpoints ----------------------------------------------------------------------------------------

def test_the_state_is_saved_and_restored_with_the_optimizer(strategy_of, tmp_path):
    """Keras saves the error feedback (the replicas' total) and Q with the slots; a restored run's next steps
    equal the uninterrupted run's (each replica restarts from total / N: every update depends on the sum)."""
    strategy = strategy_of(2)
    data = classification_data(384)
    make = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
    whole = train(strategy, powersgd(rank=1), make, epochs=2, data=data)

    first = train(strategy, powersgd(rank=1), make, epochs=1, data=data)
    path = str(tmp_path / "first.weights.h5")
    first.save_weights(path)
    totals = [sum(copies(strategy, e)) for e, _ in first.optimizer._tfdist_powersgd.values()]
    resumed = _built_powersgd_model(strategy, make)
    resumed.load_weights(path)
    assert int(resumed.optimizer.iterations.numpy()) == 384 // 64
    for (error, q), total, (_, first_q) in zip(resumed.optimizer._tfdist_powersgd.values(), totals,
                                               first.optimizer._tfdist_powersgd.values()):
        for each in copies(strategy, error):
            np.testing.assert_allclose(each, total / 2, atol=1e-6)
        np.testing.assert_array_equal(q.numpy(), first_q.numpy())
    resumed.fit(*data, batch_size=64, epochs=1, verbose=0, shuffle=False)
    for got, want in zip(resumed.get_weights(), whole.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)


def _built_powersgd_model(strategy, make):
    """The MLP compiled under ``strategy`` with ``make()`` in a rank-1 PowerSGD DistributedOptimizer, built."""
    with strategy.scope():
        model = mlp()
        model.compile(tfdist.DistributedOptimizer(make(), compression=powersgd(rank=1)),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.optimizer.build(model.trainable_variables)
    return model


def _assert_resumes_to(strategy, make, path, data, whole):
    """A PowerSGD model built under ``strategy`` loads the weights file ``path`` and trains one epoch to ``whole``."""
    resumed = _built_powersgd_model(strategy, make)
    resumed.load_weights(path)
    resumed.fit(*data, batch_size=64, epochs=1, verbose=0, shuffle=False)
    for got, want in zip(resumed.get_weights(), whole.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("replicas", [1, 4])
def test_a_checkpoint_of_two_replicas_resumes_on_another_replica_count_to_the_uninterrupted_weights(
        strategy_of, tmp_path, replicas):
    """The error feedback saved is the replicas' total; every update depends on that sum alone, so a job restarted
    with another replica count (one device too: PowerSGD runs there as on N) continues the compressed run."""
    data = classification_data(384)
    make = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
    two = strategy_of(2)
    whole = train(two, powersgd(rank=1), make, epochs=2, data=data)
    first = train(two, powersgd(rank=1), make, epochs=1, data=data)
    path = str(tmp_path / "first.weights.h5")
    first.save_weights(path)
    other = strategy_of(replicas)
    _assert_resumes_to(other, make, path, data, whole)


def test_a_model_saved_whole_resumes_through_load_weights_into_a_compiled_powersgd_model(strategy_of, tmp_path):
    """``model.save`` writes the PowerSGD state; ``keras.models.load_model`` rebuilds the plain base optimizer (Keras
    skips the saved optimizer state with a warning), so docs/compression.md resumes with ``load_weights``."""
    strategy = strategy_of(2)
    data = classification_data(384)
    make = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
    whole = train(strategy, powersgd(rank=1), make, epochs=2, data=data)
    path = str(tmp_path / "first.keras")
    train(strategy, powersgd(rank=1), make, epochs=1, data=data).save(path)
    with strategy.scope(), pytest.warns(UserWarning, match="Skipping variable loading for optimizer"):
        plain = keras.models.load_model(path)
    assert not getattr(plain.optimizer, "tfdist_distributed", False) and int(plain.optimizer.iterations.numpy()) == 0
    _assert_resumes_to(strategy, make, path, data, whole)


class _Preempted(Exception):
    pass


class _PreemptAfterEpoch(keras.callbacks.Callback):
    """Stops the fit at the end of epoch ``epoch`` (after BackupAndRestore, listed before it, saved)."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise _Preempted(f"preempted after epoch {epoch}")


def test_a_preempted_compressed_fit_resumes_through_backup_and_restore_to_the_uninterrupted_weights(
        strategy_of, tmp_path):
    """fit(epochs=2) stopped after epoch 1 (past the warm-up), then a new model and optimizer resume it.

    The error feedback comes back as the replicas' total / N on each (``powersgd_state``): every update depends on
    the sum alone, so the resumed run equals the uninterrupted one up to float rounding (here 9e-8 one epoch
    after the resume; the rounding grows as training goes on: 2e-6 two epochs after).
    """
    strategy = strategy_of(2)
    compression = Compression.powersgd(rank=2, start_step=2)
    whole, whole_losses = common.train_powersgd(strategy, compression, epochs=2)
    backup = str(tmp_path / "backup")
    with pytest.raises(_Preempted):
        common.train_powersgd(strategy, compression, epochs=2,
                              callbacks=[keras.callbacks.BackupAndRestore(backup), _PreemptAfterEpoch(0)])
    resumed, resumed_losses = common.train_powersgd(strategy, compression, epochs=2,
                                                    callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert len(resumed_losses) == 1  # only the second epoch ran
    assert int(resumed.optimizer.iterations.numpy()) == int(whole.optimizer.iterations.numpy()) == 16
    assert all(np.abs(c).max() > 0 for error, _ in resumed.optimizer._tfdist_powersgd.values()
               for c in copies(strategy, error))
    for got, want in zip(resumed.get_weights(), whole.get_weights()):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(resumed_losses[0], whole_losses[1], rtol=1e-6)


# Choosing it ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, expected", [
    ("powersgd:4", Compression.powersgd(rank=4)),
    ("powersgd", Compression.powersgd()),
    ("POWERSGD:2:100", Compression.powersgd(rank=2, start_step=100)),
    ("fp16", Compression.fp16),
    ("none", Compression.none),
    ("", None),
])
def test_the_environment_names_the_compression(raw, expected):
    assert compression_lib.from_env({"TFDIST_COMPRESSION": raw}) == expected


@pytest.mark.parametrize("raw", ["powersgd:0", "powersgd:four", "gzip", "fp16:2", "powersgd:4:1:2"])
def test_a_bad_environment_value_is_a_named_error_listing_the_valid_ones(raw):
    with pytest.raises(tfdist.CompressionError, match=r"TFDIST_COMPRESSION=.* valid values: none, fp16, powersgd|"
                                                      r"TFDIST_COMPRESSION='powersgd:0': .*rank to be an int >= 1"):
        compression_lib.from_env({"TFDIST_COMPRESSION": raw})


def test_distributed_optimizer_takes_the_environments_compression(monkeypatch):
    monkeypatch.setenv("TFDIST_COMPRESSION", "powersgd:3:7")
    assert tfdist.DistributedOptimizer(keras.optimizers.SGD()).compression == Compression.powersgd(3, 7)
    assert tfdist.DistributedOptimizer(keras.optimizers.SGD(), compression=Compression.fp16).compression is \
        Compression.fp16
    monkeypatch.setenv("TFDIST_COMPRESSION", "zip")
    with pytest.raises(tfdist.CompressionError, match="TFDIST_COMPRESSION='zip' is not a compression"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD())


@pytest.mark.parametrize("kwargs, message", [
    ({"rank": 0}, r"rank to be an int >= 1 \(e.g. 4\); received rank=0"),
    ({"rank": 2.0}, r"received rank=2.0"),
    ({"start_step": -1}, r"start_step to be an int >= 0 .*received start_step=-1"),
    ({"min_compression_rate": -1}, r"min_compression_rate to be a number >= 0 .*received min_compression_rate=-1"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(tfdist.CompressionError, match=message):
        Compression.powersgd(**kwargs)


def test_accumulation_and_sharded_state_are_refused_by_name():
    with pytest.raises(tfdist.CompressionError, match="does not work with gradient accumulation yet"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD(), 2, compression=powersgd())
    with pytest.raises(tfdist.CompressionError, match="does not work with shard_optimizer_state=True yet"):
        tfdist.DistributedOptimizer(keras.optimizers.SGD(), compression=powersgd(), shard_optimizer_state=True)


# tfdist.horovod (one process here: the same PowerSGD.reduce over a process group of size 1) ----------------

@pytest.fixture
def single_hvd():
    import tfdist.horovod as hvd

    hvd.init()
    yield hvd
    hvd.shutdown()


def test_horovod_distributed_optimizer_keeps_the_state_and_spans_exactly_at_full_rank(single_hvd):
    hvd = single_hvd
    data = classification_data(256)

    def small():
        keras.utils.set_random_seed(5)
        return keras.Sequential([keras.Input((24,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(4)])

    def fit(optimizer):
        model = small()
        model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(*data, batch_size=32, epochs=1, verbose=0, shuffle=False)
        return model

    exact = fit(keras.optimizers.SGD(0.1))
    full = fit(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvd.Compression.powersgd(
        rank=6, start_step=0, min_compression_rate=0)))
    for got, want in zip(full.get_weights(), exact.get_weights()):
        np.testing.assert_allclose(got, want, atol=2e-5)
    low = fit(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=powersgd(rank=1)))
    states = low.optimizer._tfdist_powersgd
    assert len(states) == 2 and all(np.abs(e.numpy()).max() > 0 for e, _ in states.values())
    assert not all(np.allclose(a, b, atol=1e-3) for a, b in zip(low.get_weights(), exact.get_weights()))


def test_horovod_refuses_what_it_cannot_keep_state_for(single_hvd):
    hvd = single_hvd
    with pytest.raises(tfdist.CompressionError, match="hvd.DistributedGradientTape does not take Compression.powersgd"):
        hvd.DistributedGradientTape(tf.GradientTape(), compression=powersgd())
    with pytest.raises(tfdist.CompressionError, match="does not work with gradient accumulation yet"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), compression=powersgd(), backward_passes_per_step=2)


def test_under_a_loss_scale_optimizer_the_state_stays_finite_and_replicas_equal(strategy_of):
    """The finite check reads the compressed sums (tfdist's bucket path), gradients unscaled on the lossy wire."""
    strategy = strategy_of(2)
    x, y = classification_data(256)
    with strategy.scope():
        model = mlp()
        inner = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=powersgd(rank=2))
        model.compile(keras.optimizers.LossScaleOptimizer(inner, initial_scale=2.0 ** 15),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
    assert int(inner.iterations.numpy()) == 4
    assert_bit_equal_everywhere(strategy, model.weights)
    for error, q in inner._tfdist_powersgd.values():
        assert all(np.isfinite(c).all() and np.abs(c).max() > 0 for c in copies(strategy, error))
        assert all(np.isfinite(c).all() for c in copies(strategy, q))


@pytest.mark.parametrize("wrap", ["loss_scale", "clipping"])
def test_weights_that_all_compress_are_reduced_on_every_replica_under_a_loss_scale_or_clipping(strategy_of, wrap):
    """No weight travels exact (a model with no bias): PowerSGD's collectives are the step's only ones, launched in
    each replica's own thread with no merge_call between them. A LossScaleOptimizer's finite check and clipping mark
    the gradients reduced (``gradient_buckets._reduced``) before Keras' update, whose merge_call holds replica 0 with
    its mark on while replica 1 traces: replica 1 took replica 0's mark for its own, reduced nothing, and the step
    hung in P's all-reduce (replica 0's alone). Every replica launches the same collectives; the warm-up step sums
    the replicas' gradients and the compressed one leaves every replica's weights bit-equal."""
    strategy = strategy_of(2)
    rng = np.random.RandomState(3)
    kernels = rng.randn(2, 2, 8, 7).astype("float32")
    with strategy.scope():
        kernel = keras.Variable(np.zeros((8, 7), "float32"), name="kernel")
        inner = tfdist.DistributedOptimizer(keras.optimizers.SGD(1.0, global_clipnorm=1e3 if wrap == "clipping" else None),
                                            compression=powersgd(rank=1, start_step=1))
        optimizer = keras.optimizers.LossScaleOptimizer(inner, initial_scale=1.0) if wrap == "loss_scale" else inner
        optimizer.build([kernel])
    step = step_function(strategy, optimizer, [kernel], [kernels])
    counts = collectives_by_device(step)
    assert counts.get("CPU:0", 0) >= 3 and counts.get("CPU:1") == counts["CPU:0"], counts  # warm-up 1, P and Q
    step()
    for copy in copies(strategy, kernel):
        np.testing.assert_allclose(copy, -kernels[0].sum(axis=0), atol=1e-5)
    step()
    assert int(inner.iterations.numpy()) == 2
    assert_bit_equal_everywhere(strategy, [kernel])


@pytest.mark.parametrize("start_step", [10 ** 6, 0])
def test_clipping_in_fit_clips_the_gradient_summed_over_every_replica_as_one_device(strategy_of, start_step):
    """Clipping acts on the all-reduced gradient (``gradient_buckets._reduce_then_clip``); under PowerSGD in fit the
    rest and the example count ride in P's all-reduce, launched in the replica's thread: replica 1 took replica 0's
    "reduced" mark for its own and reduced nothing (the train step refused: the count never rode). Uneven batches
    (the last splits 1/0) with sample weights: the warm-up trains as one device, full rank as one device too (float
    tolerance), every replica bit-equal."""
    def make():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
        return model

    x, y = common.uneven_data(49)
    y = np.concatenate([y, 2 * y, -y], axis=1)
    weights = np.random.default_rng(5).uniform(0.1, 2.0, size=49).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(4)

    def fit(model, optimizer):
        model.compile(optimizer, keras.losses.MeanSquaredError())
        return model.fit(dataset, epochs=2, verbose=0).history["loss"]

    one = make()
    want = fit(one, keras.optimizers.SGD(0.1, global_clipnorm=0.3))
    strategy = strategy_of(2)
    with strategy.scope():
        two = make()
        got = fit(two, tfdist.DistributedOptimizer(keras.optimizers.SGD(0.1, global_clipnorm=0.3),
                                                   compression=powersgd(rank=8, start_step=start_step)))
    assert len(two.optimizer._tfdist_powersgd) == 2
    tolerance = 1e-6 if start_step else 2e-5
    for a, b in zip(two.get_weights(), one.get_weights()):
        np.testing.assert_allclose(a, b, atol=tolerance)
    np.testing.assert_allclose(got, want, rtol=1e-5 if start_step else 1e-4)
    assert_bit_equal_everywhere(strategy, two.weights)


@pytest.mark.parametrize("case", ["steps_per_execution", "loss_scale_no_bias", "multi_optimizer"])
def test_the_warm_up_in_fit_trains_as_one_device_with_sample_weights_and_a_replica_without_examples(strategy_of, case):
    """Before ``start_step`` every gradient and the example count travel in one all-reduce, divided by the count after
    as exact's buckets divide: one device's weights (1e-6) and logged loss, over batches of 4 of 49 examples (the last
    splits 1/0) with sample weights, with 3 steps an execution, under a LossScaleOptimizer on a model with no bias (the
    count does not ride there), and as one optimizer of a MultiOptimizer."""
    x, y = common.uneven_data(49)
    y = np.concatenate([y, 2 * y, -y], axis=1)
    weights = np.random.default_rng(5).uniform(0.1, 2.0, size=49).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(4)
    bias = case != "loss_scale_no_bias"

    def fit(wrap):
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh", use_bias=bias),
                                  keras.layers.Dense(3, use_bias=bias, name="head")])
        if case == "multi_optimizer":
            optimizer = keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
                keras.optimizers.SGD(0.05), {".*head.*": wrap(keras.optimizers.SGD(0.02))}))
        elif case == "loss_scale_no_bias":
            optimizer = keras.optimizers.LossScaleOptimizer(wrap(keras.optimizers.SGD(0.05)))
        else:
            optimizer = wrap(keras.optimizers.Adam(0.01))
        model.compile(optimizer, keras.losses.MeanSquaredError(),
                      steps_per_execution=3 if case == "steps_per_execution" else 1)
        return model, model.fit(dataset, epochs=2, verbose=0).history["loss"]

    one, want = fit(lambda optimizer: optimizer)
    strategy = strategy_of(2)
    with strategy.scope():
        two, got = fit(lambda optimizer: tfdist.DistributedOptimizer(optimizer, compression=powersgd(
            rank=1, start_step=10 ** 6)))
    assert sum(len(getattr(o, "_tfdist_powersgd", {})) for o in [two.optimizer, *getattr(
        two.optimizer, "optimizers", []), getattr(two.optimizer, "inner_optimizer", None)]) >= 1
    for a, b in zip(two.get_weights(), one.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_bit_equal_everywhere(strategy, two.weights)


@pytest.mark.parametrize("bias", [True, False])
def test_every_compressed_fit_step_writes_its_times_for_the_straggler_report(strategy_of, bias):
    """tfdist.step_clock's row of each step (the straggler report, the timeline): a compressed step times P's
    all-reduce with the rest riding in it as one bucket; a model with no bias (nothing rides) wrote no row at all."""
    from tfdist import step_clock

    strategy = strategy_of(2)
    x, y = classification_data(256)
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((24,)), keras.layers.Dense(16, activation="relu", use_bias=bias),
                                  keras.layers.Dense(4, use_bias=bias)])
        model.compile(tfdist.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=powersgd(rank=2, start_step=2)),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    first = step_clock.count()
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    rows = step_clock.rows(first)
    assert len(rows) == 4  # 2 warm-up steps, 2 compressed
    for column in ("data", "grads", "reduced"):
        assert np.isfinite(rows[:, step_clock.INDEX[column]]).all(), column


@pytest.mark.parametrize("overflowing", ["bias", "kernel"])
def test_a_step_skipped_for_an_overflow_on_one_replica_keeps_the_state_on_every_replica(strategy_of, overflowing):
    """LossScaleOptimizer skips a step whose reduced gradients are not all finite; an inf in ONE replica's gradient of
    an exact-travelling bias, or of a compressed kernel, leaves the error feedback, Q and weights as they were."""
    strategy = strategy_of(2)
    rng = np.random.RandomState(3)
    kernels, biases = rng.randn(2, 2, 8, 7).astype("float32"), rng.randn(2, 2, 7).astype("float32")
    (biases if overflowing == "bias" else kernels)[1, 1, 0] = np.inf  # step 2, replica 1 only
    with strategy.scope():
        kernel = keras.Variable(np.zeros((8, 7), "float32"), name="kernel")
        bias = keras.Variable(np.zeros(7, "float32"), name="bias")
        inner = tfdist.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=powersgd(rank=1))
        optimizer = keras.optimizers.LossScaleOptimizer(inner, initial_scale=1.0)
        optimizer.build([kernel, bias])
    (error, q), = inner._tfdist_powersgd.values()

    def state():
        return copies(strategy, error) + copies(strategy, q) + [kernel.numpy()]

    apply_steps(strategy, optimizer, [kernel, bias], [kernels[:1], biases[:1]], 1)
    before = state()
    apply_steps(strategy, optimizer, [kernel, bias], [kernels[1:], biases[1:]], 1)
    assert int(inner.iterations.numpy()) == 1 and float(optimizer.dynamic_scale.numpy()) == 0.5
    for got, want in zip(state(), before):
        np.testing.assert_array_equal(got, want)
    assert_bit_equal_everywhere(strategy, [q, kernel, bias])


def test_under_mixed_float16_an_overflow_in_one_replicas_forward_pass_skips_the_step_everywhere(
        strategy_of, restore_dtype_policy):
    strategy = strategy_of(2)
    x, y = classification_data(256)
    x[64 + 40, 0] = 1e6  # the second batch, replica 1's half: inf in float16
    keras.config.set_dtype_policy("mixed_float16")
    with strategy.scope():
        model = mlp()
        inner = tfdist.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=powersgd(rank=2))
        model.compile(keras.optimizers.LossScaleOptimizer(inner), keras.losses.SparseCategoricalCrossentropy(True))
    states = []
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda *_, **__: states.append(
        [c for e, q in inner._tfdist_powersgd.values() for c in copies(strategy, e) + copies(strategy, q)]))
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False, callbacks=[record])
    assert int(inner.iterations.numpy()) == 3  # one of four steps skipped
    for got, want in zip(states[1], states[0]):
        np.testing.assert_array_equal(got, want)
    assert all(np.isfinite(c).all() for c in states[-1])
    assert_bit_equal_everywhere(strategy, model.weights + [q for _, q in inner._tfdist_powersgd.values()])


def test_the_benchmark_counts_the_bytes_each_setup_sends():
    """benchmarks/powersgd.py on the weak-scaling CNN: r * (2n + m) numbers for a kernel PowerSGD compresses (fit's
    gradients are sums: P's product with the gradient and with the error feedback travel apart), its size for any
    other weight, one number for the example count; rank 4 about 14x fewer bytes than exact (issue 52)."""
    from benchmarks import powersgd as bench

    shapes = bench.weight_shapes()  # conv [27, 32] and [288, 64], dense [2304, 128] and [128, 10], 4 biases
    size = sum(int(np.prod(s)) for s in shapes)
    assert bench.bytes_per_step(shapes, "exact") == 4 * size == 1_262_888
    assert bench.bytes_per_step(shapes, "fp16") == 2 * size
    biases = 32 + 64 + 128 + 10
    r4 = 4 * (2 * 27 + 32 + 2 * 288 + 64 + 2 * 2304 + 128 + 2 * 128 + 10)
    assert bench.bytes_per_step(shapes, "powersgd r4") == 4 * (r4 + biases + 1)
    # rank 8 gains too little on the first conv (8 * 59 * 2 >= 864) and the last dense kernel: they travel whole
    assert bench.bytes_per_step(shapes, "powersgd r8") == 4 * (
        864 + 8 * (2 * 288 + 64 + 2 * 2304 + 128) + 1280 + biases + 1)
    assert [bench.compressed_count(shapes, r) for r in (1, 2, 4, 8)] == [4, 4, 4, 2]
    assert 13 < bench.bytes_per_step(shapes, "exact") / bench.bytes_per_step(shapes, "powersgd r4") < 14
