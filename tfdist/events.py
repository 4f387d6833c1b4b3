"""What a worker's host side did, for the timeline: a bounded ring of spans and instants.

``span(kind, name, start, end, **args)`` and ``instant(kind, name, **args)`` note checkpoint saves,
agreed stops, eager collectives, autotune trials, attempts of the job; times are
``time.time()`` seconds. The ring keeps the last ``KEEP`` events (a days-long job stays
bounded). Thread-safe (a deque's append); standard library only.
"""

from __future__ import annotations

import collections
import dataclasses
import time

KEEP = 4096


@dataclasses.dataclass(frozen=True)
class Event:
    """One host-side event: a span (``end`` set) or an instant."""

    kind: str  # "save", "stop", "collective", "autotune", "job", ...
    name: str
    start: float
    end: float | None = None
    args: dict = dataclasses.field(default_factory=dict)


_ring: collections.deque = collections.deque(maxlen=KEEP)


def span(kind: str, name: str, start: float, end: float | None = None, **args) -> None:
    """Notes a span from ``start`` to ``end`` (default: now)."""
    _ring.append(Event(kind, name, start, time.time() if end is None else end, args))


def instant(kind: str, name: str, **args) -> None:
    """Notes something that happened now."""
    _ring.append(Event(kind, name, time.time(), None, args))


def recent() -> list[Event]:
    """The events kept, oldest first."""
    return list(_ring)
