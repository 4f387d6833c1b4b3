"""Two claims of `tfdist bench`, measured side by side in one process on one device.

1. Training on TFRecords through tfdist.data vs on synthetic tensors already in memory
   (goal >= 0.95: the input pipeline hides behind compute).
2. tfdist's defaults (its TFRecord pipeline with parallel reads and prefetch, and
   steps_per_execution where it is safe) vs plain Keras defaults as users write them
   (TFRecordDataset -> map(parse) -> batch, steps_per_execution=1) (goal >= 1.3x).

    python benchmarks/bench_defaults.py [--model small_cnn] [--rounds 3]
"""

from __future__ import annotations

import argparse
import glob
import statistics
import time

import keras
import tensorflow as tf

from tfdist.bench import models, runner, sources
from tfdist.bench.config import BenchConfig
from timing import Timing  # benchmarks/timing.py


def plain_keras_dataset(pattern: str, config: BenchConfig, batch: int) -> tf.data.Dataset:
    """The pipeline as the Keras/TF tutorials write it: read, map(parse+decode+resize), batch."""
    spec = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        image = tf.image.resize(tf.io.decode_jpeg(example["image"], channels=3), (config.image_size,) * 2)
        return image / 255.0, example["label"]

    files = sorted(glob.glob(pattern))
    return tf.data.TFRecordDataset(files).map(parse).shuffle(1024).batch(batch, drop_remainder=True).repeat()


def time_fit(name: str, dataset, config: BenchConfig, batch: int, steps_per_execution: int) -> Timing:
    """Images/s over config.epochs - 1 epochs after one warm-up epoch."""
    model = models.build_model(config.model, config.image_size, sources.num_classes(config.dataset))
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], steps_per_execution=steps_per_execution)
    model.fit(dataset, epochs=1, steps_per_epoch=config.steps_per_epoch, verbose=0)
    start = time.perf_counter()
    model.fit(dataset, epochs=config.epochs - 1, steps_per_epoch=config.steps_per_epoch, verbose=0)
    return Timing(name, batch * config.steps_per_epoch * (config.epochs - 1), time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small_cnn")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    config = BenchConfig(model=args.model, image_size=args.image_size, steps_per_epoch=args.steps, epochs=3,
                         mock_examples=1024, shards=16)
    pattern = sources.prepare_records(config)
    strategy = tf.distribute.get_strategy()
    fast_steps = runner.safe_steps_per_execution(strategy, config)
    tfdist_data = lambda: sources.records_dataset(config, pattern, args.batch)  # noqa: E731
    plain_data = lambda: plain_keras_dataset(pattern, config, args.batch)  # noqa: E731
    runs = {  # name -> (dataset maker, steps_per_execution)
        "synthetic, tfdist defaults": (lambda: sources.train_dataset(config, strategy, None, args.batch, 5), fast_steps),
        "TFRecords, tfdist defaults": (tfdist_data, fast_steps),
        "TFRecords, plain Keras defaults": (plain_data, 1),
        "TFRecords, tfdist pipeline, 1 step/call": (tfdist_data, 1),
        "TFRecords, plain pipeline, tfdist steps": (plain_data, fast_steps),
    }
    rates = {name: [] for name in runs}
    input_rates = {"tfdist pipeline": [], "plain pipeline": []}
    for _ in range(args.rounds):
        for name, (make_dataset, steps) in runs.items():
            rates[name].append(time_fit(name, make_dataset(), config, args.batch, steps).images_per_sec)
        for name, make_dataset in (("tfdist pipeline", tfdist_data), ("plain pipeline", plain_data)):
            input_rates[name].append(runner.records_per_sec(make_dataset(), 20, 10 * args.steps))
    median = {name: statistics.median(values) for name, values in {**rates, **input_rates}.items()}
    print(f"{args.model}, {args.image_size}x{args.image_size}, batch {args.batch}, one device, "
          f"steps_per_execution {fast_steps} for tfdist; medians of {args.rounds} rounds")
    for name in rates:
        print(f"  {name:<42} {median[name]:8.1f} images/s")
    for name in input_rates:
        print(f"  input alone, {name:<29} {median[name]:8.1f} records/s")
    ratios = (("TFRecords / synthetic (tfdist)", "TFRecords, tfdist defaults", "synthetic, tfdist defaults", 0.95),
              ("tfdist defaults / plain Keras", "TFRecords, tfdist defaults", "TFRecords, plain Keras defaults", 1.3),
              ("input alone: tfdist / plain", "tfdist pipeline", "plain pipeline", None))
    for label, top, bottom, goal in ratios:
        print(f"{label + ':':<32} {median[top] / median[bottom]:.3f}" + (f"  (goal >= {goal})" if goal else ""))

if __name__ == "__main__":
    main()
