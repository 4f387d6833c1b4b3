"""``keras.distribution.DataParallel`` trains through tfdist's strategy on TensorFlow (keras#18473).

On Keras 3.15's TensorFlow backend ``set_distribution(DataParallel())`` is accepted and ``fit``
trains on one device, silently; a ModelParallel that shards a kernel trains one unsharded copy.
Here:

* ``set_distribution`` (and so ``Distribution.scope()``) of a DataParallel or ModelParallel makes
  tfdist's strategy over the distribution's devices the process's tf.distribute strategy, as
  ``tfdist.init()`` does: a MirroredStrategy over the mesh's devices in one process, the
  MultiWorkerMirroredStrategy of the job across workers. Models, optimizers and ``fit`` made
  after it use it; the strategy before it comes back with ``set_distribution(None)`` and at the
  end of the scope. Any other Distribution (Keras' base class, a user's own) is set as Keras
  sets it: tfdist does not know how it would train.
* Keras' semantics for data: the dataset is batched at the global batch; Keras'
  ``distribute_dataset`` gives each process its share (once), and each process's batch is split
  over its replicas in order (``distribute_datasets_from_function``, which tf.distribute never
  shards again).
* tfdist keeps a full copy of every variable on every device: a variable whose layout splits it
  over a mesh axis of more than one device, or a layer output split beyond its batch dimension,
  is a ``DistributionError`` naming its path and layout. A ModelParallel whose layouts only
  replicate is data parallelism over every device of its mesh.
"""

from __future__ import annotations

import keras.distribution as keras_distribution
import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.backend.tensorflow import core as tf_core
from keras.src.backend.tensorflow import distribution_lib as tf_distribution_lib
from keras.src.distribution import distribution_lib
from keras.src.trainers.data_adapters import (array_data_adapter, generator_data_adapter, py_dataset_adapter,
                                              tf_dataset_adapter)
from tensorflow.python.data.experimental.ops import distribute as tf_data_distribute

from tfdist import cluster as cluster_lib
from tfdist import process_group
from tfdist import strategy as strategy_lib
from tfdist.errors import DistributionError
from tfdist.patching import Patch

patch = Patch(
    "keras_distribution", "keras#18473",
    without="keras.distribution.set_distribution(DataParallel()) is accepted and fit trains on one device, "
            "silently; a ModelParallel that shards a kernel trains one unsharded copy.")

# What fit/evaluate/predict take on TensorFlow (NumPy, tf.data, generators, PyDataset), each made a tf.data.Dataset.
_ADAPTERS = (array_data_adapter.ArrayDataAdapter, tf_dataset_adapter.TFDatasetAdapter,
             generator_data_adapter.GeneratorDataAdapter, py_dataset_adapter.PyDatasetAdapter)
_FIX = ("tfdist keeps a full copy of every variable on every device (data parallelism). Fix: give it a "
        "replicated layout (every axis None) or leave it out of the LayoutMap, use "
        "keras.distribution.DataParallel, or shard models on the JAX backend.")
_set_by_tfdist = None  # the strategy set_distribution made current, and the one before it


def strategy_for(distribution) -> tf.distribute.Strategy:
    """tfdist's strategy over ``distribution``'s devices (built once per process, as ``tfdist.get_strategy``).

    Raises:
        DistributionError: a multi-worker job whose mesh is not every worker's devices.
        StrategyError: devices that are not visible, or another strategy built before in this process.
    """
    devices = [str(device) for device in distribution.device_mesh.devices.flatten()]
    if cluster_lib.cluster_from_env().is_multi_worker:
        everyone = tf_distribution_lib.list_devices()
        if sorted(devices) != sorted(everyone):
            raise DistributionError(
                f"{type(distribution).__name__}'s mesh has devices {devices}, but in a multi-worker job tfdist's "
                f"strategy spans every worker's devices: {everyone}. Build the distribution without devices "
                "(DataParallel()) or with devices=keras.distribution.list_devices().")
        return strategy_lib.get_strategy()
    if strategy_lib.resolve_devices(devices) == strategy_lib.resolve_devices(None):
        return strategy_lib.get_strategy()
    return strategy_lib.get_strategy("mirrored" if len(devices) > 1 else "one_device", devices=devices)


@patch.replaces(distribution_lib, "set_distribution", ("value",))  # what Distribution.scope() calls
@patch.replaces(keras_distribution, "set_distribution", ("value",))  # the public name, bound when Keras was imported
def _set_distribution(original, value):
    """Sets Keras' distribution and makes tfdist's strategy for it the process's strategy."""
    global _set_by_tfdist
    trains_through_tfdist = isinstance(value, (distribution_lib.DataParallel, distribution_lib.ModelParallel))
    strategy = strategy_for(value) if trains_through_tfdist else None
    if strategy is not None and strategy is not tf.distribute.get_strategy():
        before = _set_by_tfdist[1] if _set_by_tfdist else (
            tf.distribute.get_strategy() if tf.distribute.has_strategy() else None)
        try:
            tf.distribute.experimental_set_strategy(strategy)
        except RuntimeError:
            raise DistributionError(
                f"keras.distribution.set_distribution({value}) inside `with strategy.scope():` "
                f"({tf.distribute.get_strategy()}): set the distribution outside the scope, or use only one "
                "of the two.") from None
        _set_by_tfdist = (strategy, before)
    elif strategy is None and _set_by_tfdist:
        tf.distribute.experimental_set_strategy(_set_by_tfdist[1])
        _set_by_tfdist = None
    original(value)


@patch.replaces(tf_core.Variable, "_initialize", ("self", "value"))
def _check_variable_layout(original, self, value):
    """A variable's layout must replicate it (checked before the variable is made)."""
    distribution = global_state.get_global_attribute(distribution_lib.GLOBAL_ATTRIBUTE_NAME)
    if distribution is not None:
        if self._shape is None and hasattr(value, "shape"):
            self._shape = self._validate_shape(value.shape)  # what Keras sets right after, for the layout
        layout = distribution.get_variable_layout(self)
        split = _split_axes(layout, distribution)
        if split:
            raise DistributionError(f"tfdist cannot shard variable '{self.path}' on TensorFlow: its layout "
                                    f"{_axes(layout)} {split}. {_FIX}")
    original(self, value)


@patch.replaces(distribution_lib.ModelParallel, "get_tensor_layout", ("self", "path"))
def _check_output_layout(original, self, path):
    """A layer output's layout may split its batch dimension only (what data parallelism does anyway)."""
    layout = original(self, path)
    if layout is not None:
        split = _split_axes(layout, self, batch_dim_name=self.batch_dim_name)
        if split:
            raise DistributionError(
                f"tfdist cannot lay out '{path}' as {_axes(layout)} on TensorFlow: it {split}; only a layer "
                f"output's first dimension may be split, over '{self.batch_dim_name}'. Leave '{path}' out of the "
                "LayoutMap (or give it a layout of None axes); shard models on the JAX backend.")
    return layout


def distribute_tensor(tensor, layout):
    """``keras.distribution.distribute_tensor``: a no-op for a layout tfdist honours (see ``_split_axes``)."""
    distribution = global_state.get_global_attribute(distribution_lib.GLOBAL_ATTRIBUTE_NAME)
    split = _split_axes(layout, distribution, batch_dim_name=getattr(distribution, "batch_dim_name", None))
    if split:
        raise DistributionError(f"tfdist cannot lay out a tensor as {_axes(layout)} on TensorFlow: it {split}. "
                                "Only the first (batch) dimension can be split.")
    return tensor


patch.adds(tf_distribution_lib, "distribute_tensor", distribute_tensor)


def _split_axes(layout, distribution, batch_dim_name: str | None = None) -> str:
    """'splits dimension 1 over mesh axis 'model' (2 devices)', or '' when the layout replicates.

    With ``batch_dim_name``, dimension 0 may be split over that axis (a data-parallel split).
    """
    if layout is None:
        return ""
    mesh = getattr(layout, "device_mesh", None) or getattr(distribution, "device_mesh", None)
    if mesh is None or not hasattr(layout, "axes"):
        return "is not a keras.distribution.TensorLayout over a DeviceMesh"
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    split = [f"dimension {i} over mesh axis '{axis}' ({sizes.get(axis)} devices)" for i, axis in enumerate(layout.axes)
             if axis is not None and sizes.get(axis, 1) > 1 and not (i == 0 and axis == batch_dim_name)]
    return f"splits {' and '.join(split)}" if split else ""


def _axes(layout):
    return tuple(layout.axes) if hasattr(layout, "axes") else layout


def _split_per_replica(original, self):
    """Under a Keras distribution, each process's batches split over its replicas, in order, sharded nowhere else."""
    dataset = original(self)
    strategy = tf.distribute.get_strategy()
    if (distribution_lib.distribution() is None or isinstance(dataset, tf.distribute.DistributedDataset)
            or strategy.num_replicas_in_sync == 1):
        return dataset
    replicas = strategy.num_replicas_in_sync // process_group.num_workers(strategy)
    if replicas > 1:
        batch = int(tf_data_distribute.compute_batch_size(dataset))
        if batch < 0:
            if not process_group.is_multi_worker(strategy):
                return dataset  # one worker: tf.distribute makes the same split itself
            raise DistributionError(
                f"Cannot split this process's batches over its {replicas} replicas: the dataset's batch size is "
                "unknown. Batch it at the global batch size: dataset.batch(global_batch_size).")
        dataset = dataset.rebatch(tf_data_distribute.batch_sizes_for_worker(batch, 1, replicas, 0))
    return strategy.distribute_datasets_from_function(lambda context: dataset)


for _adapter in _ADAPTERS:
    patch.replaces(_adapter, "get_tf_dataset", ("self",))(_split_per_replica)
# Private functions called above, checked (not replaced) with the rest of the patch.
patch.overrides(tf_data_distribute, "compute_batch_size", ("dataset",))
patch.overrides(tf_data_distribute, "batch_sizes_for_worker",
                ("global_batch_size", "num_workers", "num_replicas_per_worker", "worker_index"))
patch.overrides(tf_core.Variable, "_validate_shape", ("self", "shape"))
