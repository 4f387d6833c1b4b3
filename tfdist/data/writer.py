"""Writing examples into TFRecord shards: ``write_tfrecords``.

Examples go to shards round-robin (example i to shard i % num_shards), so shards
differ in size by at most one record. A prefix owns exactly its shards,
``PREFIX-00000-of-00016.tfrecord`` (``records.shard_glob``): the shards of ``mnist-test``
are never listed, replaced, deleted or matched by ``WriteResult.pattern`` for ``mnist``.
Every shard is written under a temporary directory inside ``out_dir``
(``.tmp-PREFIX-<8 hex>``) and moved to its final name only once all shards are complete:
a crash never leaves a half-written shard under a final name. Each move replaces the old
shard of that name in one step; old shards of another count go last, then
``.PREFIX.complete.json`` (the completion marker: a hash of the examples and settings,
and each shard's size) is written and the temporary directory removed.
``tfrecord_dataset`` refuses shards whose temporary directory is still there, so it never
reads a set being replaced. When the marker already matches, nothing is rewritten, with
or without ``overwrite``.

In a multi-worker job the script runs on every worker, so every worker may call
``write_tfrecords``: the chief decides and writes, the others hash the same examples and
follow it. The chief publishes, in the coordination service's key-value store
(``tfdist.kvstore``), the hash of its examples (in order, and in any order), then its
outcome: the record count, or its error, under a key of the call's number in this process
(``agreement.call_key``: the n-th call is one call on every worker, whatever its arguments). A worker whose
arguments differ from the chief's (``out_dir`` aside: a shared directory may be mounted at other places), or whose
hash differs, raises at once, saying whether its examples or only their order differ
(an unseeded shuffle); one whose chief raised (FileExistsError) raises the same; the
others wait until they see the chief's shards, then return the same result. A process
without a store (no multi-worker strategy) waits for the marker of its own examples
instead. The chief never waits for the others, so a script that calls it on the chief
only works as well.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
import uuid
from typing import Any, Callable, TypeVar

import numpy as np
import tensorflow as tf

from tfdist import cluster as cluster_lib
from tfdist import kvstore
from tfdist.data import agreement
from tfdist.data.records import (IMAGE_FORMATS, INDEX_KEY, MAX_SHARDS, DataError, shard_glob, shard_name,
                                 shown_shard_names)

_POLL_S = 0.2  # how often a worker waiting for the chief looks again
_NOTE_EVERY_S = 60.0  # how often it says that it is still waiting
_STORE_WAIT_MS = 1000  # how long one look waits for the chief's key to appear
_T = TypeVar("_T")


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
        """A file pattern matching exactly these shards (no other prefix's), for ``tfrecord_dataset``."""
        directory, first = os.path.split(self.paths[0])
        prefix = first[:-len(shard_name("", 0, len(self.paths)))]
        return os.path.join(directory, shard_glob(prefix, len(self.paths)))


@dataclasses.dataclass(frozen=True)
class _Examples:
    """What a source holds: ``fingerprint`` hashes the examples in order and the settings, ``content``
    the examples in any order."""

    fingerprint: str
    content: str
    count: int


def write_tfrecords(source: Any, out_dir: str, *, num_shards: int, prefix: str = "data",
                    image_format: str = "jpeg", jpeg_quality: int = 95, overwrite: bool = False) -> WriteResult:
    """Writes examples into ``num_shards`` TFRecord files of ``tf.train.Example``.

    In a multi-worker job, call it on every worker with the same arguments (as a script
    does): worker 0 writes, the others check that their examples are worker 0's, wait until
    its shards are complete and return the same result (or raise worker 0's error), so no
    worker reads early. ``out_dir`` must then be a directory every worker sees (a shared
    filesystem), and the source must give every worker the same examples in the same order.
    When the shards of the same examples and settings are complete in ``out_dir``, every
    worker returns them and nothing is rewritten (``overwrite`` or not).

    Args:
        source: a ``tf.data.Dataset`` of dicts (a tfds split) or of (image, label) pairs,
            a dict of NumPy arrays, or an (images, labels) pair of arrays. uint8 features of
            shape (H, W, C) or (H, W) are images; other features must be scalars or 1-D
            (numbers, booleans or strings). Floats are stored as float32.
        out_dir: the directory for the shards (created if missing).
        num_shards: how many files (1 to 99999); write at least as many as the workers that
            will read them, so each reads several files in parallel.
        prefix: shard names are ``prefix-00000-of-00016.tfrecord``.
        image_format: "jpeg" (smaller, lossy) or "png" (lossless).
        jpeg_quality: 1 to 100.
        overwrite: replace shards of this prefix (of any count) already in ``out_dir``.

    Returns:
        The shard paths and the number of records; ``result.pattern`` matches exactly these shards.

    Raises:
        DataError: bad arguments, an unsupported feature, an empty source, a source that
            already has a feature named "index", or (on a worker other than the chief) examples
            or an order other than the chief's.
        FileExistsError: shards of this prefix that are not these examples exist and
            ``overwrite`` is False (on every worker).
    """
    _check_arguments(num_shards, prefix, image_format, jpeg_quality)
    dataset = _as_dataset(source)
    kinds = _feature_kinds(dataset.element_spec, image_format)
    names = [shard_name(prefix, i, num_shards) for i in range(num_shards)]
    paths = tuple(os.path.join(out_dir, name) for name in names)
    settings = [names, image_format, jpeg_quality]
    # The n-th call of this process, never its arguments: a worker whose arguments differ meets worker 0 and is told.
    # out_dir is not compared: workers may mount the shared directory at other places.
    key = agreement.call_key("write_tfrecords")
    arguments = {"prefix": prefix, "num_shards": num_shards, "image_format": image_format,
                 "jpeg_quality": jpeg_quality, "overwrite": overwrite}
    job = cluster_lib.cluster_from_env()
    if job.is_chief:
        def write(examples: _Examples) -> WriteResult:
            return _write(dataset, kinds, out_dir, prefix, names, image_format, jpeg_quality, overwrite,
                          examples.fingerprint)
        return _publishing(key, arguments, lambda: _hash(dataset, settings), write)
    examples = _hash(dataset, settings)  # TF ran ops by now, so tfdist built its strategy and the store of a job
    rank = job.worker_index
    if not kvstore.available():
        count = _wait(rank, f"for worker 0's shards of these examples in {out_dir}: every worker must see that "
                            "directory (a shared filesystem), and read the same examples in the same order (an "
                            "unseeded shuffle or tfds shuffle_files=True differs per process: seed it, or write on "
                            "worker 0 only)", lambda: _finished(out_dir, prefix, examples.fingerprint))
        return WriteResult(paths, count)
    count = _wait(rank, f"for worker 0 to write these examples into {out_dir} (every worker must make the same "
                        "write_tfrecords calls, or only worker 0)", lambda: _chiefs_outcome(key, rank, examples,
                                                                                        arguments))
    _wait(rank, f"to see worker 0's shards in {out_dir}: every worker must see that directory (a shared filesystem)",
          lambda: all(tf.io.gfile.exists(path) for path in paths) or None)
    return WriteResult(paths, count)


def _publishing(key: str, arguments: dict, hash_examples: Callable[[], _Examples],
                write: Callable[[_Examples], WriteResult]) -> WriteResult:
    """The chief: publishes its ``arguments`` and its examples' hashes under ``key``, then the outcome of
    ``write``: its record count or its error (nothing without a store)."""
    published: dict[str, Any] = {"arguments": arguments}
    try:
        examples = hash_examples()
        published.update(dataclasses.asdict(examples))
        kvstore.put(key, json.dumps(published))
        result = write(examples)
    except Exception as error:
        kvstore.put(key, json.dumps({**published, "error": type(error).__name__, "message": str(error)}))
        raise
    kvstore.put(key, json.dumps({**published, "num_records": result.num_records}))
    return result


def _chiefs_outcome(key: str, rank: int, examples: _Examples, arguments: dict) -> int | None:
    """The chief's record count once its shards of ``examples`` are complete, None before.

    Raises:
        DataError: the chief's call (its ``arguments``), its examples, or their order, differ from this worker's;
            or the chief's write failed.
        FileExistsError: the chief's (shards of this prefix that are not these examples).
    """
    chiefs = json.loads(kvstore.get(key, _STORE_WAIT_MS) or "{}")
    theirs = chiefs.get("arguments", arguments)
    if theirs != arguments:
        number = key.rsplit("/", 1)[1]
        differ = ", ".join(f"{name}={arguments[name]!r} (worker 0: {theirs.get(name)!r})" for name in arguments
                           if theirs.get(name) != arguments[name])
        raise DataError(f"write_tfrecords: worker {rank}'s call {number} of write_tfrecords differs from worker 0's "
                        f"call {number}: {differ}. Every worker must make the same write_tfrecords calls in the same "
                        "order (or call it on worker 0 only, then tfdist.collectives.barrier()).")
    if chiefs.get("fingerprint", examples.fingerprint) != examples.fingerprint:
        raise _differs(rank, examples, chiefs)
    if chiefs.get("error") == "FileExistsError":
        raise FileExistsError(chiefs["message"])
    if "error" in chiefs:
        raise DataError(f"Worker 0 could not write these examples ({chiefs['error']}: {chiefs['message']}); "
                        "its output says why.")
    return chiefs.get("num_records")


def _differs(rank: int, mine: _Examples, chiefs: dict) -> DataError:
    """The error of a worker whose examples are not the chief's: their order, or the examples themselves."""
    if mine.content == chiefs["content"]:
        cause = (f"worker {rank} read the same {mine.count} examples as worker 0 in another order: the source's "
                 "order differs between workers (e.g. an unseeded shuffle or tfds shuffle_files=True). Seed it "
                 "(dataset.shuffle(n, seed=S); tfds.load(..., read_config=tfds.ReadConfig(shuffle_seed=S)))")
    else:
        cause = (f"worker {rank} read other examples than worker 0 ({mine.count} examples; worker 0 read "
                 f"{chiefs['count']}): the source's content differs between workers (e.g. examples made at random, "
                 "or loaded per worker). Give every worker the same examples")
    return DataError(f"write_tfrecords: {cause}, or write on worker 0 only (call write_tfrecords there, then "
                     "tfdist.collectives.barrier()).")


def _wait(rank: int, what: str, look: Callable[[], _T | None]) -> _T:
    """What ``look`` returns once it is not None; says every ``_NOTE_EVERY_S`` that worker ``rank`` still waits."""
    started = time.monotonic()
    next_note = started + _NOTE_EVERY_S
    while (found := look()) is None:
        if time.monotonic() > next_note:
            print(f"tfdist.data: worker {rank} has waited {time.monotonic() - started:.0f} s {what}.",
                  file=sys.stderr, flush=True)
            next_note += _NOTE_EVERY_S
        time.sleep(_POLL_S)
    return found


def _hash(dataset: tf.data.Dataset, settings: list) -> _Examples:
    """Hashes of every example's values, in order (with the settings that shape the shards) and in any order.

    Raises:
        DataError: the dataset holds no example.
    """
    ordered, total, count = hashlib.sha256(json.dumps(settings).encode()), 0, 0
    for count, example in enumerate(dataset.as_numpy_iterator(), start=1):
        digest = _example_digest(example)
        ordered.update(digest)
        total += int.from_bytes(digest, "little")  # a sum: the same in any order
    if count == 0:
        raise DataError("The source holds no example: nothing to write.")
    return _Examples(ordered.hexdigest(), f"{total % 2 ** 256:064x}", count)


def _example_digest(example: dict) -> bytes:
    """The SHA-256 of one example: each feature's name, dtype, shape and values."""
    digest = hashlib.sha256()
    for key in sorted(example):
        value = np.asarray(example[key])
        digest.update(f"{key}:{value.dtype}:{value.shape};".encode())
        if value.dtype == object:  # 1-D strings: bytes objects, each hashed with its length
            for item in value.reshape(-1):
                digest.update(len(item).to_bytes(8, "little") + item)
        else:
            digest.update(np.ascontiguousarray(value).tobytes())
    return digest.digest()


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
    """The chief's part: the complete set of these examples when it is there, else a new write of it."""
    paths = tuple(os.path.join(out_dir, n) for n in names)
    done = _finished(out_dir, prefix, fingerprint)
    if done is not None:  # these very examples are there, complete: nothing to replace
        return WriteResult(paths, done)
    existing = tf.io.gfile.glob(os.path.join(out_dir, shard_glob(prefix)))
    if existing and not overwrite:
        raise FileExistsError(f"{out_dir} already holds {len(existing)} shard(s) named {shown_shard_names(prefix)}, "
                              "not a complete write of these examples with these settings; pass overwrite=True to "
                              "replace them, or choose another prefix or out_dir.")
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
    """The glob of ``prefix``'s temporary directories (never another prefix's: 8 hex digits, no '-')."""
    return f".tmp-{prefix}-{'[0-9a-f]' * 8}"


def _check_arguments(num_shards: int, prefix: str, image_format: str, jpeg_quality: int) -> None:
    if not isinstance(num_shards, int) or isinstance(num_shards, bool) or not 1 <= num_shards <= MAX_SHARDS:
        raise DataError(f"num_shards must be an int from 1 to {MAX_SHARDS} (shard names hold 5 digits): "
                        f"received num_shards={num_shards!r}.")
    if not prefix or any(char in prefix for char in "/*?[\\"):
        raise DataError(f"prefix must be a non-empty file name part without '/' or glob characters (*?[\\): "
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
