"""What does the agreed stop (tfdist.preemption) cost a step? Keras fit on 2 workers, on vs off.

Each round starts two 2-worker jobs through ``tfdist run`` in alternating order, the job of
``benchmarks/fit_timing.py`` (a small CNN, ``--steps`` steps timed after a warm-up fit): one
as tfdist ships it (the batch-end check on, its stop thread awake 10 times a second and
reading the coordination service once a second) and one with no stop thread, no stop signals
handled and ``tfdist.keras_fixes.preemption``'s patch restored (off). Every round prints its ratio on/off (goal <= 1.01). ``--micro`` also
times the check alone: the patched ``CallbackList.on_train_batch_end`` of a fit with no
callbacks, patched vs Keras' own, on the training thread.

    python benchmarks/preemption.py --rounds 4 --micro
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import fit_timing as same_job  # noqa: E402  (benchmarks/fit_timing.py: the job and its StepTime)

REPO = pathlib.Path(__file__).resolve().parents[1]


def worker(out: str, steps: int, batch: int, on: bool) -> None:
    if not on:
        import tfdist
        from tfdist import preemption as plane

        plane.start = lambda rank, size: False  # no stop thread, no handlers
        tfdist.get_strategy()  # first, as same_job.worker does: TensorFlow must not start before it
        import keras  # noqa: F401  (tfdist's Keras fixes apply now; then this one is taken off)
        from tfdist.keras_fixes import preemption

        preemption.patch.restore()
    same_job.worker(out, steps, batch, data_autotune=False)


def run_job(on: bool, steps: int, batch: int) -> same_job.StepTime:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = {**os.environ, "TFDIST_STOP_SIGNALS": "SIGTERM,SIGUSR1" if on else "",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "tfdist.run", "-n", "2", "--timeout", "900", "--",
                   sys.executable, __file__, "--worker", out, "--steps", str(steps), "--batch", str(batch),
                   "--on" if on else "--off"]
        subprocess.run(command, env=env, check=True, capture_output=True)
        return same_job.StepTime("on" if on else "off", steps, json.loads(pathlib.Path(out).read_text())["seconds"])


def micro(rounds: int) -> list[tuple[float, float]]:
    """(patched, Keras') microseconds per ``CallbackList.on_train_batch_end`` of a fit with no callbacks."""
    import timeit

    import tfdist  # noqa: F401  (arms its hooks before Keras' import)
    import keras
    from keras.src.callbacks.callback_list import CallbackList
    from tfdist.keras_fixes import preemption

    from tfdist import preemption as plane

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.stop_training = False  # as fit sets it
    callbacks = CallbackList([], model=model)
    plane.begin_fit(of_the_job=False)  # a fit's session is open, as during fit
    results = []
    for _ in range(rounds):
        best = {}
        for on in (True, False):
            preemption.patch.apply() if on else preemption.patch.restore()
            best[on] = min(timeit.repeat(lambda: callbacks.on_train_batch_end(0, None), number=100_000,
                                         repeat=5)) * 1e6 / 100_000
        results.append((best[True], best[False]))
    return results


def main() -> None:
    parser = same_job.job_parser(__doc__, steps=160)
    parser.add_argument("--micro", action="store_true", help="also time the batch-end check alone")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.batch, args.on)
        return
    _, off_ms = same_job.alternate(args.rounds, lambda on: run_job(on, args.steps, args.batch), "")
    if args.micro:
        pairs = micro(5)
        for index, (on, off) in enumerate(pairs):
            print(f"micro round {index + 1}: batch end patched {on:.3f} us, Keras' {off:.3f} us, "
                  f"cost {on - off:+.3f} us")
        cost_us = statistics.median(on - off for on, off in pairs)
        step_ms = statistics.median(off_ms) if off_ms else float("nan")
        print(f"micro: median cost {cost_us:+.3f} us per batch end; that is {cost_us / 10 / step_ms:.5f}% of a "
              f"{step_ms:.1f} ms step (fit makes one batch end per call of steps_per_execution steps)")


if __name__ == "__main__":
    main()
