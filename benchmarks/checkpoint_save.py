"""What a checkpoint costs training: the time ``save`` blocks, async against synchronous, and steps/s with saves.

    python benchmarks/checkpoint_save.py [--width 4096] [--rounds 3] [--steps 20] [--every 5]

A Dense(width) x 2 model under Adam (width 4096: 33.6M parameters, 268 MB of Adam state, 403 MB with the weights),
one process, no strategy. In alternating rounds, each timed after one untimed save of its kind:

  async        tfdist.CheckpointManager(async_save=True).save: returns once the state is in host memory
  sync         tfdist.CheckpointManager(async_save=False).save: returns once the checkpoint is committed
  keras        model.save("model.keras"): plain Keras' one file
  weights      model.save_weights("model.weights.h5")

then ``--steps`` training steps with a save every ``--every`` steps (async, sync) and with none, side by side.
Prints every round and the ratios against ``sync``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tfdist  # noqa: E402,F401  (its fixes apply to Keras)
import keras  # noqa: E402


def model_of(width: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(width), keras.layers.Dense(width),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(1e-5), "mse")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    args = parser.parse_args()
    model = model_of(args.width)
    x = np.random.default_rng(0).normal(size=(64, args.width)).astype("float32")
    y = np.zeros((64, 1), "float32")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # builds the optimizer and traces the step
    state_mb = sum(np.asarray(v).nbytes for v in model.weights + model.optimizer.variables) / 2**20
    print(f"width {args.width}: {model.count_params() / 1e6:.1f}M parameters, {state_mb:.0f} MB of state")
    root = tempfile.mkdtemp(prefix="tfdist-bench-checkpoint-")
    managers = {"async": tfdist.CheckpointManager(os.path.join(root, "async"), max_to_keep=1, async_save=True),
                "sync": tfdist.CheckpointManager(os.path.join(root, "sync"), max_to_keep=1, async_save=False)}
    saves = {"async": lambda: managers["async"].save(model), "sync": lambda: managers["sync"].save(model),
             "keras": lambda: model.save(os.path.join(root, "model.keras")),
             "weights": lambda: model.save_weights(os.path.join(root, "model.weights.h5"))}
    blocked = {name: [] for name in saves}
    try:
        for round_ in range(args.rounds):
            for name, save in saves.items():
                managers["async"].wait()
                save()  # untimed: the first save of its kind
                managers["async"].wait()
                began = time.perf_counter()
                save()
                blocked[name].append(time.perf_counter() - began)
                managers["async"].wait()
            print(f"round {round_ + 1}: blocked " + ", ".join(f"{n} {blocked[n][-1]:.3f} s" for n in saves))
        print("median blocked, and against sync: " + ", ".join(
            f"{n} {statistics.median(v):.3f} s ({statistics.median(v) / statistics.median(blocked['sync']):.2f}x)"
            for n, v in blocked.items()))
        model.train_on_batch(x[:32], y[:32])  # traces train_on_batch's function once, untimed
        rates = {"none": [], "async": [], "sync": []}
        for round_ in range(args.rounds):
            for name in rates:
                began = time.perf_counter()
                for step in range(args.steps):
                    model.train_on_batch(x[:32], y[:32])
                    if name != "none" and (step + 1) % args.every == 0:
                        managers[name].save(model)
                managers["async"].wait()
                rates[name].append(args.steps / (time.perf_counter() - began))
            print(f"round {round_ + 1}: steps/s " + ", ".join(f"{n} {rates[n][-1]:.2f}" for n in rates))
        print(f"median steps/s with a save every {args.every} steps, and against no saves: " + ", ".join(
            f"{n} {statistics.median(v):.2f} ({statistics.median(v) / statistics.median(rates['none']):.2f}x)"
            for n, v in rates.items()))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
