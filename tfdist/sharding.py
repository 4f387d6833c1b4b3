"""Whether optimizers made now shard their state across replicas (ZeRO-1): the switch, not the mechanism.

``tfdist.scope(shard_optimizer_state=True)`` turns it on for the optimizers created inside the
block, ``TFDIST_SHARD_OPTIMIZER_STATE=1`` for every optimizer of the process (an unchanged
script), ``tfdist.DistributedOptimizer(opt, shard_optimizer_state=True)`` for one optimizer.
``tfdist.keras_fixes.sharded_state`` reads it when an optimizer is created and does the sharding.
Standard library only: ``tfdist.strategy`` imports it before Keras is imported.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

ENV = "TFDIST_SHARD_OPTIMIZER_STATE"
_ON, _OFF = ("1", "true", "on", "yes"), ("", "0", "false", "off", "no")
_scoped: list[bool] = []  # the innermost scope's choice last


def requested() -> bool:
    """Whether an optimizer created now shards its state: the innermost scope's choice, else the environment."""
    if _scoped:
        return _scoped[-1]
    return from_environment()


def from_environment() -> bool:
    """``TFDIST_SHARD_OPTIMIZER_STATE``, read now; a bad value is a ValueError naming it."""
    value = os.environ.get(ENV, "").strip().lower()
    if value not in _ON + _OFF:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not a switch: set it to 1 (shard every optimizer's state "
                         "across the replicas) or 0 (keep a whole copy on every replica).")
    return value in _ON


def check(value) -> bool:
    """``value`` if it is a bool (or None: the environment decides), else a TypeError naming it."""
    if value is None:
        return from_environment()
    if not isinstance(value, bool):
        raise TypeError(f"shard_optimizer_state takes True or False; received {value!r}.")
    return value


@contextlib.contextmanager
def scoped(value: bool | None) -> Iterator[None]:
    """Optimizers created inside shard their state if ``value`` (None: as outside the block)."""
    if value is None:
        yield
        return
    _scoped.append(check(value))
    try:
        yield
    finally:
        _scoped.pop()
