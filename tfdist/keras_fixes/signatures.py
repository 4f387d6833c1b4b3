"""Recorded parameters of Keras methods that more than one tfdist fix replaces (Keras 3.10 to 3.15).

A fix's guard compares the live signature with these; a Keras that changed them turns the
fix off with a ``KerasCompatibilityWarning`` instead of calling it wrongly.
"""

# keras.src.backend.tensorflow.trainer.TensorFlowTrainer.fit
FIT_PARAMETERS = ("self", "x", "y", "batch_size", "epochs", "verbose", "callbacks", "validation_split",
                  "validation_data", "shuffle", "class_weight", "sample_weight", "initial_epoch", "steps_per_epoch",
                  "validation_steps", "validation_batch_size", "validation_freq")

# keras.src.trainers.trainer.Trainer.compile
COMPILE_PARAMETERS = ("self", "optimizer", "loss", "loss_weights", "metrics", "weighted_metrics", "run_eagerly",
                      "steps_per_execution", "jit_compile", "auto_scale_loss")
