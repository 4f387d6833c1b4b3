"""One timed benchmark run, in its own worker process (a strategy is built once per process).

    python -m tfdist.bench.runner CONFIG_JSON REPLICAS GLOBAL_BATCH OUT_JSON [PATTERN]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Sequence

import keras
import tensorflow as tf

import tfdist
from tfdist import autotune, collectives, precision
from tfdist.bench import models, profile, sources
from tfdist.bench.config import BenchConfig, JsonRecord

PROFILED_STEPS = 16  # --mode profile: training steps traced to split the all-reduce into hidden and exposed


@dataclasses.dataclass(frozen=True)
class RunResult(JsonRecord):
    """What one run measured; the first epoch (tracing) is kept apart as warm-up."""

    replicas: int
    global_batch: int
    strategy: str
    devices: tuple[str, ...]
    epoch_seconds: tuple[float, ...]
    images_per_epoch: int
    input_records_per_sec: float | None = None
    breakdown: dict | None = None  # --mode profile: a StepBreakdown's fields
    autotune: str | None = None  # what tfdist.autotune chose (multi-worker fit), or how far it got

    @property
    def warmup_seconds(self) -> float:
        return self.epoch_seconds[0]

    @property
    def seconds_per_epoch(self) -> float:
        return statistics.mean(self.epoch_seconds[1:])

    @property
    def images_per_sec(self) -> float:
        return self.images_per_epoch / self.seconds_per_epoch


class EpochTimer(keras.callbacks.Callback):
    """Times each epoch; prints a progress line on the chief."""

    def __init__(self, replicas: int, global_batch: int, steps: int):
        super().__init__()
        self.label = f"replicas {replicas}, global batch {global_batch}"
        self.images_per_epoch = global_batch * steps
        self.seconds: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self.start)
        note = " (warm-up: tracing)" if epoch == 0 else ""
        tfdist.print(f"{self.label}: epoch {epoch + 1} {self.seconds[-1]:.2f} s, "
                     f"{self.images_per_epoch / self.seconds[-1]:.0f} images/s{note}", flush=True)


def run(config: BenchConfig, strategy: tf.distribute.Strategy, global_batch: int, pattern: str | None) -> RunResult:
    """Trains ``config.model`` for ``config.epochs`` epochs; in input mode, also times the input alone."""
    precision.set_policy(config.precision)
    classes = sources.num_classes(config.dataset)
    input_rate = None
    if config.mode == "input":
        input_rate = input_records_per_sec(config, pattern, global_batch)
        pattern = None  # the training rate to compare it with is the compute-only one
    if config.mode == "profile" and pattern is not None:
        input_rate = input_records_per_sec(config, pattern, global_batch // collectives.num_workers(strategy))
    build_model = lambda: models.build_model(config.model, config.image_size, classes)  # noqa: E731
    compile_kwargs = lambda: {"optimizer": keras.optimizers.SGD(0.01, momentum=0.9),  # noqa: E731
                              "loss": "sparse_categorical_crossentropy", "metrics": ["accuracy"]}
    with strategy.scope():
        model = build_model()
        model.compile(**compile_kwargs(), steps_per_execution=safe_steps_per_execution(strategy, config))
    dataset = sources.train_dataset(config, strategy, pattern, global_batch, classes)
    timer = EpochTimer(strategy.num_replicas_in_sync, global_batch, config.steps_per_epoch)
    model.fit(dataset, epochs=config.epochs, steps_per_epoch=config.steps_per_epoch, verbose=0, callbacks=[timer],
              shuffle=False)  # the input pipeline shuffles; Keras would only warn
    result = RunResult(strategy.num_replicas_in_sync, global_batch, type(strategy).__name__,
                       _device_names(strategy), tuple(timer.seconds),
                       global_batch * config.steps_per_epoch, input_rate, autotune=autotune.status(model.train_function))
    if config.mode != "profile":
        return result
    breakdown = step_breakdown(config, strategy, result, build_model, compile_kwargs, model, classes, dataset)
    tfdist.print(f"replicas {result.replicas}, global batch {global_batch}: {breakdown.describe()}", flush=True)
    return dataclasses.replace(result, breakdown=dataclasses.asdict(breakdown))


def step_breakdown(config: BenchConfig, strategy: tf.distribute.Strategy, result: RunResult, build_model,
                   compile_kwargs, model: keras.Model, classes: int, dataset) -> profile.StepBreakdown:
    """Times the parts of one step apart (see tfdist.bench.profile)."""
    overlap = profile.traced_overlap(model, dataset, min(config.steps_per_epoch, PROFILED_STEPS)) \
        if result.replicas > 1 else None
    per_replica = result.global_batch // result.replicas
    images = tf.random.stateless_uniform((per_replica, config.image_size, config.image_size, 3), seed=(0, 0))
    labels = tf.random.stateless_uniform((per_replica,), seed=(1, 0), maxval=classes, dtype=tf.int32)
    return profile.StepBreakdown(
        step_ms=1000 * result.seconds_per_epoch / config.steps_per_epoch,
        compute_ms=profile.compute_ms(build_model, compile_kwargs(), (images, labels), config.steps_per_epoch),
        allreduce_ms=profile.allreduce_ms(strategy, model.trainable_variables, num_logged=2),
        input_ms=profile.input_ms(result.input_records_per_sec,
                                  result.global_batch // collectives.num_workers(strategy)),
        hidden_ms=overlap.hidden_ms if overlap else 0.0, exposed_ms=overlap.exposed_ms if overlap else 0.0)


def safe_steps_per_execution(strategy: tf.distribute.Strategy, config: BenchConfig) -> int:
    """Steps per ``tf.function`` call: a whole epoch on one device, else 1.

    Running several steps per call saves Python overhead, but Keras fails with it under
    MirroredStrategy, and even with 2 logical devices and no strategy (keras#19246).
    """
    one_device = strategy.num_replicas_in_sync == 1 and len(tf.config.list_logical_devices()) == 1
    return config.steps_per_epoch if one_device else 1


def _device_names(strategy: tf.distribute.Strategy) -> tuple[str, ...]:
    """The replicas' devices; for the default strategy, where TensorFlow places ops by default."""
    if tf.distribute.has_strategy() or strategy is not tf.distribute.get_strategy():
        return tuple(strategy.extended.worker_devices)
    return tuple(d.name for d in (tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU"))[:1])


def input_records_per_sec(config: BenchConfig, pattern: str | None, global_batch: int) -> float:
    """Records/s of tfdist's input pipeline alone over the shards."""
    if pattern is None:
        raise ValueError("--mode input times a real input pipeline; use --source mock, tfds or tfrecord.")
    return records_per_sec(sources.records_dataset(config, pattern, global_batch), config.steps_per_epoch,
                           config.steps_per_epoch * (config.epochs - 1))


def records_per_sec(dataset: tf.data.Dataset, warmup_batches: int, batches: int) -> float:
    """Records/s of a dataset of (images, labels) batches, timed with ``Dataset.reduce`` (no Python loop)."""
    count = lambda n, batch: n + tf.shape(batch[1], out_type=tf.int64)[0]  # noqa: E731
    dataset.take(warmup_batches).reduce(tf.constant(0, tf.int64), count)
    start = time.perf_counter()
    records = int(dataset.take(batches).reduce(tf.constant(0, tf.int64), count))
    return records / (time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one configuration in this worker process and writes its RunResult as JSON."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path, replicas, global_batch, out_path = argv[0], int(argv[1]), int(argv[2]), argv[3]
    pattern = argv[4] if len(argv) > 4 and argv[4] else None
    with open(config_path) as f:
        config = BenchConfig.from_json(f.read())
    # On GPUs take the first N; on a CPU the launcher already made N logical devices.
    devices = replicas if tf.config.list_physical_devices("GPU") else None
    result = run(config, tfdist.get_strategy(config.strategy, devices=devices), global_batch, pattern)
    with open(out_path, "w") as f:
        f.write(result.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
