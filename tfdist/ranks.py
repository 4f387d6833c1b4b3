"""Horovod-style questions about the job: how many, which one, am I the chief.

``rank()``, ``local_rank()``, ``num_workers()`` and ``is_chief()`` read the cluster
from the environment and work before TensorFlow starts; ``size()`` counts replicas
and so needs the strategy.

What "size" counts: ``tfdist.size()`` is replicas in sync (as ``num_replicas_in_sync``:
every device of every worker), the number the linear LR rule scales by under a strategy;
``tfdist.num_workers()`` is worker processes; ``tfdist.horovod.size()`` is processes (as in
Horovod, where each process drives one device); ``ProcessGroup.size`` is processes.
"""

from __future__ import annotations

import builtins

from tfdist import cluster, state


def size() -> int:
    """Replicas in sync across the whole job (all workers, all their devices).

    Raises:
        RuntimeError: no strategy yet; call ``tfdist.init()`` or enter ``tfdist.scope()``.
    """
    import tensorflow as tf

    built = state.current_strategy()
    if built is None and tf.distribute.has_strategy():
        built = tf.distribute.get_strategy()
    if built is None:
        raise RuntimeError("tfdist.size() counts replicas, so it needs a strategy: call tfdist.init() "
                           "or enter tfdist.scope() first.")
    return built.num_replicas_in_sync


def rank() -> int:
    """This worker's index in the job (0 is the chief)."""
    return cluster.cluster_from_env().worker_index


def local_rank() -> int:
    """This worker's index among the workers on its host."""
    return cluster.cluster_from_env().local_rank


def local_size() -> int:
    """Workers on this host."""
    return cluster.cluster_from_env().local_size


def num_workers() -> int:
    """Worker processes in the job."""
    return cluster.cluster_from_env().num_workers


def is_chief() -> bool:
    """Whether this worker is the one that writes checkpoints, logs and results."""
    return cluster.cluster_from_env().is_chief


def verbose(level: int | str = 1) -> int | str:
    """The ``verbose`` value for ``fit``/``evaluate``: ``level`` on the chief, 0 (silent) elsewhere."""
    return level if is_chief() else 0


def print(*args, **kwargs) -> None:  # noqa: A001  (Horovod-style tfdist.print)
    """``print`` on the chief only; other workers stay silent."""
    if is_chief():
        builtins.print(*args, **kwargs)


def scale_lr(lr: float) -> float:
    """The linear scaling rule (Goyal et al.): ``lr * size()``, for a global batch ``size()`` times larger.

    Raises:
        ValueError: ``lr`` is not a positive number.
        RuntimeError: no strategy yet (see ``size()``).
    """
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr <= 0:
        raise ValueError(f"scale_lr needs a positive learning rate; received lr={lr!r}.")
    return lr * size()
