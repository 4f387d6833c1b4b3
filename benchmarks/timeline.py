"""What do the step clock (always on: the straggler report) and the timeline cost a step? Keras fit on 2 workers.

Each round starts 2-worker jobs through ``tfdist run`` in alternating order, the job of
``benchmarks/fit_timing.py`` (a small CNN, ``--steps`` steps timed after a warm-up fit). ``--arm
clock`` compares tfdist as it ships (``tfdist.step_clock`` reading the clock in every step, the
straggler report at each fit's end) with the step clock taken out (its hooks made no-ops, the
input clock's patch restored): goal <= 1.005. ``--arm timeline`` compares ``TFDIST_TIMELINE`` set
(each worker's timeline thread publishing its part, worker 0 writing the file) with the step clock
taken out: goal <= 1.03. Every round prints its ratio. The job's dataset runs without tf.data
autotune (with it, separate jobs land in a fast or a slow mode at random). ``--micro`` also pairs
fits inside one process: two copies of the
model on 2 logical CPUs (MirroredStrategy), one traced with the step clock and one without,
alternating, each round's ratio printed.

    python benchmarks/timeline.py --arm clock --rounds 4 --micro
    python benchmarks/timeline.py --arm timeline --rounds 4
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import fit_timing as same_job  # noqa: E402  (benchmarks/fit_timing.py: the job and its StepTime)

REPO = pathlib.Path(__file__).resolve().parents[1]


def worker(out: str, steps: int, batch: int, clock: bool) -> None:
    if not clock:
        import tfdist
        from tfdist import step_clock, tf_fixes

        tfdist.get_strategy()  # first, as same_job.worker does: TensorFlow must not start before it
        tf_fixes.input_clock.restore()
        step_clock.step_starts = lambda data: None
        step_clock.buckets_timed = lambda gradients, reduce_buckets: reduce_buckets(
            lambda b, tensors, nbytes=0: tensors, lambda b, tensors: tensors)
    same_job.worker(out, steps, batch, data_autotune=False)


def run_job(on: bool, arm: str, steps: int, batch: int) -> same_job.StepTime:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        if on and arm == "timeline":
            env["TFDIST_TIMELINE"] = os.path.join(tmp, "timeline.json")
        command = [sys.executable, "-m", "tfdist.run", "-n", "2", "--timeout", "900", "--",
                   sys.executable, __file__, "--worker", out, "--steps", str(steps), "--batch", str(batch),
                   "--on" if on else "--off"]
        subprocess.run(command, env=env, check=True, capture_output=True)
        return same_job.StepTime(arm if on else "off", steps, json.loads(pathlib.Path(out).read_text())["seconds"])


def micro(rounds: int, arm: str, steps: int = 80) -> list[tuple[float, float]]:
    """(with the clock, without) ms a step of Keras fit in this process, 2 replicas on 2 logical CPUs: two copies
    of the job's model, one traced with the step clock (``arm`` "timeline": with each bucket's reads too) and one
    without, in alternating fits. The timeline's publication runs off the training thread, in jobs only."""
    import time

    os.environ.setdefault("TFDIST_CPU_DEVICES", "2")
    import tfdist
    from tfdist import step_clock, tf_fixes

    with tfdist.scope(devices="CPU:[0-1]") as strategy:
        pass
    import keras
    import tensorflow as tf

    images = tf.random.stateless_uniform((64, 32, 32, 3), seed=(1, 2))
    labels = tf.random.stateless_uniform((64,), seed=(3, 4), maxval=10, dtype=tf.int32)
    options = tf.data.Options()
    options.autotune.enabled = False  # no slow mode decided at random per iterator (UPSTREAM.md): pairs compare
    dataset = tf.data.Dataset.from_tensors((images, labels)).repeat().with_options(options)

    def traced():
        with strategy.scope():
            model = same_job.small_cnn()
            model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)
        return model

    step_clock.per_bucket = arm == "timeline"
    with_clock = traced()
    step_clock.per_bucket = False
    tf_fixes.input_clock.restore()
    step_clock.step_starts = lambda data: None
    step_clock.buckets_timed = lambda gradients, reduce_buckets: reduce_buckets(
        lambda b, tensors, nbytes=0: tensors, lambda b, tensors: tensors)
    without = traced()
    results = []
    for index in range(rounds):
        seconds = {}
        for name, model in (("on", with_clock), ("off", without)) if index % 2 == 0 else (("off", without),
                                                                                          ("on", with_clock)):
            began = time.perf_counter()
            model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)
            seconds[name] = (time.perf_counter() - began) / steps * 1e3
        results.append((seconds["on"], seconds["off"]))
    return results


def main() -> None:
    parser = same_job.job_parser(__doc__, steps=320)
    parser.add_argument("--arm", choices=("clock", "timeline"), default="clock")
    parser.add_argument("--micro", action="store_true", help="also time the clock in one process, paired fits")
    parser.add_argument("--micro-rounds", type=int, default=20)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.batch, args.on)
        return
    _, off_ms = same_job.alternate(args.rounds, lambda on: run_job(on, args.arm, args.steps, args.batch),
                                   f"{args.arm} ")
    if args.micro:
        pairs = micro(args.micro_rounds, args.arm)
        for index, (on, off) in enumerate(pairs):
            print(f"micro round {index + 1}: with the clock {on:.2f} ms a step, without {off:.2f} ms, "
                  f"on/off {on / off:.3f}")
        ratios = sorted(on / off for on, off in pairs)
        print(f"micro: median on/off {ratios[len(ratios) // 2]:.3f} over {len(ratios)} rounds (min {ratios[0]:.3f}, "
              f"max {ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
