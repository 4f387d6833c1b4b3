"""tfdist.tf_fixes: tf.distribute's per-device input datasets run without a tf.data autotune thread."""

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
