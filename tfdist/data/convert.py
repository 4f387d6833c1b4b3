"""``tfdist convert``: a tensorflow-datasets split into TFRecord shards.

    tfdist convert --dataset tf_flowers --split train --out shards --shards 16
    tfdist convert --dataset tf_flowers --split train --out shards --source mock

``--source tfds`` (the default) downloads and prepares the dataset into ``--data-dir``
(tfds' default directory if omitted), or reads it from there when it is prepared.
``--source mock`` needs no network: tfds' mock data gives random examples with the
dataset's real features, for trying a pipeline out.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from typing import Sequence

from tfdist import extras
from tfdist.data.records import IMAGE_FORMATS, DataError
from tfdist.data.writer import WriteResult, write_tfrecords
from tfdist.errors import ConvertError

SOURCES = ("tfds", "mock")


def convert(dataset: str, split: str, out_dir: str, *, num_shards: int = 16, source: str = "tfds",
            data_dir: str | None = None, num_examples: int = 64, prefix: str | None = None,
            image_format: str = "jpeg", overwrite: bool = False) -> WriteResult:
    """Writes one split of a tfds dataset into TFRecord shards (see the module docstring).

    Args:
        dataset: a tfds dataset name, e.g. "tf_flowers".
        split: a tfds split, e.g. "train" or "train[:10%]".
        out_dir: where the shards go.
        num_shards: how many shards.
        source: "tfds" (download or read prepared data) or "mock" (random examples).
        data_dir: tfds' data directory.
        num_examples: how many examples ``source="mock"`` makes.
        prefix: shard name prefix; defaults to the split, made file-name safe.
        image_format: "jpeg" or "png".
        overwrite: replace existing shards with this prefix.

    Returns:
        What ``write_tfrecords`` wrote.

    Raises:
        ConvertError: an unknown source or dataset, or a dataset that could not be
            downloaded or read.
    """
    if source not in SOURCES:
        raise ConvertError(f"Unknown source={source!r}; choose one of {list(SOURCES)}.")
    tfds = extras.require("tensorflow_datasets", "tfdist convert")

    prefix = prefix or re.sub(r"[^A-Za-z0-9_.-]+", "_", split).strip("_") or "data"
    mock = (tfds.testing.mock_data(num_examples=num_examples, policy=tfds.testing.MockPolicy.USE_CODE)
            if source == "mock" else contextlib.nullcontext())
    with mock:
        return write_tfrecords(_load(tfds, dataset, split, data_dir), out_dir, num_shards=num_shards,
                               prefix=prefix, image_format=image_format, overwrite=overwrite)


def _load(tfds, dataset: str, split: str, data_dir: str | None):
    """The split as a tf.data.Dataset, downloading it first if needed (failing fast when offline)."""
    from tensorflow_datasets.core.download import downloader

    try:
        builder = tfds.builder(dataset, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        raise ConvertError(f"tfds has no dataset named {dataset!r}; see "
                           "https://www.tensorflow.org/datasets/catalog for names.") from None
    if not builder.is_prepared():
        retries, downloader.MAX_RETRIES = downloader.MAX_RETRIES, 0  # offline: fail in a second, not minutes
        try:
            builder.download_and_prepare()
        except Exception as error:  # network errors come in many types (requests, OSError, tfds' own)
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ConvertError(
                f"Could not download and prepare {dataset!r} into {builder.data_dir}: "
                f"{type(error).__name__}: {first_line[:300]}. If this machine is offline, prepare the dataset "
                "elsewhere and pass its directory with --data-dir, or use --source mock for random examples "
                "with the real features.") from None
        finally:
            downloader.MAX_RETRIES = retries
    try:
        return builder.as_dataset(split=split)
    except (ValueError, KeyError) as error:
        raise ConvertError(f"Cannot read split {split!r} of {dataset!r}: {error}. Splits: "
                           f"{sorted(builder.info.splits)}.") from None


def build_parser() -> argparse.ArgumentParser:
    """The ``tfdist convert`` argument parser."""
    parser = argparse.ArgumentParser(prog="tfdist convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True, help="tfds dataset name, e.g. tf_flowers (required)")
    parser.add_argument("--split", default="train", help="tfds split (default: %(default)s)")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the shards (required)")
    parser.add_argument("--shards", type=int, default=16, help="number of shards (default: %(default)s)")
    parser.add_argument("--source", choices=SOURCES, default="tfds",
                        help="tfds: download or read prepared data; mock: random examples, no network "
                             "(default: %(default)s)")
    parser.add_argument("--data-dir", default=None, help="tfds data directory (default: tfds' own)")
    parser.add_argument("--num-examples", type=int, default=64,
                        help="examples --source mock makes (default: %(default)s)")
    parser.add_argument("--prefix", default=None, help="shard name prefix (default: the split)")
    parser.add_argument("--image-format", choices=IMAGE_FORMATS, default="jpeg",
                        help="how images are stored (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace existing shards with this prefix (default: off)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``tfdist convert`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        result = convert(args.dataset, args.split, args.out, num_shards=args.shards, source=args.source,
                         data_dir=args.data_dir, num_examples=args.num_examples, prefix=args.prefix,
                         image_format=args.image_format, overwrite=args.overwrite)
    except (DataError, FileExistsError) as error:
        print(f"tfdist convert: error: {error}", file=sys.stderr)
        return 1
    print(f"tfdist convert: wrote {result.num_records} records of {args.dataset} ({args.split}) "
          f"to {len(result.paths)} shards: {result.pattern}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
