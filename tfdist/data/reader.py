"""Reading TFRecord shards for training: ``tfrecord_dataset`` and ``distribute``.

The pipeline, per epoch: list the files -> order them for this epoch -> shard per
input pipeline -> read files in parallel (interleave) -> shuffle records -> then
batch -> parse and decode whole batches (parallel map) -> prefetch.

Which worker reads which record depends only on what every worker shares: the file
list, the pipeline's ``seed`` and the epoch number. The file order of epoch ``e`` is a
stateless permutation seeded by ``(seed, e)``, so it is the same on every worker
whatever global seed each process set (``tf.random.set_seed(100 + rank)`` is a common
idiom); the epoch's records, in that order, are cut into one contiguous part per input
pipeline, of sizes that differ by one record at most, whatever the number of files and
their sizes (``tfdist.data.epochs``). With ``seed`` given, the record shuffle inside a part is a function of
``(seed, epoch, pipeline, pipelines)`` too (``tfdist.data.epochs``), so a fit resumed
mid-epoch, on any worker count, can read exactly the records its interrupted run had not;
without, it and augmentation use the process's own random state.

A part holds whole files, and a run of records of the one or two files at its ends
that it shares with its neighbours: the pipeline skips the records before its run (record
headers are read, payloads not). With fewer files than pipelines, a part lies within one
or two files, read with little parallelism (a warning says to write more files). Every
record is read exactly once per epoch across all pipelines.

Sharded over several workers, the dataset is built only once every worker lists the same
files with the same record counts (``agreement.check_same_files``: a digest each through
the job's key-value store, the lists only when digests differ): a shared filesystem that
lags, or a glob taken before a writer finished, would otherwise break "exactly once"
silently.

A ``cache=`` path gets a name of its own per input pipeline, keyed by the pipeline's
index and count and a hash of the files (names, sizes, modification times) and the
file order's settings: workers never share a cache, and a cache left by a run with
another worker count or other files is never read.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import warnings
from typing import Callable, Mapping, Sequence, Union

import tensorflow as tf

from tfdist import cluster as cluster_lib
from tfdist.data import agreement, epochs, records
from tfdist.data.records import DataError
from tfdist.errors import ShardingWarning

FilePattern = Union[str, Sequence[str], tf.data.Dataset]
# The file-order seed when none is given: a constant, so all workers agree without talking.
_DEFAULT_FILE_SEED = 20261122
# File caches this process has handed out: a lock file found before the first hand-out is stale.
_CACHES_IN_USE: set[str] = set()


def tfrecord_dataset(file_pattern: FilePattern, *, batch_size: int,
                     features: Mapping[str, object] | Sequence[str] | None = None,
                     parse_fn: Callable | None = None, input_context: tf.distribute.InputContext | None = None,
                     shuffle: bool = True, shuffle_buffer: int = 4096, seed: int | None = None,
                     repeat: bool | int = False, cache: bool | str = False, drop_remainder: bool | None = None,
                     image_size: tuple[int, int] | None = None, augment: bool = False,
                     deterministic: bool | None = None, skip_corrupt: bool = False) -> tf.data.Dataset:
    """A batched dataset of parsed, decoded records from TFRecord files.

    Args:
        file_pattern: a glob pattern (``"out/data-*.tfrecord"``), a list of patterns or file names (a name
            without glob characters must exist), or a ``tf.data.Dataset`` of file names
            (``tf.data.Dataset.list_files``); the order does not matter (the files are sorted).
        batch_size: with ``input_context``, the GLOBAL batch, split evenly over the
            replicas; without, the batch this dataset yields.
        features: None reads every feature the records hold (what ``write_tfrecords``
            wrote); a list of names reads those; a mapping of names to ``tf.io`` specs
            parses with those specs. Encoded images among them are decoded to uint8.
        parse_fn: called on each parsed, decoded batch (a dict of batched tensors), in
            the same parallel map; returns what the model takes, e.g.
            ``lambda b: (tf.cast(b["image"], "float32") / 255, b["label"])``.
        input_context: the ``tf.distribute.InputContext`` that ``distribute`` (or
            ``strategy.distribute_datasets_from_function``) passes; shards the files. With
            more than one input pipeline in a multi-worker job, the workers first check,
            through the job's key-value store, that they all list the same files with the
            same record counts (``tfdist.data.agreement``).
        shuffle: shuffle the file order (the same on every worker; a new order each epoch
            of ``repeat``, while without ``repeat``, or with a cache, every pass reads the
            first epoch's files) and the records within each worker's share (through
            ``shuffle_buffer`` serialized records, a new order each pass or epoch).
        shuffle_buffer: records held for shuffling (memory: this many encoded records).
        seed: the file order's seed, which every worker must share (a constant when
            None); also makes the record order reproducible, whatever the process's global
            seed (and, with ``deterministic`` left None, keeps parallel reading in order),
            which a mid-epoch resume needs to skip exactly the records already read. Never
            derive it from the rank.
        repeat: True repeats forever, an int that many epochs.
        cache: True caches this pipeline's serialized records in memory during the first
            epoch; a string is a path prefix for a file cache: each input pipeline
            caches to ``PREFIX-<pipeline>-of-<pipelines>-<hash of files and settings>``
            (the directory is created), so one string serves every worker. A pipeline
            with a cache reads the same files every epoch (the first epoch's).
        drop_remainder: drop a last partial batch; None drops it only when repeating,
            which gives every batch a static size.
        image_size: (height, width) to resize images to; needed when image sizes differ.
        augment: flip images left-right at random.
        deterministic: keep record order under parallelism; None keeps it when a seed is
            given or shuffling is off, and otherwise lets the fastest record go first (then
            with ``repeat`` a batch of the next epoch may come before the last of this one).
        skip_corrupt: skip damaged data (keeping a damaged file's records before the
            damage) with a warning that counts it, instead of raising. Files are checked
            record header by record header when the dataset is built; a damaged record
            payload only shows when it is read: then TensorFlow's reader gives up the rest of
            that file's run in the pipeline (the damaged record and those after it, uncounted
            by the warning), or, without skip_corrupt, stops the epoch with DataLossError.

    Returns:
        A ``tf.data.Dataset`` of batches.

    Raises:
        FileNotFoundError: ``file_pattern`` matches no file.
        DataError: a damaged or non-TFRecord file (unless ``skip_corrupt``), a feature
            missing from the records, fewer records than input pipelines with ``repeat``,
            or a bad batch size or argument; on every worker,
            workers that list other files (naming them), or a peer that did not list its
            files within the hang timeout.
    """
    batch = per_pipeline_batch_size(batch_size, input_context)
    _check_arguments(shuffle_buffer, image_size, repeat, seed, cache)
    pipelines = input_context.num_input_pipelines if input_context else 1
    paths, counts, source = _listed_alike_on_every_worker(file_pattern, skip_corrupt, pipelines)
    if repeat and sum(counts) < pipelines:  # a pipeline with no record would look for one epoch after epoch
        raise DataError(f"file_pattern={source} holds {sum(counts)} record(s), fewer than the {pipelines} input "
                        "pipelines: with repeat, every pipeline needs one at least. Write more records, or read with "
                        "fewer workers.")
    _warn_if_record_level(len(paths), pipelines)
    ordered = (seed is not None or not shuffle) if deterministic is None else deterministic
    files = epochs.Files(tuple(paths), tuple(counts), _DEFAULT_FILE_SEED if seed is None else seed, seed is not None,
                         shuffle, shuffle_buffer, ordered, skip_corrupt)
    pipeline_id = input_context.input_pipeline_id if input_context else 0
    if cache or not repeat:  # the same files every epoch (a cache replays the first), records reshuffled
        dataset = epochs.unshuffled(files, tf.constant(0, tf.int64), pipeline_id, pipelines, epochs.records(files))
        if cache:
            settings = [counts, files.seed, shuffle, skip_corrupt, epochs.SPLIT]  # never a cache of another split
            dataset = dataset.cache("" if cache is True else _cache_path(cache, pipeline_id, pipelines, paths, settings))
        dataset = dataset.shuffle(shuffle_buffer, seed=seed) if shuffle else dataset
        if repeat:
            dataset = dataset.repeat(None if repeat is True else repeat)
    else:  # a new file order each epoch, each epoch shuffled apart; a resumed fit starts where its backup was
        dataset = epochs.Starts(files, pipeline_id, pipelines, batch_size).dataset(None if repeat is True else repeat)
    dataset = dataset.batch(batch, drop_remainder=bool(repeat) if drop_remainder is None else drop_remainder)
    decode = batch_parser(paths[0], features=features, image_size=image_size, augment=augment, seed=seed,
                          parse_fn=parse_fn)
    dataset = dataset.map(decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=ordered)
    return dataset.prefetch(tf.data.AUTOTUNE)


def distribute(strategy: tf.distribute.Strategy | None,
               dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset],
               options: tf.distribute.InputOptions | None = None):
    """Builds one input pipeline per worker through ``strategy.distribute_datasets_from_function``.

    TensorFlow calls ``dataset_fn(input_context)`` on each worker and does no sharding
    of its own: pass the context on to ``tfrecord_dataset(..., input_context=ctx)``,
    which gives each worker an equal part of every epoch (to one record) and splits the
    global ``batch_size`` per replica. Train with ``repeat=True`` and ``steps_per_epoch``,
    which keeps the workers' steps in lock-step (a part one record longer, or a last
    partial batch, would otherwise give one worker a step more)::

        dataset = tfdist.data.distribute(strategy, lambda ctx: tfdist.data.tfrecord_dataset(
            "shards/train-*.tfrecord", batch_size=256, input_context=ctx, repeat=True))
        model.fit(dataset, epochs=10, steps_per_epoch=num_records // 256)

    Args:
        strategy: the strategy; None uses the current one (``tf.distribute.get_strategy()``).
        dataset_fn: builds this worker's dataset of per-replica batches from an InputContext.
        options: ``tf.distribute.InputOptions`` (prefetching to devices and the like).

    Returns:
        A distributed dataset that ``model.fit`` and ``strategy.run`` loops accept.
    """
    strategy = strategy or tf.distribute.get_strategy()
    if not callable(dataset_fn):
        raise DataError(f"dataset_fn must be a function of a tf.distribute.InputContext; received {dataset_fn!r}.")
    return strategy.distribute_datasets_from_function(dataset_fn, options)


def per_pipeline_batch_size(batch_size: int, input_context: tf.distribute.InputContext | None = None) -> int:
    """The batch one input pipeline yields: the global batch split per replica.

    Raises:
        DataError: ``batch_size`` is not a positive int, or does not divide by the replicas.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
        raise DataError(f"batch_size must be a positive int: received batch_size={batch_size!r}.")
    if input_context is None:
        return batch_size
    replicas = input_context.num_replicas_in_sync
    if batch_size % replicas:
        raise DataError(f"The global batch_size={batch_size} does not divide by the {replicas} replicas in sync: "
                        f"pass a multiple of {replicas}, e.g. {max(1, batch_size // replicas) * replicas}.")
    return batch_size // replicas


def _cache_path(prefix: str, pipeline_id: int, pipelines: int, paths: list[str], settings: list) -> str:
    """The file cache of one input pipeline: ``PREFIX-00000-of-00002-<hash>``, its directory created.

    The hash covers each file's path, size and modification time and the ``settings`` that
    choose this pipeline's records. A lock file left by a process that died while caching
    to this path is removed (TensorFlow would refuse the path until it is deleted).
    """
    stats = [(path, tf.io.gfile.stat(path).length, tf.io.gfile.stat(path).mtime_nsec) for path in paths]
    digest = hashlib.sha256(json.dumps([stats, settings]).encode()).hexdigest()[:16]
    path = f"{prefix}-{pipeline_id:05d}-of-{pipelines:05d}-{digest}"
    directory = os.path.dirname(path)
    if directory:
        tf.io.gfile.makedirs(directory)
    if path not in _CACHES_IN_USE:
        for stale in tf.io.gfile.glob(f"{path}_*.lockfile") + tf.io.gfile.glob(f"{path}_*.tempstate*"):
            tf.io.gfile.remove(stale)
        _CACHES_IN_USE.add(path)
    return path


def _check_arguments(shuffle_buffer: int, image_size, repeat, seed, cache) -> None:
    if not isinstance(shuffle_buffer, int) or shuffle_buffer < 1:
        raise DataError(f"shuffle_buffer must be a positive int: received shuffle_buffer={shuffle_buffer!r}.")
    if image_size is not None and not (len(image_size) == 2 and all(isinstance(n, int) and n > 0 for n in image_size)):
        raise DataError(f"image_size must be (height, width) in positive ints or None: received {image_size!r}.")
    if repeat is not True and repeat is not False and not (isinstance(repeat, int) and repeat > 0):
        raise DataError(f"repeat must be True, False or a positive number of epochs: received repeat={repeat!r}.")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise DataError(f"seed must be an int (the same on every worker) or None: received seed={seed!r}.")
    if not isinstance(cache, (bool, str)) or cache == "":
        raise DataError(f"cache must be False, True (memory) or a file path prefix: received cache={cache!r}.")


def _patterns(file_pattern) -> list[str]:
    """The patterns (or file names) that ``file_pattern`` gives: a str, a sequence of them, or a
    ``tf.data.Dataset`` of file names (``tf.data.Dataset.list_files``); empty for an empty sequence or dataset.

    Raises:
        DataError: anything else, or a dataset that is endless or holds other than scalar strings.
    """
    if isinstance(file_pattern, (str, os.PathLike)):
        return [os.fspath(file_pattern)]
    if isinstance(file_pattern, tf.data.Dataset):
        spec = file_pattern.element_spec
        if not (isinstance(spec, tf.TensorSpec) and spec.dtype == tf.string and spec.shape.rank == 0):
            if file_pattern.cardinality() == 0:  # from_tensor_slices([]) yields float32: a list that found nothing
                return []
            raise DataError(f"file_pattern as a tf.data.Dataset must yield file names (scalar strings, as "
                            f"tf.data.Dataset.list_files does): received one of {spec}.")
        if file_pattern.cardinality() == tf.data.INFINITE_CARDINALITY:
            raise DataError("file_pattern is an endless tf.data.Dataset of file names (a repeat?): pass the files "
                            "once; repeat=True repeats the records.")
        return [name.decode() for name in file_pattern.as_numpy_iterator()]
    patterns = list(file_pattern) if isinstance(file_pattern, (list, tuple)) else None
    if patterns is None or not all(isinstance(pattern, (str, os.PathLike)) for pattern in patterns):
        raise DataError(f"file_pattern must be a glob pattern, a non-empty list of patterns or file names, or a "
                        f"tf.data.Dataset of file names: received file_pattern={file_pattern!r}.")
    return [os.fspath(pattern) for pattern in patterns]


def _list_files(patterns: list[str]) -> tuple[list[str], list[str]]:
    """The files ``patterns`` match, each once however it is spelled, and the patterns that match none (a name
    without glob characters must exist). Names starting with "." that a glob matches are left out; a file
    named exactly is read."""
    paths, unmatched = {}, []
    for pattern in patterns:
        local = "://" not in pattern
        pattern = os.path.normpath(pattern) if local else pattern  # tf.io.gfile.glob never matches "d//x-*"
        is_glob = any(c in pattern for c in "*?[")
        found = tf.io.gfile.glob(pattern) if is_glob else []
        found = found or ([pattern] if tf.io.gfile.exists(pattern) else [])  # "a[1].tfrecord" is a name too
        found = [path for path in found if not (is_glob and os.path.basename(path).startswith("."))
                 and not tf.io.gfile.isdir(path)]
        unmatched += [pattern] if not found else []
        for path in found:  # one file named twice ("d/x-0" and "./d/x-*") is read once
            path = os.path.normpath(path) if local else path
            key = os.path.abspath(path) if local else path
            paths[key] = min(paths.get(key, path), path)
    return sorted(paths.values()), unmatched


def _refuse_unmatched(patterns: list[str], unmatched: list[str], source: str) -> None:
    """Raises for an empty ``file_pattern`` or patterns that match no file."""
    if not patterns:
        raise DataError(f"file_pattern must be a glob pattern, a non-empty list of patterns or file names, or a "
                        f"tf.data.Dataset of file names: received file_pattern={source}.")
    if len(unmatched) == len(patterns):
        named = "" if len(patterns) == 1 else f" (no name or pattern of it: {unmatched})"
        raise FileNotFoundError(f"file_pattern={source} matches no file{named}. Check the directory; shards from "
                                "write_tfrecords are named like 'DIR/data-00000-of-00016.tfrecord' "
                                "(pattern 'DIR/data-*.tfrecord').")
    if unmatched:
        one = len(unmatched) == 1
        globs = any(c in pattern for pattern in unmatched for c in "*?[")
        what = ("matches no file" if one else "match no file") if globs else ("does not exist" if one else "do not exist")
        raise FileNotFoundError(f"file_pattern={source} names {', '.join(map(repr, unmatched))}, which {what}.")


def _refuse_shards_being_written(paths: list[str]) -> None:
    """write_tfrecords moves shards into place from a ``.tmp-PREFIX-*`` directory, removed when it is done."""
    for directory in sorted({os.path.dirname(path) for path in paths}):
        names = [os.path.basename(path) for path in paths if os.path.dirname(path) == directory]
        for temp in tf.io.gfile.glob(os.path.join(directory, ".tmp-*")):
            prefix = os.path.basename(temp.rstrip("/"))[len(".tmp-"):].rsplit("-", 1)[0]
            if any(fnmatch.fnmatchcase(name, records.shard_glob(prefix)) for name in names):
                raise DataError(f"The shards {records.shown_shard_names(prefix)} in {directory} are being written or "
                                f"replaced by write_tfrecords now ({temp} is there): read them after it returns. In a "
                                "multi-worker job call write_tfrecords on every worker: the others wait for the chief's "
                                f"write. If no write is running (one was killed), delete {temp}.")


def _readable_files(paths: list[str], skip_corrupt: bool) -> list[records.FileCheck]:
    """The checks of the files holding records (how many complete records each holds)."""
    checks = [records.check_file(path) for path in paths]
    damaged = [check for check in checks if check.problem]
    if damaged and not skip_corrupt:
        bad = damaged[0]
        more = f" ({len(damaged) - 1} more file(s) are damaged too)" if len(damaged) > 1 else ""
        raise DataError(f"Cannot read {bad.path}: {bad.problem}{more}. Replace the file, or pass "
                        "skip_corrupt=True to skip damaged data (a damaged file's records before the damage are kept).")
    if damaged:
        kept = sum(check.num_records for check in damaged)
        warnings.warn(f"skip_corrupt=True: skipped damaged data in {len(damaged)} of {len(paths)} file(s), "
                      f"keeping {kept} record(s) from before the damage: "
                      + "; ".join(f"{check.path} ({check.problem})" for check in damaged), stacklevel=3)
    kept = [check for check in checks if check.num_records]
    if paths and not kept:
        raise DataError(f"No file of {paths} holds a readable record.")
    return kept


def _listed_alike_on_every_worker(file_pattern, skip_corrupt: bool,
                                  pipelines: int) -> tuple[list[str], list[int], str]:
    """The files ``file_pattern`` gives that hold records, their record counts, and ``file_pattern`` as messages
    show it. Sharded over the workers of a multi-worker job, only once every worker listed the same files with
    the same record counts (``agreement.check_same_files``): a worker whose list differs (shorter, empty, a
    pattern that matches nothing there) is named, with the files, on every worker."""
    job = cluster_lib.cluster_from_env() if pipelines > 1 else None
    shared = job is not None and job.is_multi_worker
    source = repr(file_pattern)
    try:
        patterns = _patterns(file_pattern)
        source = agreement.shown(file_pattern if isinstance(file_pattern, (str, list, tuple)) else sorted(patterns))
        paths, unmatched = _list_files(patterns)
        _refuse_shards_being_written(paths)
        if not shared:
            _refuse_unmatched(patterns, unmatched, source)
        checks = _readable_files(paths, skip_corrupt)
    except Exception as error:  # a bad argument, a damaged file, the filesystem's own error: the peers stop too
        if shared:
            agreement.check_same_files(source, error, job.worker_index, job.num_workers)
        raise
    if shared:  # what one worker does not see is named on every worker before its own error is raised
        names = agreement.relative_names(patterns, [check.path for check in checks])
        agreement.check_same_files(source, sorted(zip(names, (c.num_records for c in checks),
                                                      (c.first_crc for c in checks))),
                                   job.worker_index, job.num_workers, unmatched=unmatched)
        _refuse_unmatched(patterns, unmatched, source)
    return [check.path for check in checks], [check.num_records for check in checks], source


def _warn_if_record_level(num_files: int, pipelines: int) -> None:
    if num_files >= pipelines:
        return
    warnings.warn(f"{num_files} file(s) for {pipelines} input pipelines: each pipeline reads its run of records "
                  "of one or two files, skipping the records before it, with little parallel reading. Write at "
                  f"least {pipelines} files (write_tfrecords(num_shards={pipelines}) or more).",
                  ShardingWarning, stacklevel=3)


def batch_parser(path: str, *, features: Mapping[str, object] | Sequence[str] | None = None,
                 image_size: tuple[int, int] | None = None, augment: bool = False, seed: int | None = None,
                 parse_fn: Callable | None = None) -> Callable[[tf.Tensor], object]:
    """The function ``tfrecord_dataset`` maps over batches of serialized records, for custom pipelines.

    Args:
        path: a TFRecord file whose first record shows the features (and image sizes).
        features, image_size, augment, seed, parse_fn: as for ``tfrecord_dataset``.

    Returns:
        A function from a 1-D string tensor of serialized records to the parsed, decoded
        batch (or what ``parse_fn`` makes of it).

    Raises:
        DataError: a requested feature is not in the records.
    """
    specs, images = records.select_features(features, records.first_record(path), path)

    def decode(serialized):
        batch = tf.io.parse_example(serialized, specs)
        for key, info in images.items():
            batch[key] = _decode_images(batch[key], key, info, image_size)
            if augment:
                batch[key] = tf.image.random_flip_left_right(batch[key], seed=seed)
        return parse_fn(batch) if parse_fn else batch
    return decode


def _decode_images(encoded: tf.Tensor, key: str, info: records.ImageInfo, image_size) -> tf.Tensor:
    height, width = image_size or (info.height, info.width)
    # Names the decode op so that TensorFlow's own shape error says the fix, at no cost per image:
    # "Shape of tensor .../image_sizes_differ__pass_image_size/DecodeImage [6,6,3] is not compatible
    # with expected shape [4,6,3]".
    op_name = re.sub(r"[^A-Za-z0-9_.]", "_", key) + "_sizes_differ__pass_image_size"

    def decode_one(data):
        image = tf.io.decode_image(data, channels=info.channels, expand_animations=False, name=op_name)
        if image_size:
            image = tf.saturate_cast(tf.round(tf.image.resize(image, image_size)), tf.uint8)
        return tf.ensure_shape(image, [height, width, info.channels])

    return tf.map_fn(decode_one, encoded, fn_output_signature=tf.TensorSpec([height, width, info.channels], tf.uint8))
