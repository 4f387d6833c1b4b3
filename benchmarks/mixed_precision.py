"""Training throughput of float32 vs mixed_bfloat16 vs mixed_float16, same model, one run.

    python benchmarks/mixed_precision.py                          # small CNN, 32x32 (CPU)
    python benchmarks/mixed_precision.py --model mobilenetv2 --image-size 224 --batch-size 128  # GPU

Each policy trains its own freshly built model on the same synthetic in-memory images
(the input pipeline is not what is measured); the first steps (tracing, autotuning) are
timed apart. Then the policies take turns for ``--rounds`` rounds, so machine noise hits
them alike; images_per_sec is the median round. Ratios are against the first policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


@dataclasses.dataclass(frozen=True)
class Result:
    policy: str
    images_per_round: int
    round_seconds: tuple[float, ...]
    warmup_seconds: float

    @property
    def images_per_sec(self) -> float:
        return self.images_per_round / statistics.median(self.round_seconds)


def build_model(name: str, image_size: int, num_classes: int):
    import keras

    inputs = keras.Input((image_size, image_size, 3))
    if name == "mobilenetv2":
        features = keras.applications.MobileNetV2(input_shape=(image_size, image_size, 3), weights=None,
                                                  include_top=False, pooling="avg")(inputs)
    else:
        x = inputs
        for filters in (32, 64):
            x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
            x = keras.layers.MaxPooling2D()(x)
        features = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(128, 3, activation="relu")(x))
    logits = keras.layers.Dense(num_classes)(features)
    outputs = keras.layers.Activation("softmax", dtype="float32")(logits)  # float32 output, per the recipe
    return keras.Model(inputs, outputs)


def prepare(policy: str, args: argparse.Namespace):
    """A compiled model for ``policy``, its training data, and the warm-up seconds."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist import precision

    with precision.policy_scope(policy):
        keras.utils.set_random_seed(0)
        model = build_model(args.model, args.image_size, args.num_classes)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    images = rng.uniform(size=(args.batch_size, args.image_size, args.image_size, 3)).astype("float32")
    labels = rng.integers(0, args.num_classes, size=(args.batch_size,))
    data = tf.data.Dataset.from_tensors((images, labels)).repeat().prefetch(2)
    return model, data, _timed_fit(model, data, args.warmup_steps)


def _timed_fit(model, data, steps: int) -> float:
    start = time.perf_counter()
    model.fit(data, steps_per_epoch=steps, epochs=1, shuffle=False, verbose=0)
    return time.perf_counter() - start


def measure(args: argparse.Namespace) -> list[Result]:
    prepared = {policy: prepare(policy, args) for policy in args.policies}
    rounds = {policy: [] for policy in args.policies}
    for _ in range(args.rounds):
        for policy, (model, data, _) in prepared.items():
            rounds[policy].append(_timed_fit(model, data, args.steps))
    return [Result(policy, args.steps * args.batch_size, tuple(rounds[policy]), prepared[policy][2])
            for policy in args.policies]


def report(results: list[Result], device: str) -> str:
    base = results[0].images_per_sec
    lines = [f"device: {device}", f"{'policy':<16}{'images_per_sec':>16}{'ratio':>8}{'warmup_s':>10}"]
    for r in results:
        lines.append(f"{r.policy:<16}{r.images_per_sec:>16.1f}{r.images_per_sec / base:>7.2f}x{r.warmup_seconds:>10.1f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["cnn", "mobilenetv2"], default="cnn")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--steps", type=int, default=15, help="steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                        help="the first one is the baseline of the ratios")
    args = parser.parse_args(argv)
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    device = (", ".join(tf.config.experimental.get_device_details(g).get("device_name", g.name) for g in gpus)
              if gpus else "CPU only")
    print(report(measure(args), device))


if __name__ == "__main__":
    main()
