"""Writing examples into TFRecord shards: ``write_tfrecords``.

Examples go to shards round-robin (example i to shard i % num_shards), so shards
differ in size by at most one record. Every shard is written under a temporary
directory inside ``out_dir`` (``.tmp-PREFIX-*``) and moved to its final name only once
all shards are complete: a crash never leaves a half-written shard under a final name.
Each move replaces the old shard of that name in one step; old shards of another count
go last, then ``.PREFIX.complete.json`` (the completion marker: a hash of the examples
and settings, and each shard's size) is written and the temporary directory removed.
``tfrecord_dataset`` refuses shards whose temporary directory is still there, so it
never reads a set being replaced.

In a multi-worker job the script runs on every worker, so every worker may call
``write_tfrecords``: the chief writes, the others hash the same examples and wait until
the marker says the chief's shards of those examples are complete. Nothing is
exchanged between workers, so a script that calls it on the chief only works as well.
When the marker already matches, nothing is rewritten.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
import uuid
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist import cluster as cluster_lib
from tfdist.data.records import IMAGE_FORMATS, INDEX_KEY, DataError


_POLL_S = 0.2  # how often a worker waiting for the chief's write looks again
_NOTE_EVERY_S = 60.0  # how often it says that it is still waiting


def _before_each_move() -> None:
    """Called before each shard moves into place: tests replace it to widen the window in which
    another worker could read a half-replaced set."""


@dataclasses.dataclass(frozen=True)
class WriteResult:
    """The shards ``write_tfrecords`` wrote."""

    paths: tuple[str, ...]
    num_records: int

    @property
    def pattern(self) -> str:
        """A file pattern matching these shards, for ``tfrecord_dataset``."""
        first = self.paths[0]
        prefix = first[:first.rindex("-", 0, first.rindex("-of-"))]
        return f"{prefix}-*-of-{len(self.paths):05d}.tfrecord"


def shard_name(prefix: str, index: int, num_shards: int) -> str:
    """``prefix-00000-of-00016.tfrecord``."""
    return f"{prefix}-{index:05d}-of-{num_shards:05d}.tfrecord"


def write_tfrecords(source: Any, out_dir: str, *, num_shards: int, prefix: str = "data",
                    image_format: str = "jpeg", jpeg_quality: int = 95, overwrite: bool = False) -> WriteResult:
    """Writes examples into ``num_shards`` TFRecord files of ``tf.train.Example``.

    In a multi-worker job, call it on every worker with the same arguments (as a script
    does): worker 0 writes, the others wait until its shards of the same examples are
    complete and return the same result, so no worker reads early. ``out_dir`` must then
    be a directory every worker sees (a shared filesystem). Shards of the same examples
    and settings already complete in ``out_dir`` are not rewritten.

    Args:
        source: a ``tf.data.Dataset`` of dicts (a tfds split) or of (image, label) pairs,
            a dict of NumPy arrays, or an (images, labels) pair of arrays. uint8 features of
            shape (H, W, C) or (H, W) are images; other features must be scalars or 1-D
            (numbers, booleans or strings). Floats are stored as float32.
        out_dir: the directory for the shards (created if missing).
        num_shards: how many files; write at least as many as the workers that will read
            them, so each reads whole files.
        prefix: shard names are ``prefix-00000-of-00016.tfrecord``.
        image_format: "jpeg" (smaller, lossy) or "png" (lossless).
        jpeg_quality: 1 to 100.
        overwrite: replace shards already in ``out_dir`` under this prefix.

    Returns:
        The shard paths and the number of records; ``result.pattern`` matches the shards.

    Raises:
        DataError: bad arguments, an unsupported feature, an empty source, or a source
            that already has a feature named "index".
        FileExistsError: shards with this prefix exist and ``overwrite`` is False.
    """
    _check_arguments(num_shards, prefix, image_format, jpeg_quality)
    dataset = _as_dataset(source)
    kinds = _feature_kinds(dataset.element_spec, image_format)
    names = [shard_name(prefix, i, num_shards) for i in range(num_shards)]
    fingerprint = _fingerprint(dataset, [names, image_format, jpeg_quality])
    job = cluster_lib.cluster_from_env()
    if job.is_chief:
        return _write(dataset, kinds, out_dir, prefix, names, image_format, jpeg_quality, overwrite, fingerprint)
    return _wait_for_the_chief(job.worker_index, out_dir, prefix, names, fingerprint)


def _fingerprint(dataset: tf.data.Dataset, settings: list) -> str:
    """A hash of every example's values, in order, and of the settings that shape the shards.

    Raises:
        DataError: the dataset holds no example.
    """
    digest, count = hashlib.sha256(json.dumps(settings).encode()), 0
    for count, example in enumerate(dataset.as_numpy_iterator(), start=1):
        for key in sorted(example):
            value = np.asarray(example[key])
            digest.update(f"{key}:{value.dtype}:{value.shape};".encode())
            if value.dtype == object:  # 1-D strings: bytes objects, each hashed with its length
                for item in value.reshape(-1):
                    digest.update(len(item).to_bytes(8, "little") + item)
            else:
                digest.update(np.ascontiguousarray(value).tobytes())
    if count == 0:
        raise DataError("The source holds no example: nothing to write.")
    return digest.hexdigest()


def _wait_for_the_chief(rank: int, out_dir: str, prefix: str, names: list[str], fingerprint: str) -> WriteResult:
    """A worker other than the chief: waits until the chief's shards of these very examples are complete."""
    started = time.monotonic()
    next_note = started + _NOTE_EVERY_S
    while (count := _finished(out_dir, prefix, fingerprint)) is None:
        if time.monotonic() > next_note:
            print(f"tfdist.data: worker {rank} has waited {time.monotonic() - started:.0f} s for worker 0 to write "
                  f"these examples into {out_dir} (every worker must see that directory: a shared filesystem).",
                  file=sys.stderr, flush=True)
            next_note += _NOTE_EVERY_S
        time.sleep(_POLL_S)
    return WriteResult(tuple(os.path.join(out_dir, n) for n in names), count)


def _finished(out_dir: str, prefix: str, fingerprint: str) -> int | None:
    """The record count of a complete write of ``fingerprint`` in ``out_dir``, else None."""
    marker = os.path.join(out_dir, _marker_name(prefix))
    if tf.io.gfile.glob(os.path.join(out_dir, _temp_pattern(prefix))) or not tf.io.gfile.exists(marker):
        return None
    try:
        with tf.io.gfile.GFile(marker) as f:
            done = json.loads(f.read() or "{}")
        sizes = done.get("sizes") or {}
        complete = done.get("fingerprint") == fingerprint and sizes and all(
            tf.io.gfile.stat(os.path.join(out_dir, name)).length == size for name, size in sizes.items())
    except tf.errors.NotFoundError:  # a shard is missing, or the chief began another write meanwhile
        return None
    return done["num_records"] if complete else None


def _write(dataset: tf.data.Dataset, kinds: dict[str, str], out_dir: str, prefix: str, names: list[str],
           image_format: str, jpeg_quality: int, overwrite: bool, fingerprint: str) -> WriteResult:
    existing = tf.io.gfile.glob(os.path.join(out_dir, f"{prefix}-*-of-*.tfrecord"))
    if existing and not overwrite:
        raise FileExistsError(f"{out_dir} already holds {len(existing)} shard(s) named {prefix}-*-of-*.tfrecord; "
                              "pass overwrite=True to replace them, or choose another prefix or out_dir.")
    paths = tuple(os.path.join(out_dir, n) for n in names)
    done = _finished(out_dir, prefix, fingerprint)
    if done is not None:  # these very examples are there, complete: nothing to replace
        return WriteResult(paths, done)
    tf.io.gfile.makedirs(out_dir)
    for stale in tf.io.gfile.glob(os.path.join(out_dir, _temp_pattern(prefix))):  # left by a killed write
        tf.io.gfile.rmtree(stale)
    encoded = dataset.map(_encoder(kinds, image_format, jpeg_quality), num_parallel_calls=tf.data.AUTOTUNE)
    temp_dir = os.path.join(out_dir, f".tmp-{prefix}-{uuid.uuid4().hex[:8]}")
    marker = os.path.join(out_dir, _marker_name(prefix))
    try:
        tf.io.gfile.makedirs(temp_dir)
        count = _write_shards(encoded, kinds, [os.path.join(temp_dir, n) for n in names])
        sizes = {name: tf.io.gfile.stat(os.path.join(temp_dir, name)).length for name in names}
        if tf.io.gfile.exists(marker):
            tf.io.gfile.remove(marker)
        for name, path in zip(names, paths):
            _before_each_move()
            tf.io.gfile.rename(os.path.join(temp_dir, name), path, overwrite=True)  # old shard -> new, in one step
        for path in set(existing) - set(paths):
            tf.io.gfile.remove(path)
        with tf.io.gfile.GFile(os.path.join(temp_dir, "marker"), "w") as f:
            f.write(json.dumps({"fingerprint": fingerprint, "num_records": count, "sizes": sizes}))
        tf.io.gfile.rename(os.path.join(temp_dir, "marker"), marker, overwrite=True)
    finally:
        if tf.io.gfile.exists(temp_dir):
            tf.io.gfile.rmtree(temp_dir)
    return WriteResult(paths, count)


def _marker_name(prefix: str) -> str:
    return f".{prefix}.complete.json"


def _temp_pattern(prefix: str) -> str:
    return f".tmp-{prefix}-{'?' * 8}"


def _check_arguments(num_shards: int, prefix: str, image_format: str, jpeg_quality: int) -> None:
    if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards < 1:
        raise DataError(f"num_shards must be a positive int: received num_shards={num_shards!r}.")
    if not prefix or any(char in prefix for char in "/*?["):
        raise DataError(f"prefix must be a non-empty file name part without '/' or glob characters (*?[): "
                        f"received prefix={prefix!r}.")
    if image_format not in IMAGE_FORMATS:
        raise DataError(f"Unknown image_format={image_format!r}; choose one of {list(IMAGE_FORMATS)}.")
    if not isinstance(jpeg_quality, int) or not 1 <= jpeg_quality <= 100:
        raise DataError(f"jpeg_quality must be an int from 1 to 100: received jpeg_quality={jpeg_quality!r}.")


def _as_dataset(source: Any) -> tf.data.Dataset:
    """A dataset of dicts from any accepted source."""
    if isinstance(source, (dict, tuple, list)) and not isinstance(source, tf.data.Dataset):
        if isinstance(source, (tuple, list)) and len(source) != 2:
            raise DataError(f"An array source must be a dict of arrays or an (images, labels) pair; "
                            f"received a {type(source).__name__} of {len(source)} items.")
        source = tf.data.Dataset.from_tensor_slices(source if isinstance(source, dict) else tuple(source))
    if not isinstance(source, tf.data.Dataset):
        raise DataError(f"Cannot write a source of type {type(source).__name__}: pass a tf.data.Dataset "
                        "(e.g. a tfds split), a dict of NumPy arrays, or an (images, labels) pair.")
    spec = source.element_spec
    if isinstance(spec, tuple) and len(spec) == 2:
        return source.map(lambda image, label: {"image": image, "label": label})
    if not isinstance(spec, dict):
        raise DataError(f"Dataset elements must be dicts or (image, label) pairs; received elements of {spec}.")
    return source


def _feature_kinds(spec: dict, image_format: str) -> dict[str, str]:
    """Each feature's storage: "image", "bytes", "int" or "float"."""
    if INDEX_KEY in spec:
        raise DataError(f"The source already has a feature named {INDEX_KEY!r}, which write_tfrecords uses for "
                        "each example's position; rename it.")
    kinds = {}
    for key, tensor_spec in spec.items():
        if not isinstance(tensor_spec, tf.TensorSpec):
            raise DataError(f"Feature {key!r} is a {type(tensor_spec).__name__}; write_tfrecords stores dense "
                            "tensors only: convert it first.")
        rank, dtype = tensor_spec.shape.rank, tensor_spec.dtype
        channels = tensor_spec.shape[-1] if rank == 3 else 1
        if dtype == tf.uint8 and rank in (2, 3):
            allowed = (1, 3) if image_format == "jpeg" else (1, 2, 3, 4)
            if channels is not None and channels not in allowed:
                raise DataError(f"Image feature {key!r} has {channels} channels; {image_format} stores "
                                f"{allowed}. Use image_format='png' or convert the images.")
            kinds[key] = "image"
        elif rank is None or rank > 1:
            raise DataError(f"Feature {key!r} has shape {tensor_spec.shape} and dtype {dtype.name}; write_tfrecords "
                            "stores scalars, 1-D arrays and uint8 images (H, W[, C]): reshape or flatten it.")
        elif dtype == tf.string:
            kinds[key] = "bytes"
        elif dtype.is_integer or dtype == tf.bool:
            kinds[key] = "int"
        elif dtype.is_floating:
            kinds[key] = "float"
        else:
            raise DataError(f"Feature {key!r} has dtype {dtype.name}, which a tf.train.Example cannot hold; "
                            "cast it to an integer, float or string type.")
    return kinds


def _encoder(kinds: dict[str, str], image_format: str, jpeg_quality: int):
    """The tf.data map function that encodes images (in parallel, in the graph)."""
    def encode(example):
        out = dict(example)
        for key, kind in kinds.items():
            if kind != "image":
                continue
            image = example[key] if example[key].shape.rank == 3 else example[key][..., tf.newaxis]
            out[key] = (tf.io.encode_jpeg(image, quality=jpeg_quality) if image_format == "jpeg"
                        else tf.io.encode_png(image))
        return out
    return encode


def _write_shards(encoded: tf.data.Dataset, kinds: dict[str, str], paths: list[str]) -> int:
    writers = [tf.io.TFRecordWriter(path) for path in paths]
    count = 0
    try:
        for count, example in enumerate(encoded.as_numpy_iterator(), start=1):
            features = {key: _feature(value, kinds[key]) for key, value in example.items()}
            features[INDEX_KEY] = tf.train.Feature(int64_list=tf.train.Int64List(value=[count - 1]))
            record = tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()
            writers[(count - 1) % len(writers)].write(record)
    finally:
        for writer in writers:
            writer.close()
    return count


def _feature(value: Any, kind: str) -> tf.train.Feature:
    if kind in ("image", "bytes"):  # not via NumPy, whose bytes arrays drop trailing NULs
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value] if isinstance(value, bytes) else list(value)))
    values = np.atleast_1d(value)
    if kind == "int":
        return tf.train.Feature(int64_list=tf.train.Int64List(value=values.astype(np.int64).tolist()))
    return tf.train.Feature(float_list=tf.train.FloatList(value=values.astype(np.float32).tolist()))
