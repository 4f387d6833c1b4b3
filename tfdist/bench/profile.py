"""``tfdist bench --mode profile``: where a training step's time goes.

Four figures per step, each measured on its own in the same worker processes:

* ``step_ms``: one step of ``fit`` under the strategy, as the benchmark timed it;
* ``compute_ms``: the same model's training step on one replica's batch, with no
  strategy (forward, backward and update, nothing shared);
* ``allreduce_ms``: the strategy's all-reduce of a buffer the size of the gradients, plus
  the one small all-reduce of the logged values Keras makes every step;
* ``input_ms``: fetching one batch from the input pipeline alone (0 for synthetic data);
* ``hidden_ms`` and ``exposed_ms`` (several replicas): from a profiler trace of a few
  training steps on the chief, the collective time per step that ran under compute (hidden
  by the overlap of gradient buckets with the backward pass) and alone (exposed: waited for).
  See ``tfdist.bench.trace``.

``other_ms`` is what is left: dispatch, waiting for the slowest worker, copies. Input
overlaps compute when the pipeline prefetches, so it is shown apart, not subtracted.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time

import tensorflow as tf

from tfdist import collectives
from tfdist.bench import trace
from tfdist.bench.config import JsonRecord

_CALLS = 20  # timed calls of each collective


@dataclasses.dataclass(frozen=True)
class StepBreakdown(JsonRecord):
    """Milliseconds per training step, by part (see the module docstring)."""

    step_ms: float
    compute_ms: float
    allreduce_ms: float
    input_ms: float
    hidden_ms: float = 0.0
    exposed_ms: float = 0.0

    @property
    def other_ms(self) -> float:
        return self.step_ms - self.compute_ms - self.allreduce_ms

    def describe(self) -> str:
        """One parseable line: ``step 31.2 ms = compute 22.9 + all-reduce 4.1 + other 4.2 (input 0.0, overlapped);
        in training, all-reduce 3.0 hidden under compute + 1.1 exposed``."""
        return (f"step {self.step_ms:.1f} ms = compute {self.compute_ms:.1f} + all-reduce {self.allreduce_ms:.1f} "
                f"+ other {self.other_ms:.1f} (input {self.input_ms:.1f}, overlapped); in training, all-reduce "
                f"{self.hidden_ms:.1f} hidden under compute + {self.exposed_ms:.1f} exposed")


def compute_ms(build_model, compile_kwargs: dict, batch: tuple, steps: int) -> float:
    """Training step time of a fresh model on ``batch`` with no strategy (the per-replica compute).

    Call it outside any strategy scope.
    """
    model = build_model()
    model.compile(**compile_kwargs, steps_per_execution=steps)
    options = tf.data.Options()
    options.autotune.enabled = False  # nothing to tune; on a worker pinned to one core its thread takes CPU
    dataset = tf.data.Dataset.from_tensors(batch).repeat().with_options(options)
    model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)  # tracing
    start = time.perf_counter()
    model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
    return 1000 * (time.perf_counter() - start) / steps


def allreduce_ms(strategy: tf.distribute.Strategy, variables, num_logged: int) -> float:
    """One step's collectives: the gradients (packed as Keras packs them) and the logged values."""
    gradients = [tf.zeros(v.shape, v.dtype) for v in variables]
    logged = tf.zeros([num_logged])

    @tf.function
    def reduce_once():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            return context.all_reduce("SUM", gradients), context.all_reduce("SUM", logged)
        return strategy.run(replica_fn)

    reduce_once()
    start = time.perf_counter()
    for _ in range(_CALLS):
        reduce_once()
    return 1000 * (time.perf_counter() - start) / _CALLS


def input_ms(records_per_sec: float | None, batch_per_worker: int) -> float:
    """Milliseconds for the pipeline alone to produce one worker's batch (0 when it costs nothing)."""
    return 0.0 if not records_per_sec else 1000 * batch_per_worker / records_per_sec



def traced_overlap(model, dataset, steps: int) -> trace.CollectiveOverlap | None:
    """Per-step hidden and exposed collective time of ``steps`` more ``fit`` steps, from a profiler trace.

    Only the chief (worker 0, the collectives' group leader) traces; it alone reports. The other
    workers of a multi-worker strategy run the same steps untraced, for their collectives to meet the
    chief's, and return None: TensorFlow 2.21's profiler crashes them at ``stop()`` now and then (8 of
    90 traces of 2 to 16 steps on 2 cores). On such a worker each collective's
    ``CollectiveExecutor::CompleteParams`` activity starts on a collective_ops thread and ends on a
    gRPC thread. ``TraceMeRecorder::Consume`` keeps a pointer to each end it reads before the start,
    into the ending thread's list of events, which it moves into a growing vector; the vector's growth
    copies the lists and frees the old ones, and the pass that joins starts to ends then writes through
    those pointers into freed memory (SIGSEGV, or a glibc abort such as "double free or corruption").
    On the chief every activity ends on the thread that started it.
    """
    if collectives.worker_rank(model.distribute_strategy) != 0:
        model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
        return None
    logdir = tempfile.mkdtemp(prefix="tfdist-trace-")
    try:
        tf.profiler.experimental.start(logdir)
        try:
            model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
        finally:
            tf.profiler.experimental.stop()
        return trace.collective_overlap(logdir).per_step(steps)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
