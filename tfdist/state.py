"""The process-wide record of tfdist: this process's one strategy and where things happened.

As Keras keeps its current distribution in ``backend/common/global_state.py``: a small module
at the bottom that everyone reads and only its owners write. Standard library only.

* ``strategy``: the strategy tfdist built (``tfdist.strategy``, the factory, records it) or
  adopted from the script (``tfdist.runtime_hooks``); ``None`` before either.
* ``runtime_started_at``: where TensorFlow's runtime started, if tfdist saw it start.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Built:
    """The process's strategy, the request it was built for, and where it came from."""

    key: tuple           # the request, as tfdist.strategy makes it
    strategy: Any        # a tf.distribute.Strategy
    origin: str          # for messages: "built by tfdist at train.py:12"
    adopted: bool = False  # built by the script itself, not by tfdist


built: Built | None = None
runtime_started_at: str | None = None  # "train.py:8"


def record(entry: Built) -> None:
    """Makes ``entry`` the process's strategy."""
    global built
    built = entry


def current_strategy() -> Any | None:
    """The strategy tfdist built (or adopted) in this process, or None."""
    return None if built is None else built.strategy


def built_by_tfdist() -> Any | None:
    """The process's strategy if tfdist built it (not adopted from the script), else None."""
    return None if built is None or built.adopted else built.strategy


def origin_of_current() -> str:
    """Where the process's strategy came from, for messages."""
    return "no strategy yet" if built is None else built.origin
