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

from tfdist import atomic_files, cluster, events, kvstore, step_clock

ENV = cluster.ENV_TIMELINE
ENV_HOROVOD = "HOROVOD_TIMELINE"
PERIOD_S = 30.0
COLLECT_S = 10.0
ROUNDS = 5
_KEY = "tfdist/timeline/"
_LANES = {"steps": 1, "input": 2, "compute": 3, "all-reduce": 4, "host": 5}

_path: str | None = None  # hvd.start_timeline's, over the environment's
_stopped = False  # hvd.stop_timeline: no timeline, whatever the environment says
_offset: float | None = None  # this worker's clock minus worker 0's (seconds), None: not measured
_bound_ms = float("nan")  # how far off that may be
_measured = False  # the measurement ran (it may have found no answer: _offset None)
_started = False
_agreed = 0  # publications every worker asks for at the same point (a fit's end, stop_timeline): how recent a part is
_renamed = False  # worker 0 moved an earlier attempt's file aside
_pid = 0  # the worker's process (a child forked from it publishes nothing: its copy would overwrite the file)
_wake = threading.Event()
_publishing = threading.Lock()
_measuring = threading.Lock()


def path() -> str | None:
    """Where worker 0 writes the timeline: ``hvd.start_timeline``'s, else TFDIST_TIMELINE, else HOROVOD_TIMELINE."""
    found = None if _stopped else _path or os.environ.get(ENV) or os.environ.get(ENV_HOROVOD)
    return os.path.abspath(found) if found else None


def set_path(value: str | None) -> None:
    """``hvd.start_timeline(path)`` / ``stop_timeline()`` (None: no timeline, even one the environment asks for).
    Steps traced from now on time each bucket, or not."""
    global _path, _stopped
    _path, _stopped = value, value is None
    step_clock.per_bucket = path() is not None


def _measure_offset(rank: int, size: int) -> tuple[float, float]:
    """This worker's clock minus worker 0's, and the estimate's bound, in seconds and ms (worker 0: (0, nan); no
    answer from worker 0 within ``COLLECT_S``: (None, nan)).

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
    return (best[1], best[0] / 2 * 1e3) if math.isfinite(best[0]) else (None, float("nan"))


def start(rank: int, size: int) -> None:
    """In a multi-worker process (once, as its strategy is built): the timeline thread, idle until a timeline is
    asked for (the environment, ``hvd.start_timeline``)."""
    global _started, _pid
    if _started or size < 2:
        return
    _started, _pid = True, os.getpid()
    step_clock.per_bucket = path() is not None
    threading.Thread(target=_publisher, args=(rank, size), name="tfdist-timeline", daemon=True).start()
    atexit.register(_publish_at_exit, rank, size)
    kvstore.before_leaving(lambda seconds: _publish_at_exit(rank, size, seconds))  # an agreed stop, a hang
    if path() is not None:
        problem = cluster.timeline_path_problem(path()) if rank == 0 else None
        if problem:  # said now, not after the training (the writes would fail at every publication)
            print(f"tfdist timeline: {problem}; no timeline will be written.", file=sys.stderr, flush=True)
        _wake.set()  # measure the clocks' offsets now, while every worker starts


def _measure_once(rank: int, size: int) -> None:
    """The clocks' offsets, the first time a timeline is asked for (every worker measures then)."""
    global _offset, _bound_ms, _measured
    with _measuring:
        if not _measured:
            _offset, _bound_ms = _measure_offset(rank, size)
            _measured = True
            attempt = os.environ.get("TFDIST_RESTART", "0")
            events.instant("job", f"attempt {attempt}: {size} workers", attempt=attempt, workers=size)


def _publish_at_exit(rank: int, size: int, seconds: float = COLLECT_S) -> None:
    """At the interpreter's exit, or before leaving with every worker (an agreed stop, a hang): the last publication;
    worker 0 waits up to ``seconds`` for every worker's last part."""
    if os.getpid() == _pid:
        publish(rank, size, final=True, collect_s=seconds)


def publish_soon(agreed: bool = False) -> None:
    """The timeline thread publishes now (not the training thread). ``agreed``: every worker asks for this one at the
    same point (a fit's end): worker 0 waits for parts at least as recent."""
    global _agreed
    _agreed += agreed
    _wake.set()


def _publisher(rank: int, size: int) -> None:
    while True:
        _wake.wait(PERIOD_S)
        _wake.clear()
        if path() is None:
            continue
        try:
            publish(rank, size)
        except Exception as error:  # noqa: BLE001  (a timeline must never stop training)
            print(f"tfdist timeline (worker {rank}): could not publish: {type(error).__name__}: {error}",
                  file=sys.stderr, flush=True)


def chunk(rank: int) -> dict:
    """This worker's part of the timeline."""
    rows = step_clock.rows()
    return {"rank": rank, "host": socket.gethostname(), "offset": _offset, "bound_ms": _bound_ms, "agreed": _agreed,
            "columns": list(step_clock.COLUMNS), "plans": step_clock.plans(),
            "rows": [[None if math.isnan(v) else v for v in row] for row in rows.tolist()],
            "events": [{"kind": e.kind, "name": e.name, "start": e.start, "end": e.end, "args": e.args}
                       for e in events.recent()]}


def publish(rank: int, size: int, final: bool = False, agreed: bool = False, collect_s: float = COLLECT_S) -> None:
    """Publishes this worker's part (its clock measured first); worker 0 then merges every worker's and writes the
    file, waiting up to ``collect_s`` for parts as recent as its own: as many agreed publications (``agreed``: one
    more, asked for by every worker at this point, as ``hvd.stop_timeline`` is), and ``final`` ones at exit."""
    global _agreed
    target = path()
    if target is None:
        return
    _agreed += agreed
    _measure_once(rank, size)
    with _publishing:  # the timeline thread, the training thread (hvd.stop_timeline) and exit may all publish
        _publish(target, rank, size, final, collect_s)


def _publish(target: str, rank: int, size: int, final: bool, collect_s: float) -> None:
    mine = {**chunk(rank), "final": final}
    kvstore.put(f"{_KEY}{rank}", json.dumps(mine))
    if rank != 0:
        return
    parts, deadline = [mine], time.monotonic() + collect_s
    for peer in range(1, size):
        part = None
        while time.monotonic() < deadline:
            value = kvstore.get(f"{_KEY}{peer}", 500)
            part = json.loads(value) if value else part
            if part is not None and part["agreed"] >= mine["agreed"] and (part["final"] or not final):
                break
            time.sleep(0.1)
        if part is not None:
            parts.append(part)
    if cluster.timeline_path_problem(target):
        return  # said at the start; a directory made since is written to
    _keep_earlier_attempt(target)
    atomic_files.write_text(target, json.dumps(_finite(trace(parts)), allow_nan=False))


def attempt_path(target: str, attempt: int) -> str:
    """Where an earlier attempt's timeline is kept once the job restarts: ``trace.json`` -> ``trace.attempt0.json``."""
    stem, suffix = os.path.splitext(target)
    return f"{stem}.attempt{attempt}{suffix}"


def _keep_earlier_attempt(target: str) -> None:
    """Worker 0 of a restarted job (``TFDIST_RESTART`` N > 0), before its first write: the file an earlier attempt
    wrote becomes ``attempt_path(target, N - 1)``; ``target`` then holds the latest attempt."""
    global _renamed
    attempt = int(os.environ.get("TFDIST_RESTART", "0") or 0)
    if not _renamed and attempt > 0 and os.path.exists(target):
        os.replace(target, attempt_path(target, attempt - 1))
    _renamed = True


def trace(parts: list[dict]) -> dict:
    """The Chrome trace (``traceEvents``) of every worker's part."""
    found = []
    for part in sorted(parts, key=lambda p: p["rank"]):
        found += _worker_events(part)
    bound = max((p["bound_ms"] for p in parts if p["bound_ms"] is not None and math.isfinite(p["bound_ms"])),
                default=None)
    return {"traceEvents": found, "displayTimeUnit": "ms",
            "otherData": {"producer": "tfdist", "clock_bound_ms": None if bound is None else round(bound, 3),
                          "clock_offsets_ms": {str(p["rank"]): None if p["offset"] is None else
                                               round(p["offset"] * 1e3, 3) for p in parts},
                          "clock_unmeasured": [p["rank"] for p in parts if p["offset"] is None]}}


def _worker_events(part: dict) -> list[dict]:
    pid, offset, index = part["rank"], part["offset"] or 0.0, {name: i for i, name in enumerate(part["columns"])}
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
        plan = part["plans"][int(at["plan"])] if at.get("plan") is not None else []
        for b, nbytes in enumerate(plan):
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


def _finite(value):
    """``value`` (JSON data) with every NaN or infinity made null: JSON has neither (Perfetto's parser refuses them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)

