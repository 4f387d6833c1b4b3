"""What does weighing each replica by its share of the batch (tfdist.keras_fixes.batch_shares) cost a step?

On: tfdist as it ships (each replica all-reduces its example count, one float, before its forward pass).
Off: ``TFDIST_BATCH_WEIGHTING=keras`` (Keras' 1/replicas, no count). Two measurements, each printing
every round's ratio on/off:

* jobs: rounds of two 2-worker ``tfdist run`` jobs (the small CNN of ``benchmarks/fit_timing.py``),
  in alternating order; a job's step time moves by several percent from one job to the next;
* ``--in-process``: one process, MirroredStrategy over 2 logical CPUs, the same model timed for
  ``--steps`` steps on and off in alternating order (the step retraced for each arm), which pairs
  the arms far more closely than separate jobs.

    python benchmarks/batch_shares.py --rounds 6 --in-process 10
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import fit_timing as same_job  # noqa: E402  (benchmarks/fit_timing.py: the job and its StepTime)

REPO = pathlib.Path(__file__).resolve().parents[1]
ENV = "TFDIST_BATCH_WEIGHTING"


def run_job(on: bool, steps: int, batch: int) -> same_job.StepTime:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = {**os.environ, ENV: "exact" if on else "keras",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "tfdist.run", "-n", "2", "--timeout", "900", "--",
                   sys.executable, __file__, "--worker", out, "--steps", str(steps), "--batch", str(batch)]
        subprocess.run(command, env=env, check=True, capture_output=True)
        return same_job.StepTime("on" if on else "off", steps, json.loads(pathlib.Path(out).read_text())["seconds"])


def in_process(rounds: int, steps: int, batch: int) -> list[float]:
    """Per round, ms/step on and off (alternating which goes first) in one process of 2 replicas; the ratios."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras

    import tfdist

    with tfdist.scope("mirrored", devices="CPU:[0-1]"):
        model = same_job.small_cnn()
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    images = tf.random.stateless_uniform((batch, 32, 32, 3), seed=(1, 2))
    labels = tf.random.stateless_uniform((batch,), seed=(3, 4), maxval=10, dtype=tf.int32)
    options = tf.data.Options()
    options.autotune.enabled = False
    dataset = tf.data.Dataset.from_tensors((images, labels)).repeat().with_options(options)
    functions = {}
    for on in (True, False):  # trace each arm once (the arm is read when the step is traced)
        os.environ[ENV] = "exact" if on else "keras"
        model.train_function = None
        model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)
        functions[on] = model.train_function
    ratios = []
    for index in range(rounds):
        ms = {}
        for on in ((True, False) if index % 2 == 0 else (False, True)):
            model.train_function = functions[on]
            start = time.perf_counter()
            model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)
            ms[on] = 1000 * (time.perf_counter() - start) / steps
        ratios.append(ms[True] / ms[False])
        print(f"in-process round {index + 1}: on {ms[True]:.3f} ms/step, off {ms[False]:.3f} ms/step, "
              f"on/off {ratios[-1]:.4f}", flush=True)
    print(f"in-process on/off over {rounds} rounds: median {statistics.median(ratios):.4f}, "
          f"min {min(ratios):.4f}, max {max(ratios):.4f}")
    return ratios


def main() -> None:
    parser = same_job.job_parser(__doc__, steps=200)
    parser.add_argument("--in-process", type=int, default=0, metavar="ROUNDS",
                        help="also time both arms in one process of 2 logical CPUs, this many rounds")
    args = parser.parse_args()
    if args.worker:
        same_job.worker(args.worker, args.steps, args.batch, data_autotune=False)
        return
    if args.rounds:
        same_job.alternate(args.rounds, lambda on: run_job(on, args.steps, args.batch), "")
    if args.in_process:
        in_process(args.in_process, args.steps, args.batch)


if __name__ == "__main__":
    main()
