"""The benchmark's settings: parsed from the command line, checked when they arrive."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Sequence

from tfdist.errors import BenchError

MODELS = ("small_cnn", "mobilenet_v2", "resnet50")
SOURCES = ("mock", "tfds", "synthetic", "tfrecord")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16", "auto")
STRATEGIES = ("auto", "mirrored", "multi_worker")
MODES = ("train", "input", "profile")
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tfdist", "bench")


class JsonRecord:
    """A frozen dataclass that travels between processes as JSON (its tuples come back as tuples)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str):
        return cls(**{key: tuple(value) if isinstance(value, list) else value
                      for key, value in json.loads(text).items()})


@dataclasses.dataclass(frozen=True)
class BenchConfig(JsonRecord):
    """Everything one benchmark run needs; JSON-serialisable so worker processes get it whole."""

    dataset: str = "tf_flowers"
    model: str = "mobilenet_v2"
    source: str = "mock"
    data_dir: str | None = None
    tfrecords: str | None = None
    replicas: tuple[int, ...] = (1, 2)
    batch_sizes: tuple[int, ...] = (64,)
    epochs: int = 3
    steps_per_epoch: int = 8
    image_size: int = 64
    precision: str = "float32"
    strategy: str = "auto"
    mode: str = "train"
    mock_examples: int = 256
    shards: int = 8
    cache_dir: str = DEFAULT_CACHE
    json: str | None = None
    csv: str | None = None
    plot: str | None = None


def build_parser() -> argparse.ArgumentParser:
    """The ``tfdist bench`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="tfdist bench",
        description="Time training on 1 vs N replicas (s/epoch, images/s, speedup, scaling efficiency).",
        epilog="With no arguments: tf_flowers shapes from mock data, MobileNetV2 at 64x64, 1 vs 2 replicas.")
    defaults = BenchConfig()
    parser.add_argument("--dataset", default=defaults.dataset, help="a tensorflow-datasets image dataset")
    parser.add_argument("--model", default=defaults.model, help=f"one of {', '.join(MODELS)}")
    parser.add_argument("--source", default=defaults.source, help=f"one of {', '.join(SOURCES)}")
    parser.add_argument("--data-dir", default=None, help="tensorflow-datasets data directory (--source tfds)")
    parser.add_argument("--tfrecords", default=None, help="shard pattern (--source tfrecord)")
    parser.add_argument("--replicas", type=_int_list, default=defaults.replicas, help="e.g. 1,2")
    parser.add_argument("--batch-size", dest="batch_sizes", type=_int_list, default=defaults.batch_sizes,
                        help="global batch(es), e.g. 64,256")
    parser.add_argument("--epochs", type=int, default=defaults.epochs, help="the first is warm-up, timed apart")
    parser.add_argument("--steps-per-epoch", type=int, default=defaults.steps_per_epoch)
    parser.add_argument("--image-size", type=int, default=defaults.image_size)
    parser.add_argument("--precision", default=defaults.precision, help=f"one of {', '.join(PRECISIONS)}")
    parser.add_argument("--strategy", default=defaults.strategy, help=f"one of {', '.join(STRATEGIES)}")
    parser.add_argument("--mode", default=defaults.mode,
                        help="train; input (is the job input-bound?); or profile (per-step time: compute, "
                             "all-reduce, input, other)")
    parser.add_argument("--mock-examples", type=int, default=defaults.mock_examples)
    parser.add_argument("--shards", type=int, default=defaults.shards, help="TFRecord shards to write")
    parser.add_argument("--cache-dir", default=defaults.cache_dir, help="where converted shards are kept")
    parser.add_argument("--json", default=None, help="write versions, devices, config and epoch times")
    parser.add_argument("--csv", default=None, help="write the table")
    parser.add_argument("--plot", default=None, help="write a PNG of images/s against replicas")
    return parser


def parse_config(argv: Sequence[str]) -> BenchConfig:
    """Parses and checks the command line.

    Raises:
        BenchError: a setting that cannot work (the message names it and the fix).
    """
    config = BenchConfig(**vars(build_parser().parse_args(argv)))
    check_config(config)
    return config


def check_config(config: BenchConfig) -> None:
    """Checks everything that needs no TensorFlow; see ``sources.check_dataset`` for the rest."""
    for name, value, choices in (("model", config.model, MODELS), ("source", config.source, SOURCES),
                                 ("precision", config.precision, PRECISIONS),
                                 ("strategy", config.strategy, STRATEGIES), ("mode", config.mode, MODES)):
        if value not in choices:
            raise BenchError(f"Unknown --{name} {value!r}; choose one of {list(choices)}.")
    for name in ("epochs", "steps_per_epoch", "image_size", "mock_examples", "shards"):
        if getattr(config, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be at least 1: received {getattr(config, name)}.")
    if config.epochs < 2:
        raise BenchError(f"--epochs {config.epochs} leaves nothing to time: the first epoch is warm-up "
                         "(tracing), reported apart. Use --epochs 2 or more.")
    if config.model in ("mobilenet_v2", "resnet50") and config.image_size < 32:
        raise BenchError(f"--image-size {config.image_size} is too small for {config.model}; use 32 or more.")
    if config.source == "tfrecord" and not config.tfrecords:
        raise BenchError("--source tfrecord needs --tfrecords PATTERN (e.g. 'shards/train-*.tfrecord').")
    for batch in config.batch_sizes:
        for replicas in config.replicas:
            if batch % replicas:
                raise BenchError(f"Global batch {batch} does not divide over {replicas} replicas; "
                                 f"use a multiple of {replicas} (e.g. {batch - batch % replicas or replicas}).")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, e.g. 1,2: received {text!r}")
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be at least 1: received {text!r}")
    return values
