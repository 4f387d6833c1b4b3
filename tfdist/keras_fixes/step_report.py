"""What each worker's steps took, told at the end of a multi-worker ``fit``: the straggler report, the
timeline, and per-worker step times for TensorBoard (``tfdist.stragglers``, ``tfdist.timeline``).

Under a multi-worker strategy (each worker's times from ``tfdist.step_clock``):

* at ``fit``'s end every worker publishes its medians over that ``fit``'s steps, and worker 0
  prints one line: the step time and either "no straggler" or the worker(s) whose own work
  (input and compute) takes over 15% longer than the fastest worker's, and why; the line is in the
  timeline too. With a timeline (``TFDIST_TIMELINE``), every worker's timeline thread then
  publishes its part and worker 0's writes the file (``tfdist.timeline``);
* with a ``keras.callbacks.TensorBoard`` in the callbacks, at each epoch's end worker 0 writes each
  worker's median step time, input wait and compute time as scalars (``tfdist/worker_R/...``) into
  its training logs.
"""

from __future__ import annotations

import json
import sys
import time

import tensorflow as tf
from keras.src.callbacks.callback_list import CallbackList
from keras.src.callbacks.tensorboard import TensorBoard

from tfdist import events, kvstore, process_group, step_clock, stragglers, timeline
from tfdist.patching import Patch

patch = Patch(
    "step_report", "tfdist: which worker is slow",
    without="a multi-worker fit does not say which worker is slower than the others, writes no timeline, and "
            "gives TensorBoard no per-worker step times.")

_KEY = "tfdist/report/"  # + "fit/<rank>" and "epochs/<rank>": one key a worker, each holding its latest
COLLECT_S = 10.0  # how long worker 0 waits at a fit's end for a worker's medians
_EPOCHS_KEPT = 4  # epochs a worker's "epochs" key holds: worker 0 writes a late one at a later epoch's end
_GLANCE_MS = 1  # an epoch end's read of a peer's epochs, not waiting for them (a late one is written later)
_fits = 0  # multi-worker fits so far in this process: the same count on every worker


def _job(callbacks: CallbackList) -> tuple[int, int] | None:
    """(rank, workers) of the multi-worker strategy of the model ``callbacks`` serve, or None."""
    model = getattr(callbacks, "_model", None)
    if model is None:
        return None
    strategy = model.distribute_strategy
    workers = process_group.num_workers(strategy)
    return (process_group.worker_rank(strategy), workers) if workers > 1 else None


@patch.replaces(CallbackList, "on_train_begin", ("self", "logs"))
def _first_step(original, self, logs=None):
    global _fits
    original(self, logs)
    if _job(self) is not None:
        _fits += 1
        self._tfdist_fit, self._tfdist_first_step = _fits, step_clock.count()
        self._tfdist_epochs, self._tfdist_written = {}, set()


@patch.replaces(CallbackList, "on_epoch_begin", ("self", "epoch", "logs"))
def _epoch_first_step(original, self, epoch, logs=None):
    original(self, epoch, logs)
    self._tfdist_epoch_first_step = step_clock.count()


@patch.replaces(CallbackList, "on_epoch_end", ("self", "epoch", "logs"))
def _per_worker_scalars(original, self, epoch, logs=None):
    """Every worker publishes the epoch's medians (TensorBoard or not: only worker 0's callbacks matter); worker 0
    writes those it finds, without waiting (a worker's late epoch is written at a later epoch's end)."""
    original(self, epoch, logs)
    job, fit = _job(self), getattr(self, "_tfdist_fit", None)
    if job is None or fit is None:
        return
    rank, size = job
    mine = stragglers.own(rank, getattr(self, "_tfdist_epoch_first_step", self._tfdist_first_step))
    epochs = self._tfdist_epochs
    epochs[str(epoch)] = None if mine is None else mine.__dict__
    for old in sorted(epochs, key=int)[:-_EPOCHS_KEPT]:
        del epochs[old]
    kvstore.put(f"{_KEY}epochs/{rank}", json.dumps({"fit": fit, "epochs": epochs}))
    if rank == 0:
        _write_scalars(self, size, glance=True)


@patch.replaces(CallbackList, "on_train_end", ("self", "logs"))
def _report(original, self, logs=None):
    """Gathers before the callbacks' own ends (TensorBoard closes its writers there), prints after."""
    job, fit = _job(self), getattr(self, "_tfdist_fit", None)
    lines = []
    if job is not None and fit is not None:
        lines = _gather_fit(self, fit, *job)
    original(self, logs)
    for line in lines:
        print(line, file=sys.stderr, flush=True)
        events.instant("report", line)
    if job is not None and fit is not None:
        timeline.publish_soon(agreed=True)


def _gather_fit(callbacks: CallbackList, fit: int, rank: int, size: int) -> list[str]:
    """Every worker publishes its medians over the fit; worker 0 gathers them (and the epochs a worker published
    late, for TensorBoard) and returns the report's lines."""
    mine = stragglers.own(rank, callbacks._tfdist_first_step)
    kvstore.put(f"{_KEY}fit/{rank}", json.dumps({"fit": fit, "summary": None if mine is None else mine.__dict__}))
    if rank != 0:
        return []
    deadline = time.monotonic() + COLLECT_S
    found = [mine] if mine is not None else []
    for peer in range(1, size):
        value = _of_this_fit(f"{_KEY}fit/{peer}", fit, deadline)
        if value and value["summary"]:
            found.append(stragglers.Summary(**value["summary"]))
    _write_scalars(callbacks, size, glance=False)  # a worker's last epoch: published by now
    return stragglers.report(found, size, "fit")


def _of_this_fit(key: str, fit: int, deadline: float, glance: bool = False) -> dict | None:
    """The value of a worker's ``key`` once it is about ``fit`` (None at ``deadline``; one read, long enough for a
    key that is there, when it has passed); ``glance``: one read that does not wait for a loaded store."""
    while True:
        value = kvstore.get(key, _GLANCE_MS) if glance else kvstore.wait_for(key, deadline)
        decoded = json.loads(value) if value else None
        if (decoded and decoded["fit"] == fit) or time.monotonic() >= deadline:
            return decoded if decoded and decoded["fit"] == fit else None
        time.sleep(0.05)  # an earlier fit's value: the worker has not published this one yet


def _write_scalars(callbacks: CallbackList, size: int, glance: bool) -> None:
    """On worker 0 with a TensorBoard: each worker's epoch medians it has not written yet, as scalars (``glance``:
    without waiting for the store, at an epoch's end)."""
    boards = [c for c in callbacks.callbacks if isinstance(c, TensorBoard)]
    writer = getattr(boards[0], "_train_writer", None) if boards else None
    if writer is None:
        return
    written = callbacks._tfdist_written
    with writer.as_default():
        for peer in range(size):
            value = _of_this_fit(f"{_KEY}epochs/{peer}", callbacks._tfdist_fit, time.monotonic(), glance)
            for epoch, summary in (value["epochs"] if value else {}).items():
                if summary is None or (peer, epoch) in written:
                    continue
                written.add((peer, epoch))
                for name in ("step_ms", "input_ms", "compute_ms"):
                    tf.summary.scalar(f"tfdist/worker_{peer}/{name}", summary[name], step=int(epoch))
    writer.flush()
