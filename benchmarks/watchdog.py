"""What does the hang watchdog cost a step? Keras fit on 2 workers with TFDIST_HANG_TIMEOUT=600 vs 0.

Each round starts two 2-worker jobs through ``tfdist run``, one with the watchdog on (600 s, the
default) and one with it off (0), in alternating order; each job times ``--steps`` steps of a small
CNN after a warm-up fit (tracing timed apart) and reports ms/step. Every round prints its ratio
on/off (goal <= 1.01). ``--micro`` also times the mark alone (what the watchdog adds to each
tf.function call on the training thread; its thread wakes every S/10 s, off that thread).

    python benchmarks/watchdog.py --rounds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

REPO = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Milliseconds per training step of one job (worker 0's clock)."""

    name: str
    steps: int
    seconds: float

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.seconds / self.steps


def worker(out: str, steps: int, batch: int) -> None:
    """Inside a job's worker: warm up, then time ``steps`` steps of fit."""
    import tfdist

    strategy = tfdist.get_strategy()
    import keras
    import tensorflow as tf

    with strategy.scope():
        model = keras.Sequential([
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    images = tf.random.stateless_uniform((batch, 32, 32, 3), seed=(1, 2))
    labels = tf.random.stateless_uniform((batch,), seed=(3, 4), maxval=10, dtype=tf.int32)
    dataset = tf.data.Dataset.from_tensors((images, labels)).repeat()
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)  # warm-up: tracing, first steps
    start = time.perf_counter()
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)
    seconds = time.perf_counter() - start
    if tfdist.rank() == 0:
        pathlib.Path(out).write_text(json.dumps({"seconds": seconds}))


def run_job(name: str, hang_timeout: str, steps: int, batch: int) -> StepTime:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = {**os.environ, "TFDIST_HANG_TIMEOUT": hang_timeout,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "tfdist.run", "-n", "2", "--timeout", "900", "--",
                   sys.executable, __file__, "--worker", out, "--steps", str(steps), "--batch", str(batch)]
        subprocess.run(command, env=env, check=True, capture_output=True)
        return StepTime(name, steps, json.loads(pathlib.Path(out).read_text())["seconds"])


def micro(rounds: int) -> list[tuple[float, float]]:
    """(marked, unmarked) microseconds per call of a do-nothing callable, with and without the watchdog's mark.

    The mark is ``tfdist.runtime_hooks``' replacement of ``tf.function.__call__`` applied through the
    same ``tfdist.patching.Patch`` machinery to a stand-in class, so the difference is exactly what
    the mark adds to every tf.function call on the training thread (TensorFlow's own call, hundreds
    of microseconds on a loaded machine, would drown it). Fastest of 5 repeats of 100,000 calls.
    """
    import timeit

    import tfdist  # noqa: F401  (arms its hooks before TensorFlow's import)
    import tensorflow  # noqa: F401
    from tfdist import patching, runtime_hooks

    class StandIn:
        def __call__(self, *args, **kwds):
            return None

    patch = patching.Patch("benchmark", "benchmark", without="", library="tensorflow")
    patch.replaces(StandIn, "__call__", ("self", "args", "kwds"))(runtime_hooks._call_function)
    call = StandIn()
    results = []
    for _ in range(rounds):
        best = {}
        for marked in (True, False):
            patch.apply() if marked else patch.restore()
            best[marked] = min(timeit.repeat(call, number=100_000, repeat=5)) * 1e6 / 100_000
        results.append((best[True], best[False]))
    return results


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64, help="per-worker batch")
    parser.add_argument("--micro", action="store_true", help="also time one marked tf.function call")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.batch)
        return
    ratios, off_ms = alternate(args.rounds, lambda on: run_job("on" if on else "off", "600" if on else "0",
                                                             args.steps, args.batch), "watchdog ")
    if args.micro:
        pairs = micro(5)
        for index, (marked, unmarked) in enumerate(pairs):
            print(f"micro round {index + 1}: call marked {marked:.2f} us, unmarked {unmarked:.2f} us, "
                  f"cost {marked - unmarked:+.2f} us/call")
        cost_us = statistics.median(m - u for m, u in pairs)
        step_ms = statistics.median(off_ms) if off_ms else float("nan")
        print(f"micro: median cost {cost_us:+.2f} us per call; at one call per step (fit here makes one per "
              f"16 steps) that is {cost_us / 10 / step_ms:.4f}% of a {step_ms:.1f} ms step")


if __name__ == "__main__":
    main()
