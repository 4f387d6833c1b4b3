"""Every patch tfdist makes to Keras internals, each naming its upstream issue.

``apply_all()`` runs as soon as Keras is imported in a process that imported tfdist or
was started by ``tfdist run`` (see ``tfdist.startup``). Each patch first checks the
internals it replaces; where one is missing or changed, that patch stays off and a
``KerasCompatibilityWarning`` says which Keras tfdist was checked against and what will
not work. Remove a patch when the Keras versions tfdist supports all have the fix.

* ``multi_worker``: Keras 3 fit/evaluate/predict under MultiWorkerMirroredStrategy
  (keras#20585, tensorflow#72388).
* ``loss_scale``: LossScaleOptimizer skips a step when any replica overflows.
* ``sharded_state``: ``shard_optimizer_state=True``: each replica keeps 1/N of the optimizer's
  state and updates 1/N of the weights; the shards are all-gathered (ZeRO-1).
* ``gradient_buckets``: gradients are all-reduced bucket by bucket, last layers first, so
  communication overlaps the backward pass (``tfdist.buckets``).
* ``accumulation``: ``gradient_accumulation_steps`` and ``use_ema``'s
  ``ema_overwrite_frequency`` under any strategy (keras#20582).
* ``callbacks``: Keras' checkpoint, logging and early-stopping callbacks on several
  workers (tensorflow#38635).
* ``precision_check``: ``fit`` warns about half-precision outputs once tfdist set a mixed policy.
* ``replica_state``: BatchNormalization's moving statistics (any non-trainable layer
  weight) are the mean over replicas and workers, as in tf.keras.
* ``uneven``: per-worker data of different lengths: every worker runs the longest's steps.
* ``xla``: ``compile(jit_compile=True)`` over several CPU replicas is a clear error
  (keras#18145, keras#21366).
* ``distribution_cluster``: ``keras.distribution.initialize``, ``list_devices``, ``num_processes``,
  ``process_id`` on TensorFlow (keras#18473), from the cluster tfdist reads.
* ``distribution``: ``keras.distribution.DataParallel`` (set or as a scope) trains through tfdist's
  strategy; a layout that shards a variable is a clear error (keras#18473).
* ``steps_per_execution``: ``compile(steps_per_execution=K)`` under any strategy
  (keras#19246); the last call of an epoch runs only the steps left (Keras runs K);
  and ``"auto"``: tfdist picks K.
* ``autotune``: a multi-worker ``fit`` picks its gradient bucket setting from the step times of its
  first steps (``tfdist.autotune``).
* ``sync_batch_norm``: ``BatchNormalization(synchronized=True)`` across workers all-reduces in
  a lane of its own, so the gradient all-reduces need not wait for it (b/163099951).
* ``sparse_rows``: an ``Embedding``'s gradient with a repeated id is summed per row before the
  optimizer reads it (Adam, ``global_clipnorm``), as tf.keras 2 did: one device equals N.
* ``scaled_loss``: ``LossScaleOptimizer.scale_loss`` remembers the loss it scaled, so
  ``hvd.DistributedGradientTape`` sends those gradients unscaled on a float16 wire.
* ``quiet_fit``: ``fit`` does not warn about a ``shuffle`` the caller never passed.
* ``step_report``: a multi-worker ``fit`` ends with worker 0 naming a straggler (or none), writes
  the timeline, and gives TensorBoard each worker's step times.
* ``py_dataset_build``: a ``PyDataset`` with workers keeps its first batches under a strategy
  (Keras' build took them from the running enqueuer).
* ``batch_shares``: in ``fit`` and ``evaluate`` every loss term weighs by its share of the global
  batch (its divisor: examples, sample weights, unmasked values; 1 for a sum), so a batch that does
  not split evenly trains and logs as on one device (Keras weighs each mean by 1 / replicas).
* ``model_files``: ``model.save`` and ``save_weights`` on every worker write whole files (every
  worker wrote one path at once: a corrupt zip).
* ``async_checkpoint``: TensorFlow's ``CheckpointOptions(enable_async=True)`` saves a Keras model
  more than once (Keras' variables made a new host copy on every save).
* ``preemption``: each ``fit`` is a session of the agreed stop: a stop signal or a callback's
  ``stop_training`` on one worker stops every worker after one agreed step (or epoch); a
  preempted fit saves through BackupAndRestore and exits 85.
* ``sharded_save_points``: where each worker's fits are (``tfdist.save_rounds``), so a sharded save on some
  workers only fails at once when another worker went on; applied last (before any collective of ``fit``).
"""

from __future__ import annotations

from tfdist.patching import TESTED_KERAS, KerasCompatibilityWarning, Patch, original_of

__all__ = ["PATCHES", "TESTED_KERAS", "KerasCompatibilityWarning", "apply_all", "original_of", "patches"]


def patches() -> tuple[Patch, ...]:
    """Every patch, in the order applied. Imports the fix modules (and so Keras) on first call,
    so importing this package never starts a Keras import inside a half-imported tfdist module."""
    from tfdist.keras_fixes import (accumulation, async_checkpoint, autotune_fit, batch_shares, callbacks, distribution, distribution_cluster,
                                    gradient_buckets, loss_scale, model_files, multi_worker, precision_check, preemption,
                                    py_dataset_build, quiet, replica_state, scaled_loss, sharded_state, sparse_rows,
                                    step_report,
                                    steps_per_execution, sync_batch_norm, uneven, xla)

    return (multi_worker.patch, loss_scale.patch, sharded_state.patch, gradient_buckets.patch, accumulation.patch, callbacks.patch,
            replica_state.patch, steps_per_execution.patch, steps_per_execution.exact_steps_patch,
            steps_per_execution.auto_patch, xla.patch, uneven.patch, precision_check.patch, sync_batch_norm.patch,
            distribution_cluster.patch, distribution.patch, quiet.patch, step_report.patch, preemption.patch, autotune_fit.patch, sparse_rows.patch,
            scaled_loss.patch, py_dataset_build.patch, batch_shares.patch, async_checkpoint.patch,
            model_files.patch,
            sharded_state.points_patch)  # last: the outermost fit, before any collective of it


def apply_all() -> None:
    """Applies every patch whose internals look as expected (idempotent).

    ``tfdist.startup`` calls it once Keras is imported; nothing else needs to.
    """
    for patch in patches():
        patch.apply()


def __getattr__(name: str):
    if name == "PATCHES":  # PEP 562: the tuple, imported on first use
        return patches()
    raise AttributeError(f"module 'tfdist.keras_fixes' has no attribute {name!r}")
