"""The record format tfdist writes and reads, and a fast check of TFRecord files.

``write_tfrecords`` stores each example as a ``tf.train.Example``: uint8 images as
JPEG or PNG bytes, integers and booleans as int64, floats as float32, strings as
bytes (scalars and 1-D arrays), plus ``INDEX_KEY``, the example's position in its
source. ``infer_features`` reads that layout back from one record, so readers need
no schema file.

Shards are named ``PREFIX-00000-of-00016.tfrecord``; ``shard_glob`` matches exactly one
prefix's shards, never those of a prefix that starts with it (``mnist`` and ``mnist-test``).

``check_file`` walks a file's record headers (lengths and their CRC32C checksums)
without reading the payloads: it tells a non-TFRecord file or a truncated one
apart from a good one, with the file's name, before TensorFlow's reader fails
mid-epoch with a message that names no file.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Mapping

import tensorflow as tf

from tfdist.errors import DataError

INDEX_KEY = "index"
IMAGE_FORMATS = ("jpeg", "png")
MAX_SHARDS = 99_999  # shard names hold 5 digits
_DIGIT = "[0-9]"
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n")
_HEADER = struct.Struct("<QI")  # record length, masked CRC32C of the length
_FOOTER_BYTES = 4  # masked CRC32C of the payload


def shard_name(prefix: str, index: int, num_shards: int) -> str:
    """``prefix-00000-of-00016.tfrecord``."""
    return f"{prefix}-{index:05d}-of-{num_shards:05d}.tfrecord"


def shard_glob(prefix: str, num_shards: int | None = None) -> str:
    """The glob of ``prefix``'s shards (of ``num_shards`` files, or of any count), for ``tf.io.gfile.glob``.

    Five digit classes and a fixed ``-of-`` never match a ``-``, so the names of another prefix
    (``prefix-test-00000-of-00002.tfrecord``) never match. ``prefix`` holds no glob character.
    """
    count = _DIGIT * 5 if num_shards is None else f"{num_shards:05d}"
    return f"{prefix}-{_DIGIT * 5}-of-{count}.tfrecord"


def shown_shard_names(prefix: str) -> str:
    """How messages name ``prefix``'s shards: ``prefix-NNNNN-of-NNNNN.tfrecord``."""
    return f"{prefix}-NNNNN-of-NNNNN.tfrecord"


@dataclasses.dataclass(frozen=True)
class ImageInfo:
    """An encoded image feature, as seen in the first record."""

    height: int
    width: int
    channels: int


@dataclasses.dataclass(frozen=True)
class FileCheck:
    """What ``check_file`` found: the complete records and, for a damaged file, the damage."""

    path: str
    num_records: int  # complete records before any damage
    problem: str | None = None
    first_crc: int | None = None  # the stored checksum of the first record's payload: what the file holds, cheaply


def check_file(path: str) -> FileCheck:
    """Walks the record headers of one TFRecord file (payload checksums are read, not checked, for the first
    record only: ``FileCheck.first_crc``)."""
    size = tf.io.gfile.stat(path).length
    count, offset, first_crc = 0, 0, None
    with tf.io.gfile.GFile(path, "rb") as f:
        while offset < size:
            header = f.read(_HEADER.size)
            if len(header) < _HEADER.size:
                return FileCheck(path, count, f"truncated: {len(header)} stray bytes at the end (byte {offset})",
                                 first_crc)
            length, length_crc = _HEADER.unpack(header)
            if _masked_crc32c(header[:8]) != length_crc:
                what = "not a TFRecord file" if count == 0 else f"corrupted record header at byte {offset}"
                return FileCheck(path, count, what, first_crc)
            end = offset + _HEADER.size + length + _FOOTER_BYTES
            if end > size:
                return FileCheck(path, count, f"truncated: record {count} at byte {offset} needs "
                                              f"{end - offset} bytes, the file ends at byte {size}", first_crc)
            if count == 0:
                f.seek(end - _FOOTER_BYTES)
                first_crc = int.from_bytes(f.read(_FOOTER_BYTES), "little")
            offset = end
            f.seek(offset)
            count += 1
    return FileCheck(path, count, None, first_crc)


def first_record(path: str) -> bytes:
    """The first serialized record of a file that ``check_file`` found records in."""
    for record in tf.data.TFRecordDataset(path).take(1):
        return record.numpy()
    raise DataError(f"{path} holds no record.")


def infer_features(record: bytes, source: str) -> tuple[dict[str, tf.io.FixedLenFeature], dict[str, ImageInfo]]:
    """Parsing specs for every feature of one serialized ``tf.train.Example``, and its images.

    A feature holding one value parses to a scalar, several to a 1-D tensor; a bytes
    feature holding one JPEG or PNG image is an image.

    Raises:
        DataError: the record is not a ``tf.train.Example``.
    """
    try:
        example = tf.train.Example.FromString(record)
    except Exception as error:  # protobuf's DecodeError
        raise DataError(f"The first record of {source} is not a tf.train.Example ({error}); "
                        "pass parse_fn for another format.") from None
    specs, images = {}, {}
    for key, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        values = getattr(feature, kind).value if kind else []
        dtype = {"bytes_list": tf.string, "int64_list": tf.int64, "float_list": tf.float32}.get(kind, tf.string)
        specs[key] = tf.io.FixedLenFeature([] if len(values) == 1 else [len(values)], dtype)
        if kind == "bytes_list" and len(values) == 1 and values[0].startswith(_IMAGE_MAGIC):
            height, width, channels = tf.io.decode_image(values[0], expand_animations=False).shape
            images[key] = ImageInfo(height, width, channels)
    return specs, images


def select_features(features, record: bytes, source: str):
    """Resolves ``tfrecord_dataset(features=...)`` against the first record.

    Args:
        features: None (every feature of the record), a sequence of feature names, or
            a mapping of names to ``tf.io`` parsing specs.
        record: the first serialized record.
        source: the file it came from, for messages.

    Returns:
        (specs, images): the parsing specs, and the image features among them.

    Raises:
        DataError: a requested feature is not in the record.
    """
    specs, images = infer_features(record, source)
    if features is None:
        return specs, images
    wanted = list(features)
    missing = [key for key in wanted if key not in specs]
    if missing:
        raise DataError(f"Feature(s) {missing} requested in features= are not in the records of {source}, "
                        f"which hold {sorted(specs)}. Fix the names, or pass features=None to read them all.")
    if isinstance(features, Mapping):
        chosen = dict(features)
        images = {key: info for key, info in images.items()
                  if key in chosen and getattr(chosen[key], "dtype", None) == tf.string
                  and tuple(getattr(chosen[key], "shape", (0,))) == ()}
    else:
        chosen = {key: specs[key] for key in wanted}
        images = {key: info for key, info in images.items() if key in chosen}
    return chosen, images


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC32C (Castagnoli), rotated and offset."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
