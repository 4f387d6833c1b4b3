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
import socket
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

_KEY = "tfdist/report/"
COLLECT_S = 10.0  # how long worker 0 waits for a worker's medians
_fits = 0  # multi-worker fits so far in this process: the same count on every worker


def _job(model) -> tuple[int, int] | None:
    """(rank, workers) of ``model``'s multi-worker strategy, or None."""
    strategy = model.distribute_strategy
    workers = process_group.num_workers(strategy)
    return (process_group.worker_rank(strategy), workers) if workers > 1 else None


@patch.replaces(CallbackList, "on_train_begin", ("self", "logs"))
def _first_step(original, self, logs=None):
    global _fits
    original(self, logs)
    job = _job(self.model)
    if job is not None:
        _fits += 1
        self._tfdist_fit, self._tfdist_first_step = _fits, step_clock.count()


@patch.replaces(CallbackList, "on_epoch_begin", ("self", "epoch", "logs"))
def _epoch_first_step(original, self, epoch, logs=None):
    original(self, epoch, logs)
    self._tfdist_epoch_first_step = step_clock.count() if _job(self.model) is not None else 0


@patch.replaces(CallbackList, "on_epoch_end", ("self", "epoch", "logs"))
def _per_worker_scalars(original, self, epoch, logs=None):
    original(self, epoch, logs)
    job = _job(self.model)
    boards = [c for c in self.callbacks if isinstance(c, TensorBoard)]
    if job is None or not boards:
        return
    summaries = _gather(f"{self._tfdist_fit}/epoch-{epoch}", *job, since=self._tfdist_epoch_first_step)
    writer = getattr(boards[0], "_train_writer", None)
    if job[0] != 0 or writer is None:
        return
    with writer.as_default():
        for s in summaries:
            for name, value in (("step_ms", s.step_ms), ("input_ms", s.input_ms), ("compute_ms", s.compute_ms)):
                tf.summary.scalar(f"tfdist/worker_{s.rank}/{name}", value, step=epoch)
    writer.flush()


@patch.replaces(CallbackList, "on_train_end", ("self", "logs"))
def _report(original, self, logs=None):
    original(self, logs)
    job = _job(self.model)
    if job is None:
        return
    rank, size = job
    summaries = _gather(str(self._tfdist_fit), rank, size, since=self._tfdist_first_step)
    if rank == 0:
        for line in stragglers.report(summaries, size, "fit"):
            print(line, file=sys.stderr, flush=True)
            events.instant("report", line)
    timeline.publish_soon(self._tfdist_fit)


def _gather(tag: str, rank: int, size: int, since: int) -> list[stragglers.Summary]:
    """Publishes this worker's medians of its steps numbered ``since`` on; on worker 0, everyone's it finds."""
    mine = stragglers.summarize(step_clock.rows(since), step_clock.INDEX, rank, socket.gethostname())
    kvstore.put(f"{_KEY}{tag}/{rank}", json.dumps(None if mine is None else mine.__dict__))
    if rank != 0:
        return []
    deadline = time.monotonic() + COLLECT_S
    found = [mine] if mine is not None else []
    for peer in range(1, size):
        value = kvstore.wait_for(f"{_KEY}{tag}/{peer}", deadline)
        if value and value != "null":
            found.append(stragglers.Summary(**json.loads(value)))
    return found
