"""Keras' own distribution API (``keras.distribution``) on TensorFlow, through tfdist's strategy.

In one process over 2 of conftest's 4 logical CPUs: ``set_distribution``, ``scope()``, a mesh over
other devices and a ModelParallel that only replicates all train on 2 replicas with one device's
weights; layouts tfdist cannot honour are errors naming the variable. Then the guide's script,
unchanged and never importing tfdist, under ``tfdist run -n 2`` (the one real job here).
"""

import contextlib
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.distribution import DataParallel, DeviceMesh, LayoutMap, ModelParallel
from keras.src.backend.tensorflow import distribution_lib as tf_distribution_lib

from tfdist import cluster as cluster_lib
from tfdist.errors import DistributionError
from tfdist.keras_fixes import distribution, distribution_cluster
from tests.jobs import run_job
from tests.workers import keras_distribution_guide as guide

TWO = ["cpu:0", "cpu:1"]
GUIDE_STEPS = 2 * guide.STEPS  # 2 epochs


@pytest.fixture(scope="module")
def one_device():
    """The guide's model trained on one device at the global batch: the weights to match."""
    model = guide.make_model()
    model.fit(guide.make_dataset(), epochs=2, verbose=0)
    return model.get_weights()


@pytest.fixture
def fresh_distribution(fresh_tfdist_strategy):
    yield
    keras.distribution.set_distribution(None)


def model_parallel(layout, shape=(1, 2), key="dense/kernel"):
    mesh = DeviceMesh(shape, ("batch", "model"), devices=TWO)
    layout_map = LayoutMap(mesh)
    layout_map[key] = layout
    return ModelParallel(layout_map=layout_map)


FORMS = {  # form -> (a context in which models are built and trained, the devices it should use)
    "set_distribution": (lambda: contextlib.nullcontext(keras.distribution.set_distribution(DataParallel(devices=TWO))),
                         ["CPU:0", "CPU:1"]),
    "scope over a mesh of 2 other devices": (
        lambda: DataParallel(device_mesh=DeviceMesh((2,), ("data",), devices=["cpu:2", "cpu:3"])).scope(),
        ["CPU:2", "CPU:3"]),
    "ModelParallel that only replicates": (lambda: model_parallel((None, "model"), shape=(2, 1)).scope(),
                                           ["CPU:0", "CPU:1"]),
}


@pytest.mark.parametrize("form", FORMS)
def test_models_built_under_a_distribution_train_on_its_devices_like_one_device(form, one_device, fresh_distribution):
    enter, devices = FORMS[form]
    guide.batch_sizes_seen.clear()
    with enter():
        model = guide.make_model()
        model.fit(guide.make_dataset(), epochs=2, verbose=0)
    assert model.distribute_strategy.num_replicas_in_sync == 2
    kernel = model.get_layer("dense").kernel.value
    assert [v.device.rsplit("device:", 1)[1] for v in kernel.values] == devices
    assert guide.batch_sizes_seen == [guide.GLOBAL_BATCH // 2] * (2 * GUIDE_STEPS)  # every batch, both halves
    for got, want in zip(model.get_weights(), one_device):
        np.testing.assert_allclose(got, want, atol=1e-6)
    assert tf.distribute.has_strategy() == (form == "set_distribution")


def test_a_kernel_sharded_over_two_devices_is_an_error_naming_it(fresh_distribution):
    with model_parallel((None, "model")).scope():
        with pytest.raises(DistributionError, match=(
                r"tfdist cannot shard variable 'dense/kernel' on TensorFlow: its layout \(None, 'model'\) splits "
                r"dimension 1 over mesh axis 'model' \(2 devices\)\. tfdist keeps a full copy of every variable on "
                r"every device \(data parallelism\)\. Fix: give it a replicated layout \(every axis None\) or leave "
                r"it out of the LayoutMap, use keras.distribution.DataParallel, or shard models on the JAX backend")):
            guide.make_model()
    assert not tf.distribute.has_strategy()  # the scope ended: the strategy before it is back


def test_a_layer_output_split_beyond_the_batch_is_an_error_naming_it(fresh_distribution):
    with model_parallel((None, "model"), key="dense/output").scope():
        with pytest.raises(DistributionError, match=(
                r"tfdist cannot lay out 'dense/output' as \(None, 'model'\) on TensorFlow: it splits dimension 1 "
                r"over mesh axis 'model' \(2 devices\); only a layer output's first dimension may be split, over "
                r"'batch'\. Leave 'dense/output' out of the LayoutMap")):
            guide.make_model()


def test_set_distribution_inside_another_strategys_scope_is_an_error(fresh_distribution):
    with tf.distribute.MirroredStrategy(["CPU:2", "CPU:3"]).scope():
        with pytest.raises(DistributionError, match=(
                r"keras.distribution.set_distribution\(<DataParallel device_mesh=<DeviceMesh shape=\(2,\), "
                r"axis_names=\['batch'\]>>\) inside `with strategy.scope\(\):` .*: set the distribution outside")):
            keras.distribution.set_distribution(DataParallel(devices=TWO))
    assert keras.distribution.distribution() is None


def test_a_distribution_tfdist_does_not_train_through_is_set_as_keras_sets_it(fresh_distribution):
    """keras/src/distribution/distribution_lib_test.py::DistributionTest::test_scope enters scopes of Keras' base
    Distribution over a mesh of 8 CPUs that need not exist: Keras only sets and restores it, and so does tfdist,
    which builds its strategy for DataParallel and ModelParallel (it failed: "Device 'cpu:1' ... is not visible")."""
    from keras.src.distribution import distribution_lib

    mesh = DeviceMesh((4, 2), ("batch", "model"), [f"cpu:{i}" for i in range(8)])
    outer, inner = distribution_lib.Distribution(mesh), distribution_lib.Distribution(mesh)
    with outer.scope():
        with inner.scope():
            assert keras.distribution.distribution() is inner
        assert keras.distribution.distribution() is outer and not tf.distribute.has_strategy()
    assert keras.distribution.distribution() is None


class Batches(keras.utils.PyDataset):
    def __init__(self, x):
        super().__init__()
        self.x = x

    def __len__(self):
        return 1

    def __getitem__(self, index):
        return (self.x,)


def test_keras_calls_every_internal_tfdist_replaces_for_it(fresh_distribution):
    """Canary (as tests/test_canaries.py for the other fixes): a user's flow reaches every replacement."""
    replaced = [r for p in (distribution.patch, distribution_cluster.patch) for r in p.replacements if r.function]
    for replacement in replaced:
        replacement.calls = 0
    keras.distribution.list_devices()
    with model_parallel((None, "model"), shape=(2, 1)).scope():
        guide.make_model()
    keras.distribution.set_distribution(DataParallel(devices=TWO))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    x = np.zeros((4, 2), "float32")

    def generator():
        while True:
            yield (x,)

    for data in (x, tf.data.Dataset.from_tensor_slices(x).batch(4), generator(), Batches(x)):
        model.predict(data, steps=1, verbose=0)
    assert [f"{getattr(r.owner, '__name__', r.owner)}.{r.attribute}" for r in replaced if r.calls == 0] == []


def test_one_process_answers_as_jax_does_for_one_process():
    assert keras.distribution.list_devices() == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert keras.distribution.get_device_count("cpu") == 4
    assert (tf_distribution_lib.num_processes(), tf_distribution_lib.process_id()) == (1, 0)
    keras.distribution.initialize()  # nothing to join


@pytest.mark.parametrize("launcher", [
    {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3"},  # mpirun
    {"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_STEP_NODELIST": "node[1-3]", "SLURM_STEP_TASKS_PER_NODE": "1(x3)"},
], ids=["mpirun", "srun"])
def test_num_processes_and_process_id_come_from_the_launcher(launcher, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    assert (tf_distribution_lib.num_processes(), tf_distribution_lib.process_id()) == (3, 1)


def test_keras_variables_become_the_tf_config_and_initialize_joins(monkeypatch):
    for name in ("TF_CONFIG", "KERAS_DISTRIBUTION_JOB_ADDRESSES"):
        monkeypatch.setenv(name, "")  # recorded, so the TF_CONFIG initialize() writes is removed after the test
        monkeypatch.delenv(name)
    joined = []
    monkeypatch.setattr(distribution_cluster.strategy_lib, "get_strategy", lambda: joined.append(True))
    monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", "10.0.0.1:1234, 10.0.0.2:2345")
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "2")
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "1")
    keras.distribution.initialize()
    assert json.loads(os.environ["TF_CONFIG"]) == {"cluster": {"worker": ["10.0.0.1:1234", "10.0.0.2:2345"]},
                                                   "task": {"type": "worker", "index": 1}}
    assert joined == [True] and (tf_distribution_lib.num_processes(), tf_distribution_lib.process_id()) == (2, 1)


@pytest.mark.parametrize("kwargs, message", [
    ({"job_addresses": "10.0.0.1:1234", "num_processes": 2, "process_id": 0},
     r"On TensorFlow every process needs the address of every other \(received job_addresses='10.0.0.1:1234', "
     r"num_processes=2, process_id=0\): pass job_addresses='host0:port0,host1:port1,...' with 2 addresses"),
    ({"job_addresses": "a:1,b:2,c:3", "num_processes": 2, "process_id": 0},
     r"job_addresses names 3 processes but num_processes is 2"),
    ({"job_addresses": "a:1,b:2", "process_id": 2},
     r"keras.distribution.initialize needs process_id in 0..1 \(received job_addresses='a:1,b:2', "
     r"num_processes=None, process_id=2\); set KERAS_DISTRIBUTION_PROCESS_ID"),
])
def test_initialize_rejects_a_cluster_tensorflow_cannot_join(kwargs, message, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(DistributionError, match=message):
        keras.distribution.initialize(**kwargs)


def test_initialize_refuses_another_cluster_than_the_launchers(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", cluster_lib.make_tf_config(["127.0.0.1:1", "127.0.0.1:2"], 0))
    with pytest.raises(DistributionError, match=(
            r"keras.distribution.initialize was asked for process 1 of 2 .*but this process is worker 0 of 2 "
            r"\['127.0.0.1:1', '127.0.0.1:2'\] \(from tf_config\)\. Call keras.distribution.initialize\(\) without "
            r"arguments")):
        keras.distribution.initialize(num_processes=2, process_id=1)


def test_the_guides_script_unchanged_under_tfdist_run(tmp_path, one_device):
    """initialize() + DataParallel(), no tfdist import: 2 replicas, each half of every global batch."""
    results = run_job("keras_distribution_guide.py", tmp_path).check().results
    for rank, result in results.items():
        assert result["devices"] == [f"/job:worker/replica:0/task:{task}/device:CPU:0" for task in (0, 1)]
        assert (result["num_processes"], result["process_id"], result["replicas"]) == (2, rank, 2)
        assert result["batch_sizes"] == [guide.GLOBAL_BATCH // 2] and result["steps"] == GUIDE_STEPS
        assert result["iterations"] == GUIDE_STEPS  # an optimizer step per batch trained, no more
    for a, b, want in zip(results[0]["weights"], results[1]["weights"], one_device):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-6)  # Adam: a step counted twice moved them 1e-4
