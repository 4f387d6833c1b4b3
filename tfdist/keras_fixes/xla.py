"""``compile(jit_compile=True)`` under a strategy over several CPU devices: a clear error instead of XLA's.

XLA compiles a replica's step for one device; with MirroredStrategy over logical CPU devices
the step then reads the other replicas' variables and fails inside ``fit`` with "Trying to
access resource .../replica_1 ... located in device CPU:1 from device CPU:0" (keras#18145,
XLA's known issue "tf.Variable on a different device"), with or without a
LossScaleOptimizer (keras#21366). Keras' default ``jit_compile="auto"`` already turns XLA
off under a strategy; only an explicit True reaches this check.
"""

from __future__ import annotations

import inspect

import tensorflow as tf
from keras.src.trainers import trainer as trainer_module

from tfdist.keras_fixes.signatures import COMPILE_PARAMETERS
from tfdist.patching import Patch

patch = Patch(
    "xla_cpu_replicas", "keras#18145 and keras#21366",
    without="compile(jit_compile=True) under MirroredStrategy over CPU devices fails later, inside fit, with "
            "XLA's \"Trying to access resource ... from device CPU:0\".")


def _local_cpu_replicas(strategy: tf.distribute.Strategy) -> int:
    try:
        devices = strategy.extended.worker_devices
    except RuntimeError:  # the default strategy has none
        return 0
    return len(devices) if len(devices) > 1 and all("CPU" in d.upper() for d in devices) else 0


@patch.replaces(trainer_module.Trainer, "compile", COMPILE_PARAMETERS)
def _refuse_xla_over_cpu_replicas(original, self, *args, **kwargs):
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    replicas = _local_cpu_replicas(getattr(self, "distribute_strategy", None) or tf.distribute.get_strategy())
    if bound.arguments.get("jit_compile") is True and replicas:
        raise ValueError(
            f"compile(jit_compile=True) cannot run under a strategy over {replicas} CPU devices: XLA compiles each "
            "replica's step for one device and cannot read the other replicas' variables (keras#18145; with a "
            "LossScaleOptimizer too, keras#21366). Received: jit_compile=True. Pass jit_compile=False (or leave "
            "the default \"auto\", which Keras turns off under a strategy), or train on one device.")
    return original(self, *args, **kwargs)
