"""Keras makes input iterators it never uses; under a strategy each costs a distributed iterator.

Under Mirrored and MultiWorkerMirrored strategies every ``iter()`` of the epoch's dataset builds a
``MultiDeviceIterator``: a tf.data function of its own per device, traced and instantiated
(about 0.15 s of CPU for 2 logical CPUs, more with more devices; on a small model as much as the
steps of a short epoch). Keras 3.15 makes up to two a call that no batch is taken from (a fit of
4 batches on a built model made 3 iterators, 0.47 of its 0.6 s of CPU on a loaded 2-core VM):

* ``_maybe_symbolic_build``: every ``fit`` and ``evaluate`` takes a batch through a
  throwaway iterator to build the model, its compiled loss and metrics, even when all of them are
  built already (every call after the first: ``_symbolic_build`` then reads no batch). Here no
  iterator is made then, in one process (the optimizer is still built, as Keras would). Across
  workers Keras' way stays: the batch's ``get_next`` can agree with the other workers that every
  one has data (a collective), and a model built on one worker only (a rank's own call) would
  skip it alone.
* ``_enumerate_iterator``: at an epoch's end Keras makes the next epoch's iterator, and with no
  ``steps_per_epoch`` the next epoch (and ``reset``) replaces it unused: every ``fit`` epoch and
  every ``evaluate`` and ``predict`` made one for nothing. Here it is not made then; with
  ``steps_per_epoch`` (where the next epoch goes on with it) Keras' way stays.

What the steps see does not change: the same batches, in the same order.
"""

from __future__ import annotations

from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.trainers.epoch_iterator import EpochIterator

from tfdist import process_group
from tfdist.patching import Patch

patch = Patch(
    "spare_iterators", "Keras 3.15 makes input iterators it never takes a batch from",
    without="under a strategy every fit and evaluate builds a distributed iterator to build a model that is "
            "built already, and every epoch (evaluate, predict) with no steps_per_epoch one more for the next epoch, "
            "which replaces it: about 0.15 s of CPU each on 2 logical CPUs.")


@patch.replaces(keras_tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build", ("self", "iterator", "data_batch"))
def _no_batch_when_built(original, self, iterator=None, data_batch=None):
    strategy = self._distribute_strategy
    if (iterator is not None and data_batch is None and strategy is not None
            and process_group.num_workers(strategy) == 1 and _built(self)):
        return original(self, iterator=None, data_batch=None)  # Keras' _symbolic_build reads no batch then
    return original(self, iterator=iterator, data_batch=data_batch)


def _built(model) -> bool:
    """What ``Trainer._symbolic_build`` checks before it reads a batch: the layers, the compiled metrics and loss
    (an attribute Keras renamed counts as unbuilt: Keras' way)."""
    missing = object()
    metrics, loss = getattr(model, "_compile_metrics", missing), getattr(model, "_compile_loss", missing)
    if metrics is missing or loss is missing or not hasattr(model, "_flatten_layers"):
        return False
    return (all(layer.built for layer in model._flatten_layers()) and (metrics is None or metrics.built)
            and (loss is None or loss.built))


@patch.replaces(EpochIterator, "_enumerate_iterator", ("self",))
def _no_iterator_for_the_next_epoch(original, self):
    generator = original(self)
    # Keras' loop over a count it knows when it starts ends by itself; over data of unknown length it runs until the
    # data ends. Before the first batch, the count and the steps seen may still be the last epoch's.
    counted, started = bool(self._num_batches), False
    while True:
        last = started and counted and _next_epoch_makes_its_own(self)
        if last:
            self._get_iterator = tuple  # an instance attribute: iter(()) costs nothing
        try:
            item = next(generator)
        except StopIteration:
            if last:
                self._current_iterator = None  # not iter(()): no epoch takes it
            return
        finally:
            if last:
                del self._get_iterator
        started = True
        yield item


def _next_epoch_makes_its_own(epoch_iterator) -> bool:
    """Resumed now, Keras' loop ends and makes the next epoch's iterator; with no steps_per_epoch that epoch (or
    ``reset``) makes its own."""
    return (epoch_iterator.steps_per_epoch is None and bool(epoch_iterator._num_batches)
            and epoch_iterator._steps_seen >= epoch_iterator._num_batches)
