"""tfdist: one-line distributed training for Keras 3 on TensorFlow.

    import tfdist
    with tfdist.scope():
        model = build_model()
        model.compile(...)
    model.fit(...)

Public names load on first use (PEP 562), so ``import tfdist`` and the launcher
``tfdist.run`` never import TensorFlow by themselves. What ``import tfdist`` does do is
arm ``tfdist.startup``'s import hooks (this module wires them): tfdist's Keras fixes apply
as soon as Keras is imported, and in a multi-worker job the strategy is built just before
TensorFlow's first op, so ``tfdist.scope()`` works wherever the script enters it. Import
tfdist first.

Layers (each module imports only from its own layer or lower ones; tests/test_layers.py
checks it, imports inside functions included):

0. standard library only: ``errors``, ``state`` (this process's strategy), ``cluster``,
   ``patching``, ``startup``, ``extras``, ``atomic_files``, ``stop_signals`` (a worker's stop
   signals), ``events`` (host-side events for the timeline), ``sharding`` (whether optimizers shard
   their state), ``fit_start`` (where a fit's training data starts), the launcher (``run``, ``cli``,
   ``launch/*``);
1. TensorFlow primitives: ``buckets`` (gradient bucket plans), ``autotune`` (picks their setting from
   measured steps), ``compression``, ``fusion``, ``devices`` (device specs, GPU pinning, threads),
   ``watchdog`` (the hang watchdog), ``kvstore`` (the coordination service's key-value store),
   ``preemption`` (the agreed stop), ``step_clock`` (each step's times), ``stragglers`` (which worker
   is slow), ``timeline`` (the Chrome trace), ``save_rounds`` (saves every worker takes part in),
   ``replica_collectives`` (collectives a replica launches from its own thread);
2. ``precision``, ``process_group`` (collectives on a given strategy's workers);
3. ``strategy`` (the factory);
4. every change to Keras/TF/Ray internals, through ``patching.Patch``: ``keras_fixes/*``,
   ``tf_fixes``, ``runtime_hooks``, ``ray_fixes``;
5. the public API: ``collectives`` (and finding the job), ``ranks`` (rank helpers),
   ``optimizer``, ``callbacks``, ``data/*``;
6. fronts that compose the rest: ``horovod/*``, ``ray_train``, ``bench/*``, ``doctor``.
"""

from __future__ import annotations

import importlib
import os as _os

from tfdist import startup as _startup

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "ClusterInfo": "tfdist.cluster",
    "cluster_from_env": "tfdist.cluster",
    "make_tf_config": "tfdist.cluster",
    "scope": "tfdist.strategy",
    "get_strategy": "tfdist.strategy",
    "init": "tfdist.strategy",
    "StrategyError": "tfdist.strategy",
    "PrecisionError": "tfdist.precision",
    "size": "tfdist.ranks",
    "rank": "tfdist.ranks",
    "local_rank": "tfdist.ranks",
    "local_size": "tfdist.ranks",
    "num_workers": "tfdist.ranks",
    "is_chief": "tfdist.ranks",
    "verbose": "tfdist.ranks",
    "print": "tfdist.ranks",
    "scale_lr": "tfdist.ranks",
    "allreduce": "tfdist.collectives",
    "allgather": "tfdist.collectives",
    "broadcast": "tfdist.collectives",
    "DistributedOptimizer": "tfdist.optimizer",
    "compute_average_loss": "tfdist.keras_fixes.batch_shares",
    "optimizer_state_bytes": "tfdist.keras_fixes.sharded_state",
    "CheckpointManager": "tfdist.checkpoint",
    "CheckpointError": "tfdist.errors",
    "ShardingError": "tfdist.errors",
    "CompressionError": "tfdist.errors",
    "Compression": "tfdist.compression",
    "set_bucket_bytes": "tfdist.buckets",
    "set_autotune": "tfdist.autotune",
    "should_stop": "tfdist.preemption",
    "exit_if_preempted": "tfdist.preemption",
    "EXIT_PREEMPTED": "tfdist.cluster",
}
# submodules reachable as attributes before their first import (tfdist.callbacks.X)
_SUBMODULES = ("callbacks", "compression", "data", "horovod", "precision")

# `print` stays out of __all__ so `from tfdist import *` keeps the built-in print.
__all__ = sorted(set(_EXPORTS) - {"print"}) + ["__version__"]


def _apply_keras_fixes() -> None:
    from keras import backend

    if backend.backend() == "tensorflow":
        from tfdist import keras_fixes

        keras_fixes.apply_all()


def _install_runtime_hooks() -> None:
    from tfdist import runtime_hooks

    runtime_hooks.install()


def _apply_ray_fixes() -> None:
    from tfdist import ray_fixes

    ray_fixes.patch.apply()


_startup.record_import_site()
_startup.arm(hooks={"keras": _apply_keras_fixes, "tensorflow": _install_runtime_hooks, "ray.train": _apply_ray_fixes},
             frozen=("tensorflow", "keras") if _startup.gc_freeze_wanted(_os.environ) else ())


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"tfdist.{name}")
    raise AttributeError(f"module 'tfdist' has no attribute {name!r}")


def __dir__():
    return __all__ + ["print", *_SUBMODULES]
