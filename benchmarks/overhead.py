"""Does tfdist.scope() cost anything? fit() images/s under plain MirroredStrategy vs tfdist.

Both strategies mirror the same devices and train the same model on the same data,
alternating rounds in one process so drift hits both alike. Prints the ratio
tfdist / plain (goal >= 0.98).

    python benchmarks/overhead.py --replicas 2 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import tensorflow as tf

from timing import Timing  # benchmarks/timing.py


def time_fit(strategy: tf.distribute.Strategy, name: str, steps: int, batch: int, image_size: int) -> Timing:
    """Images/s of one fit epoch of `steps` steps, after a warm-up epoch (tracing timed apart)."""
    import keras

    with strategy.scope():
        model = keras.Sequential([
            keras.Input((image_size, image_size, 3)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    images = tf.random.stateless_uniform((batch, image_size, image_size, 3), seed=(1, 2))
    labels = tf.random.stateless_uniform((batch,), seed=(3, 4), maxval=10, dtype=tf.int32)
    dataset = tf.data.Dataset.from_tensors((images, labels)).repeat().prefetch(2)
    model.fit(dataset, steps_per_epoch=2, epochs=1, verbose=0)  # warm-up: tracing
    start = time.perf_counter()
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)
    return Timing(name, steps * batch, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--image-size", type=int, default=32)
    args = parser.parse_args()

    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) < args.replicas:  # split the CPU so both runs have the same replicas
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)
    import tfdist

    tfdist_strategy = tfdist.get_strategy("mirrored", devices=args.replicas)
    plain = tf.distribute.MirroredStrategy(tfdist_strategy.extended.worker_devices)
    rates = {"plain": [], "tfdist": []}
    for _ in range(args.rounds):
        for name, strategy in (("plain", plain), ("tfdist", tfdist_strategy)):
            timing = time_fit(strategy, name, args.steps, args.batch, args.image_size)
            rates[name].append(timing.images_per_sec)
    plain_rate, tfdist_rate = (statistics.median(rates[k]) for k in ("plain", "tfdist"))
    print(f"devices: {list(plain.extended.worker_devices)}")
    print(f"plain MirroredStrategy: {plain_rate:8.1f} images/s (median of {args.rounds})")
    print(f"tfdist.scope():         {tfdist_rate:8.1f} images/s (median of {args.rounds})")
    print(f"ratio tfdist/plain:     {tfdist_rate / plain_rate:.3f}  (goal >= 0.98)")


if __name__ == "__main__":
    main()
