"""tfdist.horovod in one process (size 1, as in plain ``python``), its bad inputs, and ``tfdist run --horovod``."""

import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist.horovod as hvd
from tests.jobs import REPO, job_env
from tests.workers import common
from tfdist.horovod import basics, callbacks

FAST_SECONDS = 10


@pytest.fixture
def single():
    """tfdist.horovod initialised in this (single-process) test session; left uninitialised after."""
    hvd.init()
    yield
    hvd.shutdown()


def fit_equivalence(optimizer):
    model = common.equivalence_model()
    model.compile(optimizer=optimizer, loss="mse", experimental_run_tf_function=False)
    x, y = common.regression_data()
    model.fit(x, y, batch_size=common.GLOBAL_BATCH, shuffle=False, verbose=0)
    return model


# Size 1 ------------------------------------------------------------------------------------------

def test_one_process_is_a_job_of_size_one(single):
    assert (hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank(), hvd.cross_size(), hvd.cross_rank()) == \
        (1, 0, 1, 0, 1, 0)
    assert hvd.is_initialized() and hvd.is_homogeneous()
    assert hvd.allreduce(tf.constant([2.0, 3.0])).numpy().tolist() == [2.0, 3.0]
    scaled = hvd.allreduce(tf.constant([2.0]), op=hvd.Sum, prescale_factor=2, postscale_factor=3)
    assert scaled.numpy().tolist() == [12.0]
    assert hvd.allgather(tf.constant([[1, 2]])).numpy().tolist() == [[1, 2]]
    assert hvd.broadcast_object({"a": [1]}, root_rank=0) == {"a": [1]}
    assert hvd.allgather_object(7) == [7]
    assert int(hvd.join().numpy()) == 0


def test_distributed_optimizer_alone_trains_like_its_optimizer(single):
    plain = fit_equivalence(keras.optimizers.SGD(0.05))
    wrapped = fit_equivalence(hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)))
    assert type(wrapped.optimizer).__name__ == "SGD" and isinstance(wrapped.optimizer, keras.optimizers.SGD)
    for a, b in zip(plain.get_weights(), wrapped.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-7)
    reference = common.train_equivalence()
    for a, b in zip(reference, wrapped.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("loss, weighs", [("mse", True), (keras.losses.MeanSquaredError(reduction="sum"), False),
                                           (keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"), False)])
def test_examples_weigh_the_ranks_only_when_every_loss_term_is_a_mean_over_examples(single, monkeypatch, loss, weighs):
    """A DistributedOptimizer in fit weighs each rank by its examples (batch_shares.examples_to_weigh); a sum or a
    mean over sample weights is no mean over the examples, so the step keeps Horovod's average (issue 49)."""
    from tfdist.keras_fixes import batch_shares

    seen = []
    original = batch_shares.examples_to_weigh
    monkeypatch.setattr(batch_shares, "examples_to_weigh", lambda: seen.append(original()) or seen[-1])
    model = common.equivalence_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss=loss)
    x, y = common.regression_data()
    model.fit(x, y, sample_weight=np.ones(len(x), "float32"), batch_size=common.GLOBAL_BATCH, verbose=0)
    assert seen and all((examples is not None) == weighs for examples in seen)


def test_backward_passes_are_summed_unless_averaged_as_horovod_does(single):
    """Horovod adds up the k micro-batch gradients by default (average_aggregated_gradients=False)."""
    def weights(**options):
        model = common.equivalence_model()
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), **options), loss="mse")
        x, y = common.regression_data()
        model.fit(x, y, batch_size=common.GLOBAL_BATCH // 2, shuffle=False, verbose=0)
        return model.get_weights()

    averaged = weights(backward_passes_per_step=2, average_aggregated_gradients=True)
    for a, b in zip(averaged, common.train_equivalence()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    summed = weights(backward_passes_per_step=2)
    model = common.equivalence_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")  # the sum of 2 is twice the mean
    x, y = common.regression_data()
    model.fit(x, y, batch_size=common.GLOBAL_BATCH, shuffle=False, verbose=0)
    for a, b in zip(summed, model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_distributed_gradient_tape_keeps_the_tape_class_and_gradients(single):
    """At size 1 the tape's gradients are the plain ones (fp16 on the wire: tests/test_horovod_multi_worker.py)."""
    variable = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(variable ** 2)
    wrapped = hvd.DistributedGradientTape(tape)
    assert isinstance(wrapped, tf.GradientTape)
    assert wrapped.gradient(loss, [variable])[0].numpy().tolist() == [2.0, 4.0]


def test_load_model_wraps_the_optimizer_and_keeps_its_state(single, tmp_path):
    model = fit_equivalence(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)))
    model.save(tmp_path / "model.keras")
    loaded = hvd.load_model(tmp_path / "model.keras", compression=hvd.Compression.fp16)
    assert loaded.optimizer._tfdist_reduction.compression is hvd.Compression.fp16
    assert type(loaded.optimizer).__name__ == "Adam"
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_horovod_keras_idioms_that_keras_3_dropped(single):
    optimizer = tf.optimizers.Adam(0.5)
    assert optimizer.variables() == optimizer.variables  # Horovod's examples call it
    tf.keras.backend.set_value(optimizer.lr, 0.25)  # Horovod's elastic examples
    assert float(optimizer.learning_rate.numpy()) == 0.25
    model = keras.Sequential([keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse", experimental_run_tf_function=False)  # accepted, ignored


def test_elastic_run_restores_the_last_commit_of_an_earlier_attempt(single, tmp_path, monkeypatch):
    monkeypatch.setenv("TFDIST_JOB_DIR", str(tmp_path))  # as tfdist run sets it, kept across restarts
    variable = tf.Variable([1.0, 2.0])
    state = hvd.elastic.TensorFlowState([variable], epoch=0, batch=0)
    variable.assign([5.0, 6.0])
    state.epoch, state.batch = 3, 7
    state.commit()
    variable.assign([9.0, 9.0])  # progress after the commit, lost when the worker dies

    restarted_variable = tf.Variable([0.0, 0.0])  # the restarted script builds the same state again
    restarted = hvd.elastic.TensorFlowState([restarted_variable], epoch=0, batch=0)
    restarted._number = state._number
    resets = []
    restarted.register_reset_callbacks([lambda: resets.append("reset")])

    @hvd.elastic.run
    def train(s):
        return s.epoch, s.batch, restarted_variable.numpy().tolist()

    assert train(restarted) == (3, 7, [5.0, 6.0])
    assert resets == ["reset"]


# Callbacks: Horovod's numbers ------------------------------------------------------------------------

class _LearningRates(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.rates = getattr(self, "rates", []) + [float(self.model.optimizer.learning_rate.numpy())]


def rates_during_fit(callback, epochs=3, steps=4, optimizer=None):
    model = common.equivalence_model()
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1), loss="mse")
    x, y = common.regression_data(steps * 4)
    recorder = _LearningRates()
    history = model.fit(x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0, callbacks=[callback, recorder])
    return recorder.rates, history


def test_warmup_sets_each_batch_as_of_its_end_and_counts_processes(single, monkeypatch):
    monkeypatch.setattr(basics, "size", lambda: 4)
    rates, history = rates_during_fit(callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2), epochs=3)
    want = [0.4 / 4 * ((e + (b + 1) / 4) * 3 / 2 + 1) for e in range(2) for b in range(4)] + [0.4] * 4
    np.testing.assert_allclose(rates, want, rtol=1e-6)
    np.testing.assert_allclose(history.history["lr"], [want[3], 0.4, 0.4], rtol=1e-6)  # Horovod logs lr


def test_a_constant_schedule_multiplier_decays_exponentially_as_in_horovod(single):
    schedule = callbacks.LearningRateScheduleCallback(0.4, multiplier=0.5, start_epoch=1)
    rates, _ = rates_during_fit(schedule, epochs=3, steps=1)
    np.testing.assert_allclose(rates, [0.1, 0.4, 0.2], rtol=1e-6)  # epoch 0 untouched (SGD(0.1)), then 0.4 * 0.5**(e-1)


def test_momentum_correction_scales_the_velocity_with_the_rate(single):
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    model = common.equivalence_model()
    model.compile(optimizer=optimizer, loss="mse")
    optimizer.build(model.trainable_variables)
    for buffer in optimizer.momentums:
        buffer.assign(tf.ones_like(buffer))
    callback = callbacks.LearningRateScheduleCallback(0.1, multiplier=lambda epoch: 0.5)  # 0.1 -> 0.05
    callback.set_model(model)
    callback.on_epoch_begin(0)
    assert all(np.allclose(buffer.numpy(), 0.5) for buffer in optimizer.momentums)
    no_correction = callbacks.LearningRateScheduleCallback(0.1, multiplier=lambda epoch: 1.0, momentum_correction=False)
    no_correction.set_model(model)
    no_correction.on_epoch_begin(0)
    assert all(np.allclose(buffer.numpy(), 0.5) for buffer in optimizer.momentums)


# Bad inputs: a clear error, fast --------------------------------------------------------------------

class _NotAnOptimizer:
    pass


BAD_INPUTS = [
    ("size before init", lambda: (hvd.shutdown(), hvd.size()), ValueError,
     r"tfdist.horovod has not been initialized: call hvd.init\(\) before hvd.size\(\)\."),
    ("allreduce before init", lambda: (hvd.shutdown(), hvd.allreduce(1.0)), ValueError,
     r"call hvd.init\(\) before hvd.allreduce\(\)"),
    ("adasum optimizer", lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Adasum), ValueError,
     r"op=hvd.Adasum is not supported: tfdist.horovod reduces with TensorFlow's collectives, which have no Adasum\. "
     r"Use op=hvd.Average"),
    ("adasum allreduce", lambda: hvd.allreduce(1.0, op=hvd.Adasum), ValueError, r"op=hvd.Adasum is not supported"),
    ("adasum tape", lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Adasum), ValueError,
     r"op=hvd.Adasum is not supported"),
    ("unknown process set", lambda: hvd.allreduce(1.0, process_set=hvd.ProcessSet([0])), ValueError,
     r"Process set \[0\] has not been registered: pass it to hvd.init\(process_sets=\[...\]\) or "
     r"hvd.add_process_set\(...\) on every rank first\."),
    ("process set of absent ranks", lambda: hvd.add_process_set([0, 3]), ValueError,
     r"Process set \[0, 3\] names rank\(s\) \[3\] that this job of 1 process\(es\) does not have"),
    ("duplicate process set", lambda: hvd.add_process_set([0]), ValueError,
     r"Attempted to add a duplicate process set: ranks \[0\] are already registered"),
    ("process set of a communicator", lambda: hvd.ProcessSet("MPI.COMM_WORLD"), ValueError,
     r"ProcessSet takes a list of ranks \(tfdist has no MPI communicators\); received 'MPI.COMM_WORLD'"),
    ("init with a subset", lambda: hvd.init(comm=[1]), ValueError,
     r"hvd.init\(comm=...\) takes None or the list of all 1 rank\(s\); received comm=\[1\]"),
    ("unknown op", lambda: hvd.allreduce(1.0, op="median"), ValueError,
     r"Unknown op='median'; use one of \['hvd.Average', 'hvd.Sum', 'hvd.Min', 'hvd.Max', 'hvd.Product'\]"),
    ("op and average", lambda: hvd.allreduce(1.0, op=hvd.Sum, average=True), ValueError,
     r"Pass op= or the deprecated average=, not both"),
    ("optimizer op", lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Max), ValueError,
     r"Unknown op='max'; use one of \['hvd.Average', 'hvd.Sum'\]"),
    ("predivide with sum", lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Sum,
                                                             gradient_predivide_factor=2.0), ValueError,
     r"gradient_predivide_factor=2.0 needs op=hvd.Average"),
    ("backward passes", lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0),
     ValueError, r"backward_passes_per_step must be an int >= 1; received backward_passes_per_step=0"),
    ("tf1 optimizer", lambda: hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1)), TypeError,
     r"wraps Keras optimizers; received the TF1 optimizer GradientDescentOptimizer"),
    ("not an optimizer", lambda: hvd.DistributedOptimizer(_NotAnOptimizer()), TypeError,
     r"DistributedOptimizer wraps a Keras optimizer; received _NotAnOptimizer"),
    ("compression", lambda: hvd.allreduce(1.0, compression="fp16"), TypeError,
     r"compression must be Compression.none, Compression.fp16 or an object with compress"),
    ("broadcast root", lambda: hvd.broadcast(tf.constant(1.0), root_rank=1), ValueError,
     r"root_rank=1 is not among the ranks taking part, \[0\]; pass one of them"),
    ("alltoall splits", lambda: hvd.alltoall(tf.range(4), splits=[3]), ValueError,
     r"alltoall splits must give one row count per rank \(1\) adding up to the first dimension \(4\); "
     r"received splits=\[3\]"),
    ("reducescatter scalar", lambda: hvd.reducescatter(tf.constant(1.0)), ValueError,
     r"reducescatter splits the first dimension, so it needs a tensor of rank >= 1"),
    ("global variables", lambda: hvd.broadcast_global_variables(0), RuntimeError,
     r"hvd.broadcast_global_variables\(\) needs TF1 graph mode .* use hvd.broadcast_variables\(model.variables"),
    ("run on other hosts", lambda: hvd.run(print, np=2, hosts="a:2,b:2"), ValueError,
     r"hvd.run\(hosts='a:2,b:2'\) names 'a', but hvd.run starts workers on this machine only; on several "
     r"machines start 'tfdist run --nnodes N --node-rank K --master ADDR:PORT -n P -- python train.py' on each"),
    ("run elastic sizes", lambda: hvd.run(print, np=2, min_np=1), ValueError,
     r"hvd.run\(min_num_proc=1\) cannot be honoured: hvd.run starts workers on this machine only; for a job whose "
     r"nodes come and go start 'tfdist run --nnodes MIN:MAX --master ADDR:PORT -n P' on each node, with "
     r"hvd.elastic.run"),
    ("run host discovery", lambda: hvd.run(print, np=2, host_discovery_script="./discover.sh"), ValueError,
     r"hvd.run\(host_discovery_script='./discover.sh'\) cannot be honoured: no script is polled for hosts: a host "
     r"joins when 'tfdist run --nnodes MIN:MAX --master ADDR:PORT -n P' starts on it"),
    ("run a lambda", lambda: hvd.run(lambda: 1, np=1), ValueError,
     r"hvd.run sends func and its arguments to the workers with pickle, which failed .* define func at module "
     r"level"),
    ("keras state of an unbuilt model", lambda: hvd.elastic.KerasState(keras.Sequential([keras.layers.Dense(1)])),
     ValueError, r"TensorFlowKerasState needs a built model: call model.build\(input_shape\)"),
    ("commit frequency", lambda: hvd.elastic.CommitStateCallback(hvd.elastic.ObjectState(epoch=0), 0), ValueError,
     r"batches_per_commit must be an int >= 1; received 0"),
]


@pytest.mark.parametrize("name, call, error, message", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_a_clear_error_fast(single, name, call, error, message):
    start = time.perf_counter()
    with pytest.raises(error, match=message):
        call()
    assert time.perf_counter() - start < FAST_SECONDS


# tfdist run --horovod --------------------------------------------------------------------------------

def launch(*args, extra_path=None):
    env = job_env()
    if extra_path:
        env["PYTHONPATH"] = f"{extra_path}:{env['PYTHONPATH']}"
    return subprocess.run([sys.executable, "-m", "tfdist.run", "--timeout", "120", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=150)


@pytest.fixture
def installed_horovod(tmp_path):
    """A stand-in for a real Horovod install: a 'horovod' package that says who it is."""
    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "__init__.py").write_text("WHO = 'the installed horovod'\n")
    return tmp_path


def test_without_the_flag_an_installed_horovod_is_never_shadowed(installed_horovod):
    result = launch("-n", "1", "--", sys.executable, "-c", "import horovod; print(horovod.WHO)",
                    extra_path=installed_horovod)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[0] the installed horovod" in result.stdout


def test_with_the_flag_horovod_imports_give_tfdist_horovod_in_one_worker(installed_horovod):
    code = ("import horovod, horovod.tensorflow as tfh, horovod.tensorflow.keras as hvd; "
            "from horovod.tensorflow.keras import callbacks; from horovod.tensorflow.compression import Compression; "
            "hvd.init(); print(hvd.__name__, tfh is hvd, horovod.run is hvd.run, callbacks.__name__, hvd.size())")
    result = launch("-n", "1", "--horovod", "--", sys.executable, "-c", code, extra_path=installed_horovod)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[0] tfdist.horovod True True tfdist.horovod.callbacks 1" in result.stdout


def test_horovod_flag_needs_the_start_up_hook():
    result = launch("-n", "1", "--horovod", "--no-fixes", "--", sys.executable, "-c", "pass")
    assert result.returncode == 2
    assert "--horovod works through tfdist's start-up hook, which --no-fixes turns off; drop one of them." in \
        result.stderr


def test_a_tape_loop_after_evaluate_trains(single):
    """evaluate's steps note their start for the step clock and all-reduce no gradients: nothing of theirs may reach
    the tape loop's step traced next (it failed: a tensor of the test function's graph 'is out of scope')."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile("sgd", "mse")
    x, y = np.ones((16, 4), "float32"), np.zeros((16, 3), "float32")
    before = model.evaluate(x, y, verbose=0)
    step = common.tape_step(hvd, model, keras.optimizers.SGD(0.1), x, y)
    losses = [float(step()) for _ in range(3)]
    assert losses[0] == pytest.approx(before) and losses[2] < losses[0]
