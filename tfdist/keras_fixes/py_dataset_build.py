"""A ``PyDataset`` with workers keeps its first batches under a strategy (a Keras bug, no upstream issue found).

Under any tf.distribute strategy, Keras builds the model before the first epoch from a batch it
takes through a throwaway iterator of the epoch's dataset (``_maybe_symbolic_build``). A
``keras.utils.PyDataset`` with ``workers`` or ``use_multiprocessing`` feeds that dataset from one
running enqueuer, and the throwaway iterator pulls one batch and prefetches more: the first epoch
then starts where it stopped. Under MirroredStrategy with plain Keras it trains batches 3..7 of
8 in its first epoch; across workers the count depends on timing, so two runs of one script differ.
Here the model is built from the batch signature Keras already read from the dataset's first
batches (``py_dataset[0]``, ``[1]``, read directly), and no batch of the stream is taken.
"""

from __future__ import annotations

from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.trainers.data_adapters import py_dataset_adapter

from tfdist.patching import Patch

patch = Patch(
    "py_dataset_build", "Keras: a PyDataset with workers loses its first batches under a strategy",
    without="fit(PyDataset(workers=2 or use_multiprocessing=True)) under a strategy skips the first epoch's first "
            "batches (those Keras' build took from the running enqueuer): its weights differ from one device's and "
            "from run to run across workers.")


@patch.replaces(keras_tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build", ("self", "iterator", "data_batch"))
def _build_from_the_signature(original, self, iterator=None, data_batch=None):
    adapter = getattr(iterator, "data_adapter", None)
    if (data_batch is None and isinstance(adapter, py_dataset_adapter.PyDatasetAdapter)
            and adapter.enqueuer is not None and adapter._output_signature is not None):
        return original(self, iterator=None, data_batch=adapter._output_signature)
    return original(self, iterator=iterator, data_batch=data_batch)
