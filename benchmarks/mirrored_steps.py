"""MirroredStrategy on 2 logical CPUs: a small MLP under tfdist's steps_per_execution vs Keras' one step per call.

* ``keras``: ``tf.distribute.MirroredStrategy()`` and ``compile()`` as Keras users write
  them: one step per call (Keras' default; more fails on Keras itself, keras#19246);
* ``tfdist``: the same model in ``tfdist.scope()``; ``compile()`` with no
  ``steps_per_execution``, so tfdist picks K for ``fit``.

Each round runs both setups, each in a fresh process (two MirroredStrategies on the same
devices in one process would share collective keys), alternating. Both start from the same
weights and see the same batches, so their final weights must match (1e-5). Prints steps/s
of every round and the ratio tfdist / keras (goal >= 2 in every round).

    python benchmarks/mirrored_steps.py [--rounds 5] [--steps 512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SETUPS = ("keras", "tfdist")
BATCH = 64  # global


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=512, help="timed steps per run (any count: the last call runs the steps left)")
    parser.add_argument("--setup", choices=SETUPS, help=argparse.SUPPRESS)  # set in the child
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def child(args: argparse.Namespace) -> None:
    """Trains the setup's model: warm-up, then ``args.steps`` timed steps; prints the result."""
    import tensorflow as tf

    (cpu,) = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    import numpy as np

    import tfdist

    keras.utils.set_random_seed(0)
    features = tf.random.stateless_normal((BATCH * 16, 32), seed=(1, 2))
    labels = tf.random.stateless_uniform((BATCH * 16,), seed=(3, 4), maxval=10, dtype=tf.int32)
    data = tf.data.Dataset.from_tensor_slices((features, labels)).batch(BATCH).repeat()
    if args.setup == "keras":
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        scope = strategy.scope()
    else:
        scope = tfdist.scope(strategy="mirrored", devices=2)
    with scope:
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(data, epochs=1, steps_per_epoch=32, verbose=0)  # tracing and warm-up
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0)
    seconds = time.perf_counter() - start
    np.savez(args.weights, *model.get_weights())
    print("RESULT " + json.dumps({"steps_per_sec": args.steps / seconds}), flush=True)


def run(setup: str, args: argparse.Namespace, weights: str) -> float:
    command = [sys.executable, os.path.abspath(__file__), "--setup", setup, "--steps", str(args.steps),
               "--weights", weights]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])["steps_per_sec"]
    raise RuntimeError(f"{setup} gave no result (exit {done.returncode}):\n{done.stderr[-3000:]}")


def max_weight_difference(first: str, second: str) -> float:
    import numpy as np

    with np.load(first) as a, np.load(second) as b:
        return max(float(np.max(np.abs(a[key] - b[key]))) for key in a.files)


def main(args: argparse.Namespace) -> None:
    rates = {setup: [] for setup in SETUPS}
    with tempfile.TemporaryDirectory() as folder:
        paths = {setup: os.path.join(folder, f"{setup}.npz") for setup in SETUPS}
        for number in range(args.rounds):
            order = SETUPS if number % 2 == 0 else SETUPS[::-1]  # alternating
            for setup in order:
                rates[setup].append(run(setup, args, paths[setup]))
            print(f"round {number + 1}: " + ", ".join(f"{s} {rates[s][-1]:.0f} steps/s" for s in SETUPS), flush=True)
        difference = max_weight_difference(paths["keras"], paths["tfdist"])
    ratios = [t / k for k, t in zip(rates["keras"], rates["tfdist"])]
    print(f"\nMirroredStrategy, 2 logical CPUs, MLP 32-64-64-10, global batch {BATCH}, {args.steps} timed steps")
    for setup in SETUPS:
        print(f"{setup:<8} median {statistics.median(rates[setup]):7.0f} steps/s   rounds: "
              + ", ".join(f"{r:.0f}" for r in rates[setup]))
    verdict = "met" if min(ratios) >= 2 else "missed"
    print(f"tfdist / keras: median {statistics.median(ratios):.2f}, rounds "
          + ", ".join(f"{r:.2f}" for r in ratios) + f" (goal >= 2 in every round: {verdict})")
    print(f"final weights, max |tfdist - keras| (last round): {difference:.2e} (goal <= 1e-5)")


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.setup:
        child(arguments)
    else:
        main(arguments)
