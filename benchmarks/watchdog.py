"""What does the hang watchdog cost a step? A custom loop on 2 workers, the watchdog's marks on and off step by step.

The watchdog has two parts: a mark on every tf.function call on the training thread
(``tfdist.runtime_hooks.step_marks``), and a thread that wakes every S/10 s (10 s at the
default 600 s) to publish this worker's state. Timing two whole jobs (watchdog on, off)
against each other on a shared machine measures the machine's load more than the watchdog
(benchmarks/RESULTS.md has such ratios swinging from 0.56 to 0.99). So each job here runs
with the watchdog on (``TFDIST_HANG_TIMEOUT=600``) and a custom loop of one training step per
tf.function call (the mark's worst case: ``fit`` under tfdist makes one call per 16 steps),
and applies and removes the marks between steps in the order on, off, off, on, ... on both
workers: neighbouring steps see the same load, and thousands of steps per arm give medians
that the load moves alike. The thread cannot be taken out of a running job; its cost is
timed directly: the CPU seconds its wake-ups took per second of training. Every round (job)
is printed, then the medians (goal <= 1.01); ``--control`` keeps the marks on in both arms
(an A/A run: the method's own bias on a loaded machine). ``--micro`` also times the mark
alone, per call, and the same step-by-step comparison on a 1 ms tf.function in one process.

    python benchmarks/watchdog.py --rounds 4 --steps 800 --micro
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

import fit_timing  # benchmarks/fit_timing.py: this script's folder is first on sys.path

REPO = pathlib.Path(__file__).resolve().parents[1]
ORDER = ("on", "off", "off", "on")  # the arm of step i is ORDER[i % 4]


def worker(out: str, steps: int, batch: int, control: bool = False) -> None:
    """Inside a job's worker: warm up, then time ``steps`` steps, each with the marks on or off (``ORDER``).

    ``control``: the marks stay on for every step (an A/A run: what the method reads when nothing differs).
    """
    import tfdist

    strategy = tfdist.get_strategy()
    import keras
    import tensorflow as tf

    from tfdist import runtime_hooks, watchdog

    wakeups = _time_wakeups(watchdog)
    with strategy.scope():
        model = fit_timing.small_cnn()
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
    images = tf.random.stateless_uniform((2 * batch, 32, 32, 3), seed=(1, 2))
    labels = tf.random.stateless_uniform((2 * batch,), seed=(3, 4), maxval=10, dtype=tf.int32)
    data = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)).repeat()))
    entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = entropy(y, model(x, training=True)) / (2 * batch)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    step = tf.function(lambda x, y: strategy.run(replica_step, args=(x, y)))
    for _ in range(8):  # warm-up: tracing, first steps
        step(*next(data))
    assert watchdog.active and runtime_hooks.step_marks.applied, "the watchdog did not start"
    seconds = {"on": [], "off": []}
    started, cpu_before = time.perf_counter(), sum(wakeups)
    for index in range(steps):
        arm = ORDER[index % len(ORDER)]
        runtime_hooks.step_marks.apply() if arm == "on" or control else runtime_hooks.step_marks.restore()
        batch_now = next(data)
        start = time.perf_counter()
        step(*batch_now)
        seconds[arm].append(time.perf_counter() - start)
    runtime_hooks.step_marks.apply()
    wall = time.perf_counter() - started
    if tfdist.rank() == 0:
        pathlib.Path(out).write_text(json.dumps({"seconds": seconds, "wall": wall, "wakeups": len(wakeups),
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


def run_round(steps: int, batch: int, control: bool) -> dict:
    """One 2-worker job with the watchdog on; worker 0's timings."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = {**os.environ, "TFDIST_HANG_TIMEOUT": "600",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "tfdist.run", "-n", "2", "--timeout", "1800", "--",
                   sys.executable, __file__, "--worker", out, "--steps", str(steps), "--batch", str(batch)]
        command += ["--control"] if control else []
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


def one_process(calls: int = 4000) -> list[tuple[str, float, float, float]]:
    """The marks on/off step by step (``ORDER``) on a 1 ms tf.function in this process, and an A/A control.

    Returns (kind, median marked us, median unmarked us, paired median ratio) for on/off, control, on/off, control.
    """
    import tfdist  # noqa: F401  (arms its hooks before TensorFlow's import)
    import tensorflow as tf

    from tfdist import runtime_hooks

    runtime_hooks.install()
    weights = tf.Variable(tf.random.normal((256, 256)))
    x = tf.random.normal((256, 256))
    step = tf.function(lambda: weights.assign_add(tf.matmul(x, weights) * 1e-6))
    for _ in range(20):
        step()
    results = []
    for control in (False, True, False, True):
        timed = {"on": [], "off": []}
        for index in range(calls):
            arm = ORDER[index % len(ORDER)]
            runtime_hooks.step_marks.apply() if arm == "on" or control else runtime_hooks.step_marks.restore()
            start = time.perf_counter()
            step()
            timed[arm].append(time.perf_counter() - start)
        quads = [(timed["on"][i] + timed["on"][i + 1]) / (timed["off"][i] + timed["off"][i + 1])
                 for i in range(0, calls // 2 - 1, 2)]
        results.append(("control" if control else "on/off", statistics.median(timed["on"]) * 1e6,
                        statistics.median(timed["off"]) * 1e6, statistics.median(quads)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="jobs")
    parser.add_argument("--steps", type=int, default=800, help="timed steps per job, half of them with the marks")
    parser.add_argument("--batch", type=int, default=64, help="per-worker batch")
    parser.add_argument("--micro", action="store_true", help="also time one marked tf.function call")
    parser.add_argument("--control", action="store_true",
                        help="A/A control: the marks stay on in both arms (the method's own bias)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.batch, args.control)
        return
    ratios, off_ms, thread_share = [], [], []
    for index in range(args.rounds):
        load = os.getloadavg()[0]
        result = run_round(args.steps, args.batch, args.control)
        timed = result["seconds"]
        on, off = (statistics.median(timed[arm]) * 1000 for arm in ("on", "off"))
        # each (on, off, off, on) group of 4 steps: its 2 marked steps over its 2 unmarked ones (drift cancels)
        quads = [(timed["on"][i] + timed["on"][i + 1]) / (timed["off"][i] + timed["off"][i + 1])
                 for i in range(0, min(map(len, timed.values())) - 1, 2)]
        ratios.append(statistics.median(quads))
        off_ms.append(off)
        thread_share.append(result["wakeup_cpu"] / result["wall"])
        print(f"round {index + 1} (load average {load:.1f} at its start): {len(timed['on'])} steps each, median step "
              f"with the marks {on:.2f} ms, without {off:.2f} ms; paired on/off per group of 4 steps: median "
              f"{ratios[-1]:.3f} over {len(quads)} groups (means {statistics.mean(timed['on']) * 1000:.2f} / "
              f"{statistics.mean(timed['off']) * 1000:.2f} ms); the watchdog thread woke {result['wakeups']} times, "
              f"{1000 * result['wakeup_cpu']:.1f} ms of CPU in {result['wall']:.0f} s ({100 * thread_share[-1]:.4f}%)",
              flush=True)
    print(f"marks on/off, paired, over {len(ratios)} rounds: median {statistics.median(ratios):.3f} (min "
          f"{min(ratios):.3f}, max {max(ratios):.3f}); median step {statistics.median(off_ms):.1f} ms with the marks "
          f"off; the thread's wake-ups: {100 * statistics.median(thread_share):.4f}% of a worker's time (median)")
    if args.micro:
        pairs = micro(5)
        for index, (marked, unmarked) in enumerate(pairs):
            print(f"micro round {index + 1}: call marked {marked:.2f} us, unmarked {unmarked:.2f} us, "
                  f"cost {marked - unmarked:+.2f} us/call")
        for kind, marked, unmarked, ratio in one_process():
            print(f"one process, a 1 ms tf.function, {kind}: median call {marked:.0f} us marked, {unmarked:.0f} us "
                  f"not; paired on/off {ratio:.3f}")
        cost_us = statistics.median(m - u for m, u in pairs)
        step_ms = statistics.median(off_ms)
        print(f"micro: median cost {cost_us:+.2f} us per tf.function call, {cost_us / 10 / step_ms:.4f}% of the "
              f"measured {step_ms:.1f} ms step (one call per step here; fit under tfdist makes one per 16 steps)")


if __name__ == "__main__":
    main()
