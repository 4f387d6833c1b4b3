"""tfdist's patches to tf.distribute's input (Keras' fixes are in ``tfdist.keras_fixes``).

``patch``: under Mirrored and MultiWorkerMirrored strategies, tf.distribute feeds each replica
through a small per-device dataset (a generator and a fixed-size prefetch) that it builds
with tf.data's default options, so tf.data autotuning runs on it whatever the user's
pipeline asked for: a model thread per iterator, with nothing to tune. On TensorFlow 2.21
deleting such an iterator waits for that thread's sleep to end, up to about 5 s: every
``fit`` under a strategy ended with a 0-5 s stall on one worker while the others waited in
their next collective (measured in benchmarks/scaling.py: 2-worker jobs at 26 ms a step
ran at 52-77 ms a step per 200-step ``fit``), and on a worker pinned to one core the thread
also takes CPU from training. The fix turns autotuning off on those per-device datasets
only (their buffer size is fixed; a user who asked for an autotuned per-replica buffer
keeps it).

``input_clock``: each worker's own ``get_next`` of a step (before tf.distribute agrees across
workers that every one has data) is timed into ``tfdist.step_clock``: a worker whose input
pipeline is slow is seen waiting there, its peers in the agreement after it.

Both are installed with ``tfdist.runtime_hooks``.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.data.ops import multi_device_iterator_ops
from tensorflow.python.distribute import input_lib

from tfdist import step_clock
from tfdist.patching import Patch

patch = Patch(
    "per-device prefetch without a tf.data autotune thread", "tf.distribute input (tfdist)",
    without="each fit under a Mirrored or MultiWorkerMirrored strategy may end with a stall of up to 5 s "
            "while tf.data's autotune thread winds down.", library="tensorflow")


@patch.replaces(multi_device_iterator_ops, "_create_device_dataset",
                ("prototype_ds", "incarnation_id", "prefetch_buffer_size", "experimental_slack"))
def _create_device_dataset(original, prototype_ds, incarnation_id, prefetch_buffer_size, experimental_slack):
    dataset = original(prototype_ds, incarnation_id, prefetch_buffer_size, experimental_slack)
    if prefetch_buffer_size == tf.data.AUTOTUNE:
        return dataset
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


_Worker = input_lib._SingleWorkerDatasetIteratorBase
input_clock = Patch(
    "each worker's input wait timed", "tfdist: tfdist.step_clock",
    without="the straggler report and the timeline cannot tell a worker waiting for its own input from one "
            "waiting for a slower worker's.", library="tensorflow")


@input_clock.replaces(_Worker, "get_next_as_optional_list", ("self",))
def _optional_list_clocked(original, self):
    """This worker's own batch, with the clock read around it (``tfdist.step_clock``: its input wait)."""
    return step_clock.input_times(lambda: original(self))


@input_clock.replaces(_Worker, "get_next_as_list", ("self", "name"))
def _list_clocked(original, self, name=None):
    return step_clock.input_times(lambda: original(self, name))
