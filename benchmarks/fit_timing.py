"""A Keras fit job timed on 2 workers, and alternating on/off rounds of it (``benchmarks/preemption.py``).

``worker`` runs inside each worker of a ``tfdist run -n 2`` job: a small CNN, a warm-up fit, then
``steps`` steps timed (worker 0 writes the seconds). ``alternate`` runs pairs of jobs, a feature on
and off, in alternating order, and prints every round's ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import time
from typing import Callable


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Milliseconds per training step of one job (worker 0's clock)."""

    name: str
    steps: int
    seconds: float

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.seconds / self.steps


def small_cnn():
    """The benchmarks' small CNN (32x32x3 images, 10 classes), built in the current scope."""
    import keras

    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])


def worker(out: str, steps: int, batch: int, data_autotune: bool = True) -> None:
    """Inside a job's worker: warm up, then time ``steps`` steps of fit. ``data_autotune=False`` turns tf.data's
    autotune off on the job's dataset: each fit then runs in the fast mode (UPSTREAM.md: with it, a job lands in
    a fast or a slow mode at random, which swamps a paired comparison)."""
    import tfdist

    strategy = tfdist.get_strategy()
    import keras
    import tensorflow as tf

    with strategy.scope():
        model = small_cnn()
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    images = tf.random.stateless_uniform((batch, 32, 32, 3), seed=(1, 2))
    labels = tf.random.stateless_uniform((batch,), seed=(3, 4), maxval=10, dtype=tf.int32)
    dataset = tf.data.Dataset.from_tensors((images, labels)).repeat()
    if not data_autotune:
        options = tf.data.Options()
        options.autotune.enabled = False
        dataset = dataset.with_options(options)
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)  # warm-up: tracing, first steps
    start = time.perf_counter()
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)
    seconds = time.perf_counter() - start
    if tfdist.rank() == 0:
        pathlib.Path(out).write_text(json.dumps({"seconds": seconds}))


def job_parser(description: str, steps: int) -> argparse.ArgumentParser:
    """The arguments every on/off job benchmark takes: rounds, steps, batch, and the hidden ones its workers get
    (``--worker OUT`` and ``--on``/``--off``)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch", type=int, default=64, help="per-worker batch")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--on", dest="on", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--off", dest="on", action="store_false", help=argparse.SUPPRESS)
    return parser


def alternate(rounds: int, run: Callable[[bool], StepTime], what: str) -> tuple[list[float], list[float]]:
    """``rounds`` pairs of jobs, ``run(True)`` (on) and ``run(False)`` (off) in alternating order; prints
    each round's on/off ratio and a summary; returns (ratios, off ms/step)."""
    ratios, off_ms = [], []
    for index in range(rounds):
        order = [True, False] if index % 2 == 0 else [False, True]
        times = {on: run(on) for on in order}
        ratios.append(times[True].ms_per_step / times[False].ms_per_step)
        off_ms.append(times[False].ms_per_step)
        print(f"round {index + 1}: {what}on {times[True].ms_per_step:.2f} ms/step, off {times[False].ms_per_step:.2f} "
              f"ms/step, on/off {ratios[-1]:.3f} (first: {'on' if order[0] else 'off'})", flush=True)
    if ratios:
        print(f"on/off over {len(ratios)} rounds: median {statistics.median(ratios):.3f}, "
              f"mean {statistics.mean(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}")
    return ratios, off_ms
