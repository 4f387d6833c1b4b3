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
_CACHE_SHOWN = os.path.join("~", ".cache", "tfdist", "bench")
DEFAULT_CACHE = os.path.expanduser(_CACHE_SHOWN)


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
    """The ``tfdist bench`` argument parser; every flag's help ends with its default."""
    parser = argparse.ArgumentParser(
        prog="tfdist bench",
        description="Time training on 1 vs N replicas (s/epoch, images/s, speedup, scaling efficiency).",
        epilog="With no arguments: tf_flowers shapes from mock data, MobileNetV2 at 64x64, 1 vs 2 replicas.")
    d = BenchConfig()
    parser.add_argument("--dataset", default=d.dataset, metavar="NAME",
                        help="a tensorflow-datasets image dataset (default: %(default)s)")
    parser.add_argument("--model", default=d.model, metavar="NAME",
                        help=f"one of {', '.join(MODELS)} (default: %(default)s)")
    parser.add_argument("--source", default=d.source, metavar="NAME",
                        help=f"one of {', '.join(SOURCES)} (default: %(default)s)")
    parser.add_argument("--data-dir", default=None, metavar="DIR",
                        help="tensorflow-datasets data directory, for --source tfds (default: tfds' own)")
    parser.add_argument("--tfrecords", default=None, metavar="PATTERN",
                        help="shard pattern, for --source tfrecord (default: none)")
    parser.add_argument("--replicas", type=_int_list, default=d.replicas, metavar="LIST",
                        help=f"replica counts to time, e.g. 1,2,4 (default: {_listed(d.replicas)})")
    parser.add_argument("--batch-size", dest="batch_sizes", type=_int_list, default=d.batch_sizes, metavar="LIST",
                        help=f"global batch(es), e.g. 64,256 (default: {_listed(d.batch_sizes)})")
    parser.add_argument("--epochs", type=int, default=d.epochs, metavar="N",
                        help="epochs; the first is warm-up, timed apart (default: %(default)s)")
    parser.add_argument("--steps-per-epoch", type=int, default=d.steps_per_epoch, metavar="N",
                        help="steps of each epoch (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=d.image_size, metavar="SIZE",
                        help="images are resized to SIZE x SIZE (default: %(default)s)")
    parser.add_argument("--precision", default=d.precision, metavar="NAME",
                        help=f"one of {', '.join(PRECISIONS)} (default: %(default)s)")
    parser.add_argument("--strategy", default=d.strategy, metavar="NAME",
                        help=f"one of {', '.join(STRATEGIES)} (default: %(default)s)")
    parser.add_argument("--mode", default=d.mode, metavar="MODE",
                        help="train; input (is the job input-bound?); or profile (per-step time: compute, "
                             "all-reduce, input, other) (default: %(default)s)")
    parser.add_argument("--mock-examples", type=int, default=d.mock_examples, metavar="N",
                        help="examples --source mock makes (default: %(default)s)")
    parser.add_argument("--shards", type=int, default=d.shards, metavar="N",
                        help="TFRecord shards to write (default: %(default)s)")
    parser.add_argument("--cache-dir", default=d.cache_dir, metavar="DIR",
                        help=f"where converted shards are kept (default: {_CACHE_SHOWN})")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="write versions, devices, config and epoch times (default: none)")
    parser.add_argument("--csv", default=None, metavar="FILE", help="write the table (default: none)")
    parser.add_argument("--plot", default=None, metavar="FILE",
                        help="write a PNG of images/s against replicas; needs tfdist[bench] (default: none)")
    return parser


def _listed(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


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
