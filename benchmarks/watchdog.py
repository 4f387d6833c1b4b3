"""What does the hang watchdog cost a step? Keras fit on 2 workers, its marks on and off in alternating blocks.

The watchdog has two parts: a mark on every tf.function call on the training thread
(``tfdist.runtime_hooks.step_marks``), and a thread that wakes every S/10 s (10 s at the
default 600 s) to publish this worker's state. Timing two whole jobs (watchdog on, off)
against each other on a shared machine measures the machine's load more than the watchdog
(benchmarks/RESULTS.md has such ratios swinging from 0.56 to 0.99). So each job here runs
with the watchdog on (``TFDIST_HANG_TIMEOUT=600``) and, after a warm-up fit, alternates
blocks of ``--steps`` steps of a small CNN with the marks applied and removed (on, off, then
off, on, ...) on both workers: each pair of neighbouring blocks sees nearly the same load, and
its ratio on/off is a paired comparison. The thread cannot be taken out of a running job;
its cost is timed directly: the CPU seconds its wake-ups took per second of training.
Every pair of every round (job) is printed, then the medians (goal <= 1.01). ``--micro``
also times the mark alone, per call.

    python benchmarks/watchdog.py --rounds 3 --pairs 12 --micro
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def worker(out: str, steps: int, batch: int, pairs: int) -> None:
    """Inside a job's worker: warm up, then time ``pairs`` (on, off) pairs of fits of ``steps`` steps each."""
    import tfdist

    strategy = tfdist.get_strategy()
    import keras
    import tensorflow as tf

    from tfdist import runtime_hooks, watchdog

    wakeups = _time_wakeups(watchdog)
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
    assert watchdog.active and runtime_hooks.step_marks.applied, "the watchdog did not start"
    timed, started, cpu_before = [], time.perf_counter(), sum(wakeups)
    for index in range(pairs):
        seconds = {}
        for arm in ("on", "off") if index % 2 == 0 else ("off", "on"):
            runtime_hooks.step_marks.apply() if arm == "on" else runtime_hooks.step_marks.restore()
            start = time.perf_counter()
            model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)
            seconds[arm] = time.perf_counter() - start
        timed.append(seconds)
    runtime_hooks.step_marks.apply()
    wall = time.perf_counter() - started
    if tfdist.rank() == 0:
        pathlib.Path(out).write_text(json.dumps({"pairs": timed, "wall": wall, "wakeups": len(wakeups),
                                                 "wakeup_cpu": sum(wakeups) - cpu_before}))


def _time_wakeups(watchdog) -> list[float]:
    """Records the CPU seconds of each watchdog wake-up (its ``check``) in the returned list."""
    seconds, check = [], watchdog._Watchdog.check

    def timed(self):
        start = time.thread_time()
        try:
            return check(self)
        finally:
            seconds.append(time.thread_time() - start)

    watchdog._Watchdog.check = timed
    return seconds


def run_round(steps: int, batch: int, pairs: int) -> dict:
    """One 2-worker job with the watchdog on; worker 0's timings."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = {**os.environ, "TFDIST_HANG_TIMEOUT": "600",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "tfdist.run", "-n", "2", "--timeout", "1800", "--",
                   sys.executable, __file__, "--worker", out, "--steps", str(steps), "--batch", str(batch),
                   "--pairs", str(pairs)]
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"the benchmark job failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        return json.loads(pathlib.Path(out).read_text())


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="jobs")
    parser.add_argument("--pairs", type=int, default=12, help="(on, off) pairs of blocks per job")
    parser.add_argument("--steps", type=int, default=32, help="steps per block")
    parser.add_argument("--batch", type=int, default=64, help="per-worker batch")
    parser.add_argument("--micro", action="store_true", help="also time one marked tf.function call")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.batch, args.pairs)
        return
    ratios, off_ms, thread_share = [], [], []
    for index in range(args.rounds):
        load = os.getloadavg()[0]
        result = run_round(args.steps, args.batch, args.pairs)
        pairs = [(1000 * p["on"] / args.steps, 1000 * p["off"] / args.steps) for p in result["pairs"]]
        mine = [on / off for on, off in pairs]
        ratios += mine
        off_ms += [off for _, off in pairs]
        thread_share.append(result["wakeup_cpu"] / result["wall"])
        print(f"round {index + 1} (load average {load:.1f} at its start): on/off ms per step, each pair: "
              + ", ".join(f"{on:.1f}/{off:.1f}" for on, off in pairs), flush=True)
        print(f"  ratios: {' '.join(f'{r:.3f}' for r in mine)}; median {statistics.median(mine):.3f}; the watchdog "
              f"thread woke {result['wakeups']} times, {1000 * result['wakeup_cpu']:.1f} ms of CPU in "
              f"{result['wall']:.0f} s ({100 * thread_share[-1]:.4f}%)", flush=True)
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"marks on/off over {len(ratios)} pairs: median {statistics.median(ratios):.3f} (quartiles "
          f"{quartiles[0]:.3f} to {quartiles[2]:.3f}); median step {statistics.median(off_ms):.1f} ms with the marks "
          f"off; the thread's wake-ups: {100 * statistics.median(thread_share):.4f}% of a worker's time (median)")
    if args.micro:
        pairs = micro(5)
        for index, (marked, unmarked) in enumerate(pairs):
            print(f"micro round {index + 1}: call marked {marked:.2f} us, unmarked {unmarked:.2f} us, "
                  f"cost {marked - unmarked:+.2f} us/call")
        cost_us = statistics.median(m - u for m, u in pairs)
        step_ms = statistics.median(off_ms)
        print(f"micro: median cost {cost_us:+.2f} us per tf.function call; at one call per step (fit here makes "
              f"one per 16 steps) that is {cost_us / 10 / step_ms:.4f}% of the measured {step_ms:.1f} ms step")


if __name__ == "__main__":
    main()
