"""One Chrome-trace timeline of every worker: steps, input, compute, each gradient bucket's all-reduce.

``TFDIST_TIMELINE=FILE`` (``tfdist run --timeline FILE``; ``HOROVOD_TIMELINE``, or
``hvd.start_timeline(FILE)``, under ``tfdist.horovod``) makes worker 0 write FILE, a JSON trace
that Perfetto (ui.perfetto.dev) and chrome://tracing open: one process per worker (``pid`` =
its rank), with lanes

* ``steps``: each step, from asking for its batch to its last bucket all-reduced;
* ``input``: waiting for this worker's own batch; then for every worker's (tf.distribute agrees
  that all have data);
* ``compute``: forward (batch ready to the first gradient bucket ready) and backward (to the last
  gradient ready);
* ``all-reduce``: each bucket's all-reduce (buckets run one after another), with its bytes and how
  much of it the backward pass hid;
* ``host``: checkpoint saves, agreed stops, eager collectives, autotune trials, the job's attempt,
  the straggler report.

Steps come from ``tfdist.step_clock`` (its ring: the last ``RING_STEPS`` steps of each worker),
host events from ``tfdist.events``. Each worker's timeline thread publishes its part in the
coordination service's store after every ``fit`` and every ``PERIOD_S`` seconds (and at exit);
worker 0's merges them and rewrites FILE (atomically): a days-long job keeps a bounded file of its
latest steps, and training never waits for it.

Clocks: each worker's times are wall-clock seconds of its own host. At the first ``fit`` the
workers measure their offsets from worker 0's clock (``measure_offsets``: rounds of an
all-reduce, each worker reading its clock as it returns); every time is shifted by its worker's
offset. The trace says how close that is (``otherData.clock_bound_ms``: one all-reduce's
return spread, about a millisecond on one machine or a fast network).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import socket
import sys
import threading
import time

import numpy as np

from tfdist import atomic_files, cluster, events, kvstore, step_clock

ENV = cluster.ENV_TIMELINE
ENV_HOROVOD = "HOROVOD_TIMELINE"
PERIOD_S = 30.0
COLLECT_S = 10.0
_KEY = "tfdist/timeline/"
_LANES = {"steps": 1, "input": 2, "compute": 3, "all-reduce": 4, "host": 5}

_path: str | None = None  # hvd.start_timeline's, over the environment's
_offset, _bound_ms = 0.0, float("nan")  # this worker's clock minus worker 0's; the alignment's bound
_started = False
_fits = 0  # fits ended so far (every worker's the same count): how recent a part is
_wake = threading.Event()
_publishing = threading.Lock()


def path() -> str | None:
    """Where worker 0 writes the timeline: ``hvd.start_timeline``'s, else TFDIST_TIMELINE, else HOROVOD_TIMELINE."""
    found = _path or os.environ.get(ENV) or os.environ.get(ENV_HOROVOD)
    return os.path.abspath(found) if found else None


def set_path(value: str | None) -> None:
    """``hvd.start_timeline(path)`` / ``stop_timeline()`` (None)."""
    global _path
    _path = value


def measure_offsets(group, rounds: int = 5) -> tuple[float, float]:
    """This worker's clock minus worker 0's, and the bound of that estimate in ms (``group``: a ProcessGroup).

    Each round every worker reads its clock before and after an all-reduce; every worker's return
    comes once the last one joined, within the round's shortest duration of one another. The round
    whose slowest return came soonest after its last join gives the offsets.
    """
    import tensorflow as tf

    marks = []
    for _ in range(rounds):
        before = time.time()
        group.allreduce(tf.constant([0.0]), device="CPU")
        marks.append([before, time.time()])
    everyone = group.allgather(tf.constant([marks], tf.float64), device="CPU").numpy()  # [size, rounds, 2]
    durations = everyone[:, :, 1] - everyone[:, :, 0]
    best = int(np.argmin(durations.max(axis=0)))
    offsets = everyone[:, best, 1] - everyone[0, best, 1]
    return float(offsets[group.rank]), float(durations[:, best].min() * 1e3)


def start(group, rank: int) -> None:
    """At the first ``fit`` of a multi-worker job with a timeline: the clock offsets, then the publishing thread."""
    global _started, _offset, _bound_ms
    if _started or path() is None:
        return
    _started = True
    _offset, _bound_ms = measure_offsets(group)
    attempt = os.environ.get("TFDIST_RESTART", "0")
    events.instant("job", f"attempt {attempt}: {group.size} workers", attempt=attempt, workers=group.size)
    threading.Thread(target=_publisher, args=(rank, group.size), name="tfdist-timeline", daemon=True).start()
    atexit.register(publish, rank, group.size)


def publish_soon(fits: int) -> None:
    """After ``fits`` fits: the publishing thread publishes now (not on the training thread)."""
    global _fits
    _fits = fits
    _wake.set()


def _publisher(rank: int, size: int) -> None:
    while True:
        _wake.wait(PERIOD_S)
        _wake.clear()
        try:
            publish(rank, size)
        except Exception as error:  # noqa: BLE001  (a timeline must never stop training)
            print(f"tfdist timeline (worker {rank}): could not publish: {type(error).__name__}: {error}",
                  file=sys.stderr, flush=True)


def chunk(rank: int) -> dict:
    """This worker's part of the timeline."""
    rows = step_clock.rows()
    return {"rank": rank, "host": socket.gethostname(), "offset": _offset, "bound_ms": _bound_ms, "fits": _fits,
            "columns": list(step_clock.COLUMNS), "buckets": step_clock.bucket_bytes(),
            "rows": [[None if math.isnan(v) else v for v in row] for row in rows.tolist()],
            "events": [{"kind": e.kind, "name": e.name, "start": e.start, "end": e.end, "args": e.args}
                       for e in events.recent()]}


def publish(rank: int, size: int) -> None:
    """Publishes this worker's part; worker 0 then merges every worker's (waiting up to ``COLLECT_S`` for parts as
    recent as its own: the same number of fits) and writes the file."""
    target = path()
    if target is None:
        return
    with _publishing:  # the timeline thread, the training thread (hvd.stop_timeline) and exit may all publish
        _publish(target, rank, size)


def _publish(target: str, rank: int, size: int) -> None:
    mine = chunk(rank)
    kvstore.put(f"{_KEY}{rank}", json.dumps(mine))
    if rank != 0:
        return
    parts, deadline = [mine], time.monotonic() + COLLECT_S
    for peer in range(1, size):
        part = None
        while time.monotonic() < deadline:
            value = kvstore.get(f"{_KEY}{peer}", 500)
            part = json.loads(value) if value else part
            if part is not None and part["fits"] >= mine["fits"]:
                break
            time.sleep(0.1)
        if part is not None:
            parts.append(part)
    atomic_files.write_text(target, json.dumps(trace(parts)))


def trace(parts: list[dict]) -> dict:
    """The Chrome trace (``traceEvents``) of every worker's part."""
    found = []
    for part in sorted(parts, key=lambda p: p["rank"]):
        found += _worker_events(part)
    bound = max((p["bound_ms"] for p in parts if p["bound_ms"] == p["bound_ms"]), default=float("nan"))
    return {"traceEvents": found, "displayTimeUnit": "ms",
            "otherData": {"producer": "tfdist", "clock_bound_ms": None if math.isnan(bound) else round(bound, 3)}}


def _worker_events(part: dict) -> list[dict]:
    pid, offset, index = part["rank"], part["offset"], {name: i for i, name in enumerate(part["columns"])}
    found = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"worker {pid} ({part['host']})"}},
             {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}}]
    found += [{"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": lane}}
              for lane, tid in _LANES.items()]

    def span(lane: str, name: str, start, end, **args) -> None:
        if start is not None and end is not None and end >= start:
            found.append({"ph": "X", "pid": pid, "tid": _LANES[lane], "name": name, "ts": _us(start - offset),
                          "dur": round((end - start) * 1e6, 1), "args": args})

    for row in part["rows"]:
        at = {name: row[i] for name, i in index.items()}
        step = int(at["step"]) if at["step"] is not None else -1
        span("steps", f"step {step}", at["input_start"] or at["data"], at["reduced"], step=step)
        span("input", "own input", at["input_start"], at["input_end"])
        span("input", "every worker's batch", at["input_end"], at["data"])
        span("compute", "forward", at["data"], at["first_ready"])
        span("compute", "backward", at["first_ready"], at["grads"])
        previous = None
        for b, nbytes in enumerate(part["buckets"]):
            ready, done = at.get(f"ready_{b}"), at.get(f"reduced_{b}")
            if ready is None or done is None:
                continue
            begin = max(ready, previous) if previous is not None else ready
            hidden = max(0.0, min(done, at["grads"] or begin) - begin)
            span("all-reduce", f"bucket {b}", begin, done, bytes=nbytes, hidden_ms=round(hidden * 1e3, 3),
                 exposed_ms=round((done - begin - hidden) * 1e3, 3), queued_ms=round((begin - ready) * 1e3, 3))
            previous = done
    for event in part["events"]:
        if event["end"] is None:
            found.append({"ph": "i", "s": "p", "pid": pid, "tid": _LANES["host"], "name": event["name"],
                          "ts": _us(event["start"] - offset), "args": event["args"]})
        else:
            span("host", event["name"], event["start"], event["end"], kind=event["kind"], **event["args"])
    return found


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)

