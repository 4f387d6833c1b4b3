"""Horovod's TensorFlow and Keras API on Keras 3, with Horovod's semantics.

Change one line of a Horovod script::

    import horovod.tensorflow.keras as hvd     # or: import horovod.tensorflow as hvd
    import tfdist.horovod as hvd               # instead

and start it with ``tfdist run -n N -- python train.py`` (or leave the import alone and
run ``tfdist run --horovod -n N -- python train.py``). As with Horovod, every process
builds its own model and optimizer outside any strategy, ``batch(B)`` is each process's
batch, and ``hvd.DistributedOptimizer`` / ``hvd.DistributedGradientTape`` average the
gradients across processes, on TensorFlow's own collective ops (no MPI, no Gloo).

Names Horovod has and tfdist cannot honour raise an AttributeError that says what to use
instead. See the README's "Coming from Horovod" for every name and what differs.
"""

from tfdist.compression import Compression
from tfdist.horovod import keras_compat as _keras_compat
from tfdist.horovod.basics import (Adasum, Average, Max, Min, Product, ProcessSet, Sum, add_process_set, ccl_built,
                                   cross_rank, cross_size, cuda_built, ddl_built, global_process_set, gloo_built,
                                   gloo_enabled, gpu_available, init, is_homogeneous, is_initialized, local_rank,
                                   local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                                   remove_process_set, rocm_built, shutdown, size, start_timeline, stop_timeline)
from tfdist.horovod.ops import (allgather, allgather_object, allreduce, alltoall, broadcast, broadcast_,
                                broadcast_object, broadcast_variables, grouped_allgather, grouped_allreduce,
                                grouped_reducescatter, join, local_rank_op, local_size_op, process_set_included_op,
                                rank_op, reducescatter, size_op)
from tfdist.horovod.optimizer import DistributedGradientTape, DistributedOptimizer, load_model
from tfdist.horovod.runner import run
from tfdist.horovod.sync_batch_norm import SyncBatchNormalization
from tfdist.horovod import callbacks, elastic  # noqa: E402  (hvd.callbacks, hvd.elastic)

_keras_compat.apply()

__all__ = [
    "Adasum", "Average", "Compression", "DistributedGradientTape", "DistributedOptimizer", "Max", "Min",
    "ProcessSet", "Product", "Sum", "SyncBatchNormalization", "add_process_set", "allgather", "allgather_object", "allreduce", "alltoall",
    "broadcast", "broadcast_", "broadcast_global_variables", "broadcast_object", "broadcast_variables",
    "callbacks", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic",
    "global_process_set", "gloo_built", "gloo_enabled", "gpu_available", "grouped_allgather",
    "grouped_allreduce", "grouped_reducescatter", "init", "is_homogeneous", "is_initialized", "join",
    "load_model", "local_rank", "local_rank_op", "local_size", "local_size_op", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "process_set_included_op", "rank", "rank_op", "reducescatter",
    "remove_process_set", "rocm_built", "run", "shutdown", "size", "size_op", "start_timeline", "stop_timeline",
]

# Horovod names with no tfdist counterpart, and what to do instead.
_NOT_SUPPORTED = {
    "PartialDistributedGradientTape": "use hvd.DistributedGradientTape and apply local layers' gradients from "
                                      "a second, plain tf.GradientTape",
    "BroadcastGlobalVariablesHook": "TF1 session hooks do not exist in TensorFlow 2: use "
                                    "hvd.callbacks.BroadcastGlobalVariablesCallback(0) or hvd.broadcast_variables",
    "broadcast_object_fn": "TF1 sessions do not exist in TensorFlow 2: call hvd.broadcast_object eagerly",
}


def broadcast_global_variables(root_rank):
    """Horovod's TF1 call; TensorFlow 2 has no global variables, so it raises with what to use instead."""
    raise RuntimeError("hvd.broadcast_global_variables() needs TF1 graph mode (global variables); in TensorFlow 2 "
                       f"use hvd.broadcast_variables(model.variables, root_rank={root_rank!r}) and the same for "
                       "the optimizer's variables, or hvd.callbacks.BroadcastGlobalVariablesCallback.")


def __getattr__(name: str):
    if name in _NOT_SUPPORTED:
        raise AttributeError(f"tfdist.horovod has no {name}: {_NOT_SUPPORTED[name]}.")
    raise AttributeError(f"module 'tfdist.horovod' has no attribute {name!r}")
