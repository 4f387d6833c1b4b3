"""Cost of gradient accumulation: tfdist.DistributedOptimizer vs Keras' own, vs no accumulation.

    python benchmarks/accumulation.py

One process, no strategy (where Keras' own accumulation works), an MLP on generated data.
Every run sees the same examples per update (64): no accumulation at batch 64, and k=2
micro-batches of 32 for the two accumulating optimizers. The first epoch (tracing) is
timed apart and left out.
"""

import dataclasses
import time

import keras
import numpy as np

import tfdist

EXAMPLES, EPOCHS = 64 * 200, 3


@dataclasses.dataclass(frozen=True)
class Result:
    name: str
    examples_per_sec: float
    first_epoch_sec: float


def measure(name: str, optimizer: keras.optimizers.Optimizer, batch_size: int) -> Result:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, 64)).astype("float32")
    y = rng.normal(size=(EXAMPLES, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(256, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
    first = time.perf_counter() - start
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch_size, epochs=EPOCHS, verbose=0)
    return Result(name, EXAMPLES * EPOCHS / (time.perf_counter() - start), first)


def main() -> None:
    results = [
        measure("no accumulation, batch 64", keras.optimizers.Adam(1e-3), 64),
        measure("keras gradient_accumulation_steps=2, batch 32", keras.optimizers.Adam(1e-3, gradient_accumulation_steps=2), 32),
        measure("tfdist.DistributedOptimizer k=2, batch 32",
                tfdist.DistributedOptimizer(keras.optimizers.Adam(1e-3), backward_passes_per_step=2), 32),
    ]
    baseline = results[1].examples_per_sec
    print(f"{'run':48s} {'examples/s':>11s} {'vs keras accum':>15s} {'first epoch s':>14s}")
    for r in results:
        print(f"{r.name:48s} {r.examples_per_sec:11.0f} {r.examples_per_sec / baseline:15.2f} {r.first_epoch_sec:14.2f}")


if __name__ == "__main__":
    main()
