"""How much of a profiled run's gradient communication the backward pass hid.

Reads the trace ``tf.profiler.experimental.start(logdir)`` / ``stop()`` wrote (the newest
``*.xplane.pb`` under ``logdir``) and compares two sets of spans on the host's threads:

* collective spans: TensorFlow's all-reduce kernels (``CollectiveReduceV2`` and friends),
  from launch to completion;
* compute spans: every other op kernel TensorFlow's executor ran on its inter-op threads
  (``tf_Compute``; function calls made from Python, which enclose whole steps, are not).

``hidden`` is collective time during which some op was computing; ``exposed`` is collective
time with no op running: the wait the step paid for communication. Open the same trace
in TensorBoard's profiler (or xprof) to see the spans themselves.
"""

from __future__ import annotations

import dataclasses
import pathlib

from tfdist.bench.config import JsonRecord

_COLLECTIVE_TYPES = ("CollectiveReduceV2", "CollectiveReduce", "CollectiveGatherV2", "CollectiveBcastSendV2",
                     "CollectiveBcastRecvV2", "NcclAllReduce")


@dataclasses.dataclass(frozen=True)
class CollectiveOverlap(JsonRecord):
    """Milliseconds of collective time in a trace, split into hidden and exposed."""

    collectives: int
    collective_ms: float
    hidden_ms: float
    exposed_ms: float

    def per_step(self, steps: int) -> "CollectiveOverlap":
        return CollectiveOverlap(self.collectives, self.collective_ms / steps, self.hidden_ms / steps,
                                 self.exposed_ms / steps)

    def describe(self) -> str:
        """``all-reduce 9.1 ms: 6.0 hidden under compute, 3.1 exposed (3 collectives)``."""
        return (f"all-reduce {self.collective_ms:.1f} ms: {self.hidden_ms:.1f} hidden under compute, "
                f"{self.exposed_ms:.1f} exposed ({self.collectives} collectives)")


def collective_overlap(logdir: str | pathlib.Path) -> CollectiveOverlap:
    """The overlap of collectives with compute in the newest trace under ``logdir``.

    Raises:
        FileNotFoundError: ``logdir`` holds no trace.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # TensorFlow's own copy of the trace format

    traces = sorted(pathlib.Path(logdir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no *.xplane.pb trace under {logdir}: profile with tf.profiler.experimental.start"
                                f"({str(logdir)!r}) and stop() first.")
    space = xplane_pb2.XSpace()
    space.ParseFromString(traces[-1].read_bytes())
    collective, compute = [], []
    for plane in space.planes:
        if not plane.name.startswith("/host:"):
            continue
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if ":" not in name or "::" in name:  # op kernels are "scope/name:Type"; others are runtime spans
                    continue
                start = line.timestamp_ns * 1000 + event.offset_ps
                span = (start, start + event.duration_ps)
                if name.rsplit(":", 1)[1].strip() in _COLLECTIVE_TYPES:
                    collective.append(span)
                elif line.name.startswith("tf_Compute"):
                    compute.append(span)
    busy = _union(compute)
    total = sum(end - start for start, end in _union(collective))
    hidden = _overlap(_union(collective), busy)
    return CollectiveOverlap(len(collective), total / 1e9, hidden / 1e9, (total - hidden) / 1e9)


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _overlap(first: list[tuple[int, int]], second: list[tuple[int, int]]) -> int:
    """Total length of the intersection of two sorted, disjoint span lists."""
    total, j = 0, 0
    for start, end in first:
        while j < len(second) and second[j][1] <= start:
            j += 1
        k = j
        while k < len(second) and second[k][0] < end:
            total += min(end, second[k][1]) - max(start, second[k][0])
            k += 1
    return total
