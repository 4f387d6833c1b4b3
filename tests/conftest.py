"""Test session set-up: 4 logical CPU devices before TensorFlow starts.

Single-process multi-replica tests use these (Keras' own distribute tests do the
same); multi-worker tests start real worker processes through ``tests.jobs``.
"""

import os

import pytest

pytest_plugins = ["tests.cpu_report", "tests.suite_order"]

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # quiet start-up logs, here and in worker jobs
# Multi-worker fits keep the default buckets: autotune would trace each fit's step for every candidate
# and share a record file between tests. Its own tests turn it on (tests/test_autotune*.py, buckets_job.py).
os.environ.setdefault("TFDIST_AUTOTUNE", "0")

LOGICAL_CPUS = 4
# The quick tier, for edits (`bash tests/run.sh -m quick`, about 4 minutes on 2 cores): these modules' tests, each
# module under ~16 s in the whole suite's --durations. A module that starts clusters for many cases stays out.
QUICK_MODULES = frozenset(f"test_{name}" for name in (
    "async_checkpoint", "bad_inputs", "buckets", "cli_reference", "data", "data_convert", "data_exactly_once",
    "data_sharding", "data_shares", "docs", "doctor", "horovod", "horovod_join", "horovod_multi_worker", "hostlist",
    "install", "keras_callbacks", "keras_distribution", "keras_regressions", "kubernetes", "layers", "loss_scaling",
    "mixed_training", "own_tf_config", "precision", "precision_multi_worker", "ray_fixes", "replica_state",
    "save_rounds", "strategy", "tf_fixes", "wire"))


# Each xdist worker starts its local Ray clusters in a folder of its own, so one's `ray.init()` never finds the
# other's cluster (Ray looks for a running one in its temporary folder).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("RAY_TMPDIR", f"/tmp/ray-{os.environ['PYTEST_XDIST_WORKER']}")
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)


def pytest_configure(config):
    import tfdist  # noqa: F401  (first, as in a user's script: TensorFlow's import then freezes its heap, tfdist.startup)
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * LOGICAL_CPUS)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rpartition(".")[2] in QUICK_MODULES:
            item.add_marker(pytest.mark.quick)


@pytest.fixture(scope="session")
def no_gpu_here():
    """Skips a test whose expectations hold only where TensorFlow sees no GPU (the suite runs on GPU hosts too)."""
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("expects a machine without GPUs: this one has GPUs, so its devices and defaults differ")


@pytest.fixture
def fresh_tfdist_strategy(monkeypatch):
    """Lets a test build tfdist's once-per-process strategy anew; restores the old one after."""
    from tfdist import state

    monkeypatch.setattr(state, "built", None)
    yield


@pytest.fixture
def restore_dtype_policy():
    """Keras' dtype policy is process-wide: put back float32 after a test that changes it."""
    import keras

    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture(autouse=True)
def distinct_collective_keys():
    """Gives every MirroredStrategy built in a test its own collective keys.

    Two MirroredStrategy objects on the same devices in one process start from the same
    group and instance keys, and TensorFlow remembers each instance's shape: a later
    strategy's all-reduce then fails with "Shape mismatch in the collective instance 101".
    TensorFlow's own tests bump this base per strategy (tensorflow/python/distribute/
    strategy_combinations.py); tfdist users build one strategy per process.
    """
    import tensorflow as tf

    def bump():
        tf.distribute.MirroredStrategy._collective_key_base += 100000

    bump()
    yield
    bump()  # after too: a module-scoped strategy is built before the next test's bump
