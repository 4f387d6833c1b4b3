"""Where the benchmark's images come from: synthetic tensors, or TFRecord shards read by tfdist.data.

Real-file sources (mock, tfds, tfrecord) go through ``tfdist.data``: a tfds split is
written once to TFRecord shards under the cache directory, then read the way users
read theirs, so the benchmark times the pipeline they will run.
"""

from __future__ import annotations

import glob
import json
import os

import tensorflow as tf

from tfdist import data, extras
from tfdist.bench.config import BenchConfig, BenchError

_COMPLETE = "complete.json"


def num_classes(dataset: str) -> int:
    """Classes of a tensorflow-datasets image dataset, read from its code (offline).

    Raises:
        BenchError: not a tensorflow-datasets name, or not an image classification dataset.
    """
    tfds = extras.require("tensorflow_datasets", "tfdist bench")
    try:
        features = tfds.builder(dataset).info.features
    except tfds.core.registered.DatasetNotFoundError:
        raise BenchError(f"Unknown --dataset {dataset!r}: not a tensorflow-datasets name. Try tf_flowers, "
                         "cats_vs_dogs, mnist, cifar10, or see tfds.list_builders().") from None
    if "label" not in features or "image" not in features:
        raise BenchError(f"--dataset {dataset!r} has no 'image' and 'label' features; "
                         "tfdist bench times image classification datasets.")
    return features["label"].num_classes


def prepare_records(config: BenchConfig) -> str | None:
    """The shard pattern to read (written once per dataset/source/size), or None for synthetic."""
    if config.source == "synthetic":
        return None
    if config.source == "tfrecord":
        if not glob.glob(config.tfrecords):
            raise BenchError(f"--tfrecords {config.tfrecords!r} matches no file; check the path and quote the "
                             "pattern so the shell does not expand it.")
        return config.tfrecords
    size = config.mock_examples if config.source == "mock" else "all"
    out_dir = os.path.join(config.cache_dir, f"{config.dataset}-{config.source}-{size}-{config.shards}shards")
    marker = os.path.join(out_dir, _COMPLETE)
    if os.path.exists(marker):
        with open(marker) as f:
            return json.load(f)["pattern"]
    from tfdist.data import convert

    result = convert.convert(config.dataset, "train", out_dir, num_shards=config.shards, source=config.source,
                             data_dir=config.data_dir, num_examples=config.mock_examples, overwrite=True)
    with open(marker, "w") as f:
        json.dump({"pattern": result.pattern, "num_records": result.num_records}, f)
    return result.pattern


def train_dataset(config: BenchConfig, strategy: tf.distribute.Strategy, pattern: str | None,
                  global_batch: int, classes: int):
    """A distributed, endless dataset of (images in [0, 1], labels) at ``global_batch``."""
    size = config.image_size
    if pattern is None:
        def synthetic(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
            batch = ctx.get_per_replica_batch_size(global_batch)
            images = tf.random.stateless_uniform((batch, size, size, 3), seed=(0, ctx.input_pipeline_id))
            labels = tf.random.stateless_uniform((batch,), seed=(1, 0), maxval=classes, dtype=tf.int32)
            return tf.data.Dataset.from_tensors((images, labels)).repeat()
        return data.distribute(strategy, synthetic)
    return data.distribute(strategy, lambda ctx: records_dataset(config, pattern, global_batch, ctx))


def records_dataset(config: BenchConfig, pattern: str, batch: int,
                    ctx: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
    """tfdist's TFRecord pipeline over the shards: endless, shuffled, resized, scaled to [0, 1]."""
    return data.tfrecord_dataset(
        pattern, batch_size=batch, input_context=ctx, repeat=True, drop_remainder=True, features=["image", "label"],
        image_size=(config.image_size, config.image_size),
        parse_fn=lambda b: (tf.cast(b["image"], tf.float32) / 255.0, b["label"]))
