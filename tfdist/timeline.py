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

The timeline thread starts with each worker's multi-worker strategy and sleeps until a timeline is
asked for (the variables, or ``hvd.start_timeline`` at any time). Steps come from ``tfdist.step_clock`` (its ring: the last ``RING_STEPS`` steps of each worker),
host events from ``tfdist.events``. Each worker's timeline thread publishes its part in the
coordination service's store after every ``fit`` and every ``PERIOD_S`` seconds (and at exit);
worker 0's merges them and rewrites FILE (atomically): a days-long job keeps a bounded file of its
latest steps, and training never waits for it.

Clocks: each worker's times are wall-clock seconds of its own host. When a timeline is first asked
for, each worker measures its clock's offset from worker 0's through the store, as NTP does
(``_measure_offset``); every time is shifted by its worker's offset. The trace says by how much
(``otherData.clock_offsets_ms``) and how close that is (``otherData.clock_bound_ms``: half the
quickest round trip to worker 0; a few milliseconds on one machine or a fast network).
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
ROUNDS = 5
_KEY = "tfdist/timeline/"
_LANES = {"steps": 1, "input": 2, "compute": 3, "all-reduce": 4, "host": 5}

_path: str | None = None  # hvd.start_timeline's, over the environment's
_offset: float | None = None  # this worker's clock minus worker 0's (seconds), once measured
_bound_ms = float("nan")  # how far off that may be
_started = False
_fits = 0  # fits ended so far (every worker's the same count): how recent a part is
_wake = threading.Event()
_publishing = threading.Lock()
_measuring = threading.Lock()


def path() -> str | None:
    """Where worker 0 writes the timeline: ``hvd.start_timeline``'s, else TFDIST_TIMELINE, else HOROVOD_TIMELINE."""
    found = _path or os.environ.get(ENV) or os.environ.get(ENV_HOROVOD)
    return os.path.abspath(found) if found else None


def set_path(value: str | None) -> None:
    """``hvd.start_timeline(path)`` / ``stop_timeline()`` (None). Steps traced from now on time each bucket."""
    global _path
    _path = value
    step_clock.per_bucket = path() is not None


def _measure_offset(rank: int, size: int) -> tuple[float, float]:
    """This worker's clock minus worker 0's, and the estimate's bound, in seconds and ms (worker 0: (0, nan)).

    Through the store, as NTP does: a worker asks worker 0 for its clock ``ROUNDS`` times; worker 0's
    timeline thread answers each ask as it reads it. An answer read ``rtt`` after the ask was taken
    within that window, so the estimate from the middle of the window is off by at most ``rtt / 2``;
    the round with the shortest ``rtt`` is kept.
    """
    deadline = time.monotonic() + COLLECT_S
    if rank == 0:
        for peer in range(1, size):
            for round_ in range(ROUNDS):
                if kvstore.wait_for(f"{_KEY}clock/{peer}/{round_}/ask", deadline) is None:
                    break
                kvstore.put(f"{_KEY}clock/{peer}/{round_}/answer", repr(time.time()))
        return 0.0, float("nan")
    best = (float("inf"), 0.0)
    for round_ in range(ROUNDS):
        sent = time.time()
        kvstore.put(f"{_KEY}clock/{rank}/{round_}/ask", "1")
        answer = kvstore.wait_for(f"{_KEY}clock/{rank}/{round_}/answer", deadline)
        got = time.time()
        if answer is None:
            break
        best = min(best, (got - sent, (sent + got) / 2 - float(answer)))
    return best[1], best[0] / 2 * 1e3


def start(rank: int, size: int) -> None:
    """In a multi-worker process (once, as its strategy is built): the timeline thread, idle until a timeline is
    asked for (the environment, ``hvd.start_timeline``)."""
    global _started
    if _started or size < 2:
        return
    _started = True
    step_clock.per_bucket = path() is not None
    threading.Thread(target=_publisher, args=(rank, size), name="tfdist-timeline", daemon=True).start()
    atexit.register(_publish_at_exit, rank, size)
    if path() is not None:
        _wake.set()  # measure the clocks' offsets now, while every worker starts


def _measure_once(rank: int, size: int) -> None:
    """The clocks' offsets, the first time a timeline is asked for (every worker measures then)."""
    global _offset, _bound_ms
    with _measuring:
        if _offset is None:
            _offset, _bound_ms = _measure_offset(rank, size)
            attempt = os.environ.get("TFDIST_RESTART", "0")
            events.instant("job", f"attempt {attempt}: {size} workers", attempt=attempt, workers=size)


def _publish_at_exit(rank: int, size: int) -> None:
    """At the interpreter's exit: the last publication (a script that ends within ``PERIOD_S`` writes its file);
    worker 0 waits for every worker's last part."""
    if path() is not None:
        _measure_once(rank, size)
        publish(rank, size, final=True)


def publish_soon(fits: int | None = None) -> None:
    """The timeline thread publishes now (not the training thread): after ``fits`` fits, or a new timeline path."""
    global _fits
    _fits = _fits if fits is None else fits
    _wake.set()


def _publisher(rank: int, size: int) -> None:
    while True:
        _wake.wait(PERIOD_S)
        _wake.clear()
        if path() is None:
            continue
        try:
            _measure_once(rank, size)
            publish(rank, size)
        except Exception as error:  # noqa: BLE001  (a timeline must never stop training)
            print(f"tfdist timeline (worker {rank}): could not publish: {type(error).__name__}: {error}",
                  file=sys.stderr, flush=True)


def chunk(rank: int) -> dict:
    """This worker's part of the timeline."""
    rows = step_clock.rows()
    return {"rank": rank, "host": socket.gethostname(), "offset": _offset or 0.0, "bound_ms": _bound_ms, "fits": _fits,
            "columns": list(step_clock.COLUMNS), "buckets": step_clock.bucket_bytes(),
            "rows": [[None if math.isnan(v) else v for v in row] for row in rows.tolist()],
            "events": [{"kind": e.kind, "name": e.name, "start": e.start, "end": e.end, "args": e.args}
                       for e in events.recent()]}


def publish(rank: int, size: int, final: bool = False) -> None:
    """Publishes this worker's part; worker 0 then merges every worker's (waiting up to ``COLLECT_S`` for parts as
    recent as its own: the same number of fits, or ``final`` ones: each worker's last, at exit) and writes the file."""
    target = path()
    if target is None:
        return
    with _publishing:  # the timeline thread, the training thread (hvd.stop_timeline) and exit may all publish
        _publish(target, rank, size, final)


def _publish(target: str, rank: int, size: int, final: bool) -> None:
    mine = {**chunk(rank), "final": final}
    kvstore.put(f"{_KEY}{rank}", json.dumps(mine))
    if rank != 0:
        return
    parts, deadline = [mine], time.monotonic() + COLLECT_S
    for peer in range(1, size):
        part = None
        while time.monotonic() < deadline:
            value = kvstore.get(f"{_KEY}{peer}", 500)
            part = json.loads(value) if value else part
            if part is not None and part["fits"] >= mine["fits"] and (part["final"] or not final):
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
            "otherData": {"producer": "tfdist", "clock_bound_ms": None if math.isnan(bound) else round(bound, 3),
                          "clock_offsets_ms": {str(p["rank"]): round(p["offset"] * 1e3, 3) for p in parts}}}


def _worker_events(part: dict) -> list[dict]:
    pid, offset, index = part["rank"], part["offset"], {name: i for i, name in enumerate(part["columns"])}
    found = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"worker {pid} ({part['host']})"}},
             {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}}]
    found += [{"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": lane}}
              for lane, tid in _LANES.items()]

    def span(lane: str, name: str, start, end, **args) -> None:
        if start is not None and end is not None:  # clock reads run a little late at times: never below 0
            found.append({"ph": "X", "pid": pid, "tid": _LANES[lane], "name": name, "ts": _us(start - offset),
                          "dur": round(max(0.0, end - start) * 1e6, 1), "args": args})

    for row in part["rows"]:
        at = {name: row[i] for name, i in index.items()}
        step = int(at["step"]) if at["step"] is not None else -1
        span("steps", f"step {step}", at["input_start"] or at["data"] or at["first_ready"], at["reduced"], step=step)
        span("input", "own input", at["input_start"], at["input_end"])
        span("input", "every worker's batch", at["input_end"], at["data"])
        span("compute", "forward", at["data"], at["first_ready"])
        span("compute", "backward", at["first_ready"], at["grads"])
        previous = None
        for b, nbytes in enumerate(part["buckets"]):
            ready, done = at.get(f"ready_{b}"), at.get(f"reduced_{b}")
            if ready is None or done is None:
                continue
            begin = min(max(ready, previous if previous is not None else ready), done)
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

