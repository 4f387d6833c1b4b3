"""Which of Keras' test files a gate pass runs (paths relative to ``keras/src``).

``ALL_FOLDERS``: the whole set, Keras' TensorFlow-backend tests of what tfdist changes. ``TESTS_OF_PATCH``: for
each of tfdist's Keras patches (``tfdist.keras_fixes.patches()``, by name), the test files of the Keras code it
replaces; their union is the subset CI runs. tests/test_keras_gate.py checks that every patch is listed, so a new
patch names its Keras tests.
"""

from __future__ import annotations

import pathlib

ALL_FOLDERS = ("trainers", "losses", "optimizers", "callbacks", "models", "saving", "backend/tensorflow")

TRAINER = ("trainers/trainer_test.py",)
DISTRIBUTE = ("backend/tensorflow/distribute_test.py", "backend/tensorflow/optimizer_distribute_test.py")
OPTIMIZER = ("optimizers/optimizer_test.py", "backend/tensorflow/optimizer_distribute_test.py")
LOSS_SCALE = ("optimizers/loss_scale_optimizer_test.py",)
CALLBACKS = tuple(f"callbacks/{name}_test.py" for name in (
    "backup_and_restore", "csv_logger", "early_stopping", "model_checkpoint", "reduce_lr_on_plateau", "tensorboard"))
EPOCHS = ("trainers/epoch_iterator_test.py",)
BATCH_NORM = ("layers/normalization/batch_normalization_test.py",)
DISTRIBUTION = ("distribution/distribution_lib_test.py",)

TESTS_OF_PATCH: dict[str, tuple[str, ...]] = {
    "multi_worker_fit": TRAINER + DISTRIBUTE,             # TensorFlowTrainer._maybe_symbolic_build, reduce_per_replica
    "loss_scale": LOSS_SCALE,                             # LossScaleOptimizer.check_finite
    "sharded_state": OPTIMIZER + ("callbacks/swap_ema_weights_test.py", "saving/saving_lib_test.py"),
    "gradient_buckets": OPTIMIZER + LOSS_SCALE,           # the optimizer's all-reduce and clipping
    "accumulation": OPTIMIZER,                            # BaseOptimizer._backend_apply_gradients
    "callbacks": CALLBACKS + EPOCHS,                      # the checkpoint, logging and stopping callbacks
    "replica_state": TRAINER + BATCH_NORM,                # CallbackList.on_epoch_end, BatchNormalization's statistics
    "steps_per_execution": TRAINER,                       # TensorFlowTrainer._make_function
    "exact_steps_per_execution": TRAINER + EPOCHS,        # EpochIterator._enumerate_iterator
    "auto_steps_per_execution": TRAINER,                  # Trainer.compile, TensorFlowTrainer.fit
    "xla_cpu_replicas": TRAINER,                          # Trainer.compile
    "uneven_data": EPOCHS + DISTRIBUTE,                   # EpochIterator.reset, TFEpochIterator.__init__
    "precision_check": TRAINER,                           # TensorFlowTrainer.fit
    "sync_batch_norm": BATCH_NORM,                        # backend.tensorflow.nn._compute_moments_sync
    "keras_distribution_cluster": DISTRIBUTION,           # backend.tensorflow.distribution_lib
    "keras_distribution": DISTRIBUTION,                   # set_distribution, Variable._initialize, the data adapters
    "quiet_fit": TRAINER,                                 # TensorFlowTrainer.fit
    "step_report": TRAINER + ("callbacks/callback_test.py",),  # CallbackList
    "preemption": TRAINER + CALLBACKS,                    # TensorFlowTrainer.fit, CallbackList
    "autotune": TRAINER,                                  # TensorFlowTrainer.make_train_function
    "sparse_rows": OPTIMIZER + ("layers/core/embedding_test.py",),  # BaseOptimizer.apply
    "scaled_loss": LOSS_SCALE,                            # LossScaleOptimizer.scale_loss
    "py_dataset_build": TRAINER,                          # TensorFlowTrainer._maybe_symbolic_build
    "batch_shares": TRAINER + ("losses/loss_test.py", "losses/losses_test.py"),  # train_step, the loss scaling
    "async_checkpoint": ("backend/tensorflow/saved_model_test.py",),  # Variable._copy_trackable_to_cpu
    "model_files": ("saving/saving_lib_test.py", "saving/saving_api_test.py"),  # saving_lib.save_model, weights
    "sharded_save_points": TRAINER + CALLBACKS,           # TensorFlowTrainer.fit, the callbacks' epoch ends
}

# Test files whose modules import what the gate does not install (torch, grain, orbax): they fail to collect in
# both passes alike; the subset leaves them out, the whole set counts them as collection errors.
NEEDS_MORE = {"trainers/data_adapters/array_data_adapter_test.py", "trainers/data_adapters/tf_dataset_adapter_test.py",
              "trainers/data_adapters/py_dataset_adapter_test.py", "trainers/data_adapters/generator_data_adapter_test.py",
              "trainers/data_adapters/torch_data_loader_adapter_test.py",
              "trainers/data_adapters/grain_dataset_adapter_test.py"}


def subset() -> list[str]:
    """The test files of every patch, once each, sorted."""
    return sorted({path for paths in TESTS_OF_PATCH.values() for path in paths})


def whole_set(root: pathlib.Path) -> list[str]:
    """Every test file under ``ALL_FOLDERS``, and the subset's files elsewhere."""
    found = {str(path.relative_to(root)) for folder in ALL_FOLDERS for path in (root / folder).rglob("*_test.py")}
    return sorted(found | set(subset()))


def missing(root: pathlib.Path, files: list[str]) -> list[str]:
    """The files of ``files`` that this Keras does not have (a renamed or removed test file)."""
    return [path for path in files if not (root / path).is_file()]
