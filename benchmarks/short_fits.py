"""A short ``fit`` under tfdist.scope(): 16 steps per call (tfdist's pick before) against its pick now.

``steps_per_execution="auto"`` (what a model compiled in ``tfdist.scope()`` gets) runs 16 steps per call,
and since the short-fit rule one per call when the fit is known to train fewer than
``AUTO_MIN_STEPS`` (128) steps in all. The 16-step loop's function costs more to trace than one
step's; this measures what that costs a fit of N steps, and where the loop starts to pay.

* ``k16``: ``compile(steps_per_execution=16)``, what "auto" picked for every such fit before;
* ``auto``: ``compile()`` with no ``steps_per_execution`` in ``tfdist.scope()`` (tfdist picks).

One process, 2 mirrored replicas on 2 logical CPUs; every fit is a new model's first (its trace
included), one epoch of N batches of 16 (a small CNN). The two setups alternate, their order
reversed every round. Prints every fit's CPU (this process's user + system) and wall seconds,
then per N the medians and auto / k16.

    python benchmarks/short_fits.py [--rounds 3] [--steps 16 64 256 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, nargs="+", default=[16, 64, 256, 1024])
    args = parser.parse_args()

    import tfdist  # first: tfdist.startup
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    import numpy as np

    strategy = tfdist.scope("mirrored", devices="CPU:[0-1]").__enter__()
    rng = np.random.default_rng(0)

    def first_fit(steps: int, setup: str) -> tuple[float, float]:
        x = rng.random((16 * steps, 8, 8, 3), dtype="float32")
        y = rng.integers(0, 4, 16 * steps)
        with strategy.scope():
            model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, activation="relu"),
                                      keras.layers.Flatten(), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(4)])
            model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"], **({"steps_per_execution": 16} if setup == "k16" else {}))
        cpu_began, began = time.process_time(), time.monotonic()
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        return time.process_time() - cpu_began, time.monotonic() - began

    results: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for round_ in range(args.rounds):
        for steps in args.steps:
            order = ("k16", "auto") if round_ % 2 == 0 else ("auto", "k16")
            for setup in order:
                cpu_s, wall_s = first_fit(steps, setup)
                results.setdefault((steps, setup), []).append((cpu_s, wall_s))
                print(f"round {round_ + 1}  {steps:5d} steps  {setup:4s}  CPU {cpu_s:6.2f} s  wall {wall_s:6.2f} s",
                      flush=True)
    print("\nsteps | k16 CPU median | auto CPU median | auto / k16 CPU | k16 wall | auto wall | auto / k16 wall")
    for steps in args.steps:
        k16, auto = results[(steps, "k16")], results[(steps, "auto")]
        cpu16, cpua = (statistics.median(r[0] for r in rows) for rows in (k16, auto))
        wall16, walla = (statistics.median(r[1] for r in rows) for rows in (k16, auto))
        print(f"{steps} | {cpu16:.2f} | {cpua:.2f} | {cpua / cpu16:.3f} | {wall16:.2f} | {walla:.2f} | "
              f"{walla / wall16:.3f}")


if __name__ == "__main__":
    main()
