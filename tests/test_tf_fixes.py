"""tfdist.tf_fixes: tf.distribute's per-device input datasets run without a tf.data autotune thread, and a
multi-device iterator's input dataset outlives the iterator."""

import subprocess
import threading
import sys

import pytest
import tensorflow as tf
from tensorflow.python.data.ops import multi_device_iterator_ops

import tfdist  # noqa: F401  (installs the runtime hooks, tf_fixes among them)
from tfdist import patching, tf_fixes


def _per_device_autotune(prefetch_buffer_size):
    iterator = multi_device_iterator_ops.OwnedMultiDeviceIterator(
        tf.data.Dataset.range(4), ["/cpu:0"], prefetch_buffer_size=prefetch_buffer_size)
    assert [int(t) for t in next(iterator)] == [0]  # still feeds the device
    return [d._dataset.options().autotune.enabled for d in iterator._device_iterators]


def test_per_device_datasets_do_not_autotune():
    assert tf_fixes.patch.applied
    assert _per_device_autotune(1) == [False]


def test_an_autotuned_per_replica_buffer_keeps_autotune():
    assert _per_device_autotune(tf.data.AUTOTUNE) == [None]  # tf.data's default: on


def test_a_tensorflow_patch_names_tensorflow_when_it_cannot_apply():
    class Owner:
        pass

    patch = patching.Patch("demo", "tf#1", without="x.", library="tensorflow")
    patch.replaces(Owner, "missing", ("self",))(lambda original, self: 0)
    with pytest.warns(patching.KerasCompatibilityWarning,
                      match=rf"to TensorFlow {tf.__version__}: .*Owner.missing does not exist.*"
                            r"checked against TensorFlow 2\.21"):
        assert not patch.apply()


# Deletes tf.distribute iterators (MirroredStrategy, 2 CPU devices) just after their first batch, while their
# MultiDeviceIterator's thread waits 50 ms for the next one (Keras' fit does so after its first batch, with a pipeline
# that has not warmed up): first with tfdist's fix, then without it. Core dumps off: the second part crashes.
def _slow_mirrored_input(sleep_us: int) -> str:
    """A script's start: ``data``, a dataset distributed over 2 CPU devices whose every batch sleeps ``sleep_us``,
    not rewritten by tf.data (as Keras' array adapter's); tfdist imported; core dumps off (a crash is expected)."""
    return f"""
import gc, resource, sys
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
import numpy as np, tensorflow as tf
from tensorflow.python.data.experimental.ops import testing
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import tfdist  # installs the runtime hooks, tf_fixes among them
from tfdist import tf_fixes
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
options = tf.data.Options()
options.experimental_optimization.apply_default_optimizations = False
data = tf.data.Dataset.from_tensor_slices(np.zeros((64, 6), "float32")).batch(4).apply(testing.sleep({sleep_us}))
data = strategy.experimental_distribute_dataset(data.with_options(options))
"""


def _survives(script: str) -> None:
    from tests.jobs import job_env

    run = subprocess.run([sys.executable, "-c", script], env=job_env(), capture_output=True, text=True, timeout=300)
    assert "... survived" in run.stdout, (run.returncode, run.stdout, run.stderr[-3000:])


_DROP_MID_FETCH = _slow_mirrored_input(50_000) + """
patch = getattr(tf_fixes, "multi_device_input", None)  # None where tfdist has no such fix
for fixed, times in ((True, 10), (False, 20)):
    if not fixed and patch:
        patch.restore()
    print("fixed" if fixed else "unfixed", bool(patch and patch.applied), end=":", flush=True)
    for _ in range(times):
        iterator = iter(data)
        next(iterator)
        del iterator
        print(".", end="", flush=True)
    print(" survived", flush=True)
"""


@pytest.fixture(scope="module")
def dropped_mid_fetch():
    from tests.jobs import job_env

    return subprocess.run([sys.executable, "-c", _DROP_MID_FETCH], env=job_env(), capture_output=True, text=True,
                          timeout=300)


def test_deleting_a_mirrored_iterator_while_it_fetches_does_not_crash(dropped_mid_fetch):
    """TensorFlow 2.21's MultiDeviceIterator freed its input dataset before stopping the thread fetching from it: the
    batch that thread was waiting for then crashed the process (SIGSEGV in DatasetBaseIterator::GetNext): here within
    the first 2 iterators; in Keras' fit, which deletes one after the first batch, rarely (more often under load)."""
    assert "fixed True:.......... survived" in dropped_mid_fetch.stdout, (
        dropped_mid_fetch.returncode, dropped_mid_fetch.stdout, dropped_mid_fetch.stderr[-3000:])


def test_without_the_fix_tensorflow_crashes(dropped_mid_fetch):
    """If this starts failing, TensorFlow's MultiDeviceIterator keeps its input until its thread stops: drop
    tf_fixes.multi_device_input."""
    assert "unfixed False:" in dropped_mid_fetch.stdout, dropped_mid_fetch.stdout
    assert dropped_mid_fetch.returncode < 0, (dropped_mid_fetch.returncode, dropped_mid_fetch.stdout)


# A custom training loop's tf.function that uses an iterator from outside captures its handles: the iterator's Python
# owners go first, the handles (and the MultiDeviceIterator) only when the function is collected. Here a 300 ms sleep
# ends the pipeline, so the collection falls while the thread waits for the batch the last call made room for.
_CAPTURED_BY_A_FUNCTION = _slow_mirrored_input(300_000) + """
for _ in range(3):
    iterator = iter(data)

    @tf.function
    def step():
        return strategy.experimental_local_results(next(iterator))[0]

    step()
    del iterator
    step()
    del step
    gc.collect()
    print(".", end="", flush=True)
print(" survived", flush=True)
"""


def test_an_iterator_a_function_captured_is_collected_while_it_fetches():
    """The function holds the iterator's handles after its Python owners are gone: the input dataset waits for them."""
    _survives(_CAPTURED_BY_A_FUNCTION)


def test_an_input_set_aside_while_another_thread_drops_the_old_ones_stays():
    """A handle's weak-reference callback runs in the thread deleting it (which frees the iterator after it, without
    the GIL): a dataset it sets aside while another thread drops the old ones must not be dropped with them."""
    from tfdist import tf_fixes

    other = object()

    class Arrives:  # an entry's time whose reading lets another thread's handle go meanwhile
        def __rsub__(self, now):
            tf_fixes._set_aside.append((-2, now, other))
            return 0.0

    saved = list(tf_fixes._set_aside)
    tf_fixes._set_aside.clear()
    try:
        tf_fixes._set_aside.append((-1, Arrives(), "kept"))
        tf_fixes._drop_set_aside()
        assert {id(entry[2]) for entry in tf_fixes._set_aside} == {id("kept"), id(other)}
        tf_fixes._set_aside.append((threading.get_ident(), 0.0, "mine"))
        tf_fixes._set_aside.append((-3, -1e9, "old"))
        tf_fixes._drop_set_aside()
        assert "mine" not in [entry[2] for entry in tf_fixes._set_aside]
        assert "old" not in [entry[2] for entry in tf_fixes._set_aside]
    finally:
        tf_fixes._set_aside.clear()
        tf_fixes._set_aside.extend(saved)


# tf.nest with expand_composites rebuilds a distributed iterator from its components: new Python owners of the same
# handles, made without the input dataset; the originals go first.
_REBUILT_FROM_COMPONENTS = _slow_mirrored_input(300_000) + """
for _ in range(3):
    iterator = iter(data)
    next(iterator)
    rebuilt = tf.nest.map_structure(lambda t: t, iterator, expand_composites=True)
    assert rebuilt is not iterator
    del iterator
    next(rebuilt)
    del rebuilt
    print(".", end="", flush=True)
print(" survived", flush=True)
"""


def test_an_iterator_rebuilt_from_its_components_is_dropped_while_it_fetches():
    """The rebuilt iterator holds the handles after the original's owners are gone: the input dataset waits."""
    _survives(_REBUILT_FROM_COMPONENTS)
