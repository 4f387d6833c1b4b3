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

``multi_device_input``: TensorFlow 2.21's ``MultiDeviceIterator`` (tf.distribute's input under
Mirrored and MultiWorkerMirrored strategies) frees its input dataset before it stops the
thread that fetches from it (``dataset_`` is its last member, destroyed first, and the
iterator's ``RootDataset`` borrows that dataset when tf.data rewrites nothing, as with Keras'
``apply_default_optimizations=False``). An iterator deleted while that thread waits for a
batch crashes the process when the batch arrives (segmentation fault in
``DatasetBaseIterator::GetNext``). Keras deletes one in every ``fit``, just after its first
batch (``epoch_iterator.reset()`` after ``_maybe_symbolic_build``), when the pipeline has not
warmed up: rarely, more often on a loaded CPU (one of three 2-worker runs of the test suite
crashed so). The fix keeps the input dataset referenced by each Python owner of the iterator
(the multi-device iterator and its per-device iterators), set after their own handles, so
that it is released just after the iterator is destroyed, never before. A handle can outlive
those owners (a custom loop's ``tf.function`` that uses an iterator from outside captures it,
and lets it go when the function is collected): the dataset then waits for that handle, and is
dropped by the next iterator the thread makes.
Not covered: an iterator made inside a ``tf.function`` (its handles and input are the
function's own tensors; on TensorFlow 2.21 one left while fetching crashes or hangs the process,
with or without tfdist: tf.distribute advises against making iterators there) and the
unowned ``tf.data.experimental.MultiDeviceIterator`` (tf.distribute's v1 input only).

All three are installed with ``tfdist.runtime_hooks``.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref

import tensorflow as tf
from tensorflow.python.data.ops import multi_device_iterator_ops
from tensorflow.python.distribute import input_lib
from tensorflow.python.ops import gen_dataset_ops

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


multi_device_input = Patch(
    "a multi-device iterator's input dataset outlives it", "tensorflow 2.21: MultiDeviceIterator frees its input "
    "dataset before it stops its fetching thread",
    without="deleting a tf.distribute iterator (Keras does in every fit, after the first batch) while its thread waits "
            "for a batch can crash the process with a segmentation fault.", library="tensorflow")
_creating = threading.local()  # the input datasets MultiDeviceIteratorInit got while this thread builds an iterator


@multi_device_input.replaces(gen_dataset_ops, "multi_device_iterator_init",
                             ("dataset", "multi_device_iterator", "max_buffer_size", "name"))
def _init_noting_the_input(original, dataset, multi_device_iterator, max_buffer_size, name=None):
    noted = getattr(_creating, "inputs", None)
    if noted is not None:
        noted.append(dataset)
    return original(dataset, multi_device_iterator, max_buffer_size, name=name)


_Owned = multi_device_iterator_ops.OwnedMultiDeviceIterator


class _InputHold:
    """An iterator's input dataset, held by each Python owner of its handles (set after them). When the last owner lets
    it go, the handles are normally gone, the iterator with them, and the dataset goes now; a handle that lives on
    elsewhere (a tf.function that used the iterator from outside captured it) keeps the dataset waiting for it."""

    __slots__ = ("dataset", "handles")

    def __init__(self, dataset, handles):
        self.dataset, self.handles = dataset, [weakref.ref(h) for h in handles]

    def __del__(self):
        try:
            alive = [h for h in (r() for r in self.handles) if h is not None]
            if alive:
                _Waiting(self.dataset, alive)
        except Exception:  # interpreter shutdown: nothing runs the iterator any more
            pass


class _Waiting:
    """An input dataset waiting for its iterator's last handles. A weak reference's callback runs as a handle starts
    to go, before TensorFlow frees it (and, with it, the iterator): the dataset is then set aside, and dropped by the
    next iterator this thread makes (its own deletion finished by then) or a minute later by any thread."""

    def __init__(self, dataset, handles):
        self.dataset, self.left = dataset, len(handles)
        self.refs = [weakref.ref(h, self._gone) for h in handles]
        _waiting.add(self)

    def _gone(self, _):
        self.left -= 1
        if not self.left:
            _waiting.discard(self)
            _set_aside.append((threading.get_ident(), time.monotonic(), self.dataset))
            self.dataset = None


_waiting: set = set()
# (thread, since, dataset): datasets whose iterator's last handle was being deleted. A deque: another thread's callback
# may append while one drops the old entries, which go by popleft and the rest back by append (each atomic).
_set_aside: collections.deque = collections.deque()


def _drop_set_aside():
    now, me, dropped = time.monotonic(), threading.get_ident(), []
    for _ in range(len(_set_aside)):
        entry = _set_aside.popleft()
        (dropped if entry[0] == me or now - entry[1] >= 60 else _set_aside).append(entry)
    del dropped  # the datasets go here, the deque whole again


@multi_device_input.replaces(_Owned, "__init__", ("self", "dataset", "devices", "max_buffer_size",
                                                  "prefetch_buffer_size", "source_device", "components",
                                                  "element_spec"))
def _owners_keep_the_input(original, self, *args, **kwargs):
    """Every Python owner of the new iterator's handles also holds its input dataset (an _InputHold), set after the
    handles: CPython releases an object's attributes in the order their names were first set on any instance of its
    class (a class's shared keys, checked on 3.11: every __init__ sets the handle, this attribute comes after), so
    whichever owner lets the iterator go releases the dataset only after the iterator (and its fetching thread) is
    gone, or hands it to _Waiting while a handle lives on elsewhere."""
    _drop_set_aside()
    outer, _creating.inputs = getattr(_creating, "inputs", None), []
    try:
        original(self, *args, **kwargs)
        noted = _creating.inputs
    finally:
        _creating.inputs = outer
    if noted and tf.executing_eagerly():
        owners = (self, *self._device_iterators)
        hold = _InputHold(noted[-1], [self._multi_device_iterator_resource,
                                      *(it._iterator_resource for it in self._device_iterators)])
        for owner in owners:
            owner._tfdist_input_dataset = hold
