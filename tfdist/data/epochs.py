"""The records each input pipeline of a ``tfrecord_dataset`` reads, epoch by epoch, and where it starts.

An epoch: the files in the epoch's order (a stateless permutation of ``(seed, epoch)``), their records one
after another in that order, cut into N contiguous parts whose sizes differ by one record at most (``bounds``):
pipeline p of N reads part p, whole files where the part holds them and a run of records of the one or two files
it shares with its neighbours (``parts``; it skips the records before its run), interleaved, and shuffles the
records through a buffer seeded by ``(seed, epoch, p, N)`` alone. So every worker's share of an epoch is
equal (to one record) whatever the number of files and records per file: with an epoch of ``steps_per_epoch``
global batches, no worker starts its next epoch while another still reads this one. With ``seed`` given (and
reading kept in order), a pipeline's order is a pure function of those, whatever the process's own random state:
another process, with another worker count, can tell which records a pipeline had read after k of them, by
running the same pipeline on record numbers (``consumed``).

Where a fit starts (``tfdist.fit_start``): a fit resumed at epoch E of a backup reads data epoch E
(each epoch of the fit is one pass over the records: ``steps_per_epoch`` times the global batch). Resumed
mid-epoch, it first reads the rest of that epoch: the records no earlier run of the epoch read, in the
epoch's file order, cut into N contiguous parts the same way, part p for pipeline p, shuffled; before them
come ``done steps x records per step`` copies of one record, which the fit consumes without training (it
skips its done steps' batches). So every record of the epoch is trained on once, whichever worker counts
trained it. Then epochs E + 1, ... as usual.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import tensorflow as tf

from tfdist import fit_start

_MAX_OPEN_FILES = 16
_GRAPH_SEED = 20261128  # the seeded shuffles' graph-level seed, set in their own function graph only
_EPOCH, _REST = 0, 1  # kinds of shuffle, so that an epoch's rest is ordered apart from a whole epoch
_REPLAY_BATCH = 1 << 16
SPLIT = "parts"  # how an epoch is cut among pipelines (``bounds``), as backups record it: older ones cut whole files


@dataclasses.dataclass(frozen=True)
class Files:
    """A dataset's files and the settings that order their records."""

    paths: tuple[str, ...]
    counts: tuple[int, ...]
    seed: int                # the file order's (and, when ``seeded``, the record shuffle's) seed
    seeded: bool             # the user gave ``seed``: the record shuffle is a function of it
    shuffle: bool
    buffer: int
    ordered: bool            # interleave keeps files' records in order
    skip_corrupt: bool

    @property
    def offsets(self) -> np.ndarray:
        """The number of file f's first record, counting all files' records in ``paths`` order."""
        return np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)

    @property
    def total(self) -> int:
        return int(sum(self.counts))

    @property
    def replayable(self) -> bool:
        """Whether another process can tell which records a pipeline read (see the module's docstring)."""
        return not self.shuffle or (self.seeded and self.ordered)


def file_order(files: Files, epoch: tf.Tensor) -> tf.Tensor:
    """The files' order in ``epoch``: a permutation from stateless random numbers, so a pure function of
    ``(seed, epoch)``. tf.data's ``shuffle(seed=...)`` mixes its seed with the process's global seed."""
    if not files.shuffle:
        return tf.range(len(files.paths), dtype=tf.int64)
    keys = tf.random.stateless_uniform([len(files.paths)], seed=tf.stack([tf.constant(files.seed, tf.int64), epoch]))
    return tf.cast(tf.argsort(keys, stable=True), tf.int64)


def bounds(total: int, pipeline: int, pipelines: int) -> tuple[int, int]:
    """Pipeline ``pipeline``'s run ``[first, stop)`` of ``total`` records cut into ``pipelines`` contiguous parts,
    the first ``total % pipelines`` of them one record longer."""
    size, extra = divmod(total, pipelines)
    first = pipeline * size + min(pipeline, extra)
    return first, first + size + (pipeline < extra)


def parts(files: Files, epoch: tf.Tensor, pipeline: int, pipelines: int) -> tf.data.Dataset:
    """Pipeline ``pipeline``'s part of ``epoch``: ``(file, first, stop)`` for each file it reads (records
    ``[first, stop)`` of it), in the epoch's file order."""
    order = file_order(files, epoch)
    counts = tf.gather(tf.constant(files.counts, tf.int64), order)
    starts = tf.cumsum(counts, exclusive=True)  # each file's first record in the epoch's order
    first, stop = bounds(files.total, pipeline, pipelines)
    begin = tf.clip_by_value(first - starts, 0, counts)
    end = tf.clip_by_value(stop - starts, 0, counts)
    held = end > begin
    return tf.data.Dataset.from_tensor_slices(
        (tf.boolean_mask(order, held), tf.boolean_mask(begin, held), tf.boolean_mask(end, held)))


def records(files: Files, keep: tf.Tensor | None = None):
    """A function of ``(file, first, stop)`` to records ``[first, stop)`` of the file; with ``keep`` (a mask over
    all records' numbers), only those it marks."""
    paths, offsets = tf.constant(files.paths), tf.constant(files.offsets)

    def read(index, first, stop):
        found = tf.data.TFRecordDataset(tf.gather(paths, index)).skip(first).take(stop - first)
        if files.skip_corrupt:  # a damaged payload passes the header check: skip it as it is read, and log it
            found = found.ignore_errors(log_warning=True)
        if keep is not None:
            number = tf.gather(offsets, index) + first
            found = tf.data.Dataset.zip(tf.data.Dataset.range(number, number + stop - first), found).filter(
                lambda number, record: tf.gather(keep, number)).map(lambda number, record: record)
        return found
    return read


def numbers(files: Files, keep: tf.Tensor | None = None):
    """A function of ``(file, first, stop)`` to its records' numbers: what ``records`` reads, without reading."""
    offsets = tf.constant(files.offsets)

    def read(index, first, stop):
        number = tf.gather(offsets, index)
        found = tf.range(number + first, number + stop)
        if keep is not None:
            found = tf.boolean_mask(found, tf.gather(keep, found))  # a file at a time, not record by record
        return tf.data.Dataset.from_tensor_slices(found)
    return read


def interleaved(runs: tf.data.Dataset, files: Files, read, ordered: bool) -> tf.data.Dataset:
    """The records of ``runs`` (``(file, first, stop)`` each) through ``read``, files read in parallel."""
    return runs.interleave(read, cycle_length=min(len(files.paths), _MAX_OPEN_FILES),
                           num_parallel_calls=tf.data.AUTOTUNE, deterministic=ordered)


def unshuffled(files: Files, epoch: tf.Tensor, pipeline: int, pipelines: int, read) -> tf.data.Dataset:
    """Pipeline ``pipeline``'s elements of a whole ``epoch`` (``parts``), before the record shuffle; ``read``:
    ``records`` or ``numbers``."""
    return interleaved(parts(files, epoch, pipeline, pipelines), files, read, files.ordered)


def epoch_stream(files: Files, epoch: tf.Tensor, pipeline: int, pipelines: int, read) -> tf.data.Dataset:
    """``unshuffled``, shuffled. Build it inside a dataset function (``flat_map``): a seeded shuffle sets that
    function graph's seed."""
    return shuffled(unshuffled(files, epoch, pipeline, pipelines, read), files, epoch, pipeline, pipelines, _EPOCH)


def rest_stream(files: Files, epoch: tf.Tensor, pipeline: int, pipelines: int, touched: tf.Tensor,
                read) -> tf.data.Dataset:
    """Pipeline ``pipeline``'s part of the rest of ``epoch`` (``rest_part``: the ``touched`` files' records that
    its mask marks), shuffled; ``read``: ``records`` or ``numbers`` with ``keep=mask``."""
    counts = tf.gather(tf.constant(files.counts, tf.int64), touched)
    runs = tf.data.Dataset.from_tensor_slices((touched, tf.zeros_like(counts), counts))
    return shuffled(interleaved(runs, files, read, True), files, epoch, pipeline, pipelines, _REST)


def shuffled(stream: tf.data.Dataset, files: Files, epoch: tf.Tensor, pipeline: int, pipelines: int,
             kind: int) -> tf.data.Dataset:
    """The records shuffled through the buffer; seeded: by ``(seed, epoch, pipeline, pipelines, kind)`` alone."""
    if not files.shuffle:
        return stream
    if not files.seeded:
        return stream.shuffle(files.buffer)  # the process's own random state, a new order each epoch
    tf.random.set_seed(_GRAPH_SEED)  # in a function graph: that graph's seed, not the process's
    key = tf.constant([files.seed, 0], tf.int64)
    for value in (epoch, pipeline, pipelines, kind):
        key = tf.random.experimental.stateless_fold_in(key, tf.cast(value, tf.int64))
    op_seed = tf.random.stateless_uniform([], seed=key, minval=1, maxval=2 ** 31 - 1, dtype=tf.int64)
    return stream.shuffle(files.buffer, seed=op_seed, reshuffle_each_iteration=False)


def rest_part(files: Files, epoch: int, pipeline: int, pipelines: int, consumed: np.ndarray):
    """Pipeline ``pipeline``'s part of the records of ``epoch`` not ``consumed``: ``(touched, keep)``, the
    indices of the files it reads in the epoch's order and a mask over all records' numbers."""
    order = file_order(files, tf.constant(epoch, tf.int64)).numpy()
    numbers_of = [np.arange(first, first + count) for first, count in zip(files.offsets, files.counts)]
    left = np.concatenate([numbers_of[f][~consumed[numbers_of[f]]] for f in order])
    first, stop = bounds(len(left), pipeline, pipelines)
    keep = np.zeros(files.total, bool)
    keep[left[first:stop]] = True
    touched = np.array([f for f in order if keep[numbers_of[f]].any()], np.int64)
    return touched, keep


def consumed(files: Files, epoch: int, layouts) -> np.ndarray:
    """A mask over all records' numbers: those the runs ``layouts`` (``(pipelines, steps done, global batch, ...)``
    each, the first from the epoch's start, each later one from its predecessor's rest) read of ``epoch``."""
    mask, done = np.zeros(files.total, bool), 0
    for run, (pipelines, steps, global_batch, *_) in enumerate(layouts):
        read = mask.copy()
        per_step = global_batch // pipelines
        for pipeline in range(pipelines):
            if run == 0:
                def stream(e, pipeline=pipeline, pipelines=pipelines):
                    return epoch_stream(files, e, pipeline, pipelines, numbers(files))
            else:
                touched, keep = rest_part(files, epoch, pipeline, pipelines, mask)

                def stream(e, pipeline=pipeline, pipelines=pipelines, touched=touched, keep=keep):
                    return rest_stream(files, e, pipeline, pipelines, tf.constant(touched),
                                       numbers(files, keep=tf.constant(keep)))
            taken = tf.data.Dataset.from_tensors(tf.constant(epoch, tf.int64)).flat_map(stream)
            taken = taken.take((steps - done) * per_step).batch(_REPLAY_BATCH)  # numbers to NumPy in bulk
            taken = np.concatenate([np.zeros([0], np.int64)] + list(taken.as_numpy_iterator()))
            read[taken] = True
        mask, done = read, steps
    return mask


@dataclasses.dataclass
class Plan:
    """Where one pipeline's iterator starts: data epoch ``epoch``; when ``filler``, ``touched`` or ``keep``
    say so, first ``filler`` copies of a record and then its part of the rest of that epoch."""

    epoch: int = 0
    filler: int = 0
    touched: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros([0], np.int64))
    keep: np.ndarray | None = None


class Starts:
    """The start of a repeating dataset's pipeline: the open window's (``tfdist.fit_start``) when its
    iterator starts within one, else the data's first epoch."""

    def __init__(self, files: Files, pipeline: int, pipelines: int, global_batch: int):
        self.files, self.pipeline, self.pipelines, self.global_batch = files, pipeline, pipelines, global_batch

    def take(self):
        """The plan of this iterator, as the tensors the dataset's ``py_function`` returns (it runs as the
        iterator reads its first element)."""
        start = fit_start.take(self.pipelines, self.global_batch, SPLIT)
        plan = Plan() if start is None else self._plan(start)
        keep = plan.keep if plan.keep is not None else np.zeros([0], bool)
        return np.int64(plan.epoch), np.int64(plan.filler), plan.touched, keep

    def _plan(self, start: fit_start.Start) -> Plan:
        resume = start.resume
        if resume is None or not (resume.epoch or resume.steps):
            return Plan()
        if start.steps_per_epoch is None or start.steps_per_epoch * self.global_batch != self.files.total:
            self._warn(resume, f"the fit's epoch ({start.steps_per_epoch} steps of a global batch of "
                               f"{self.global_batch}) is not one pass over the {self.files.total} records; it starts "
                               "from the data's first epoch")
            return Plan()
        if not resume.steps:
            return Plan(epoch=resume.epoch)
        if not self.files.replayable:
            self._warn(resume, "which records the interrupted run read is known only with tfrecord_dataset(seed=...) "
                               "(and deterministic left None or True); it skips as many records as were read")
        known = resume.layouts or ((self.pipelines, resume.steps, self.global_batch, SPLIT),)
        layouts = tuple((run[0], run[1], run[2] if len(run) > 2 else self.global_batch,
                         run[3] if len(run) > 3 else None) for run in known)
        if any(run[3] != SPLIT for run in layouts):
            self._warn(resume, "its earlier runs split the epoch's records another way (a backup of an older tfdist)")
        if any(run[2] != self.global_batch for run in layouts):
            self._warn(resume, f"its steps were of a global batch of {layouts[-1][2]}, this fit's are of "
                               f"{self.global_batch}; it reads the records not read yet, but its epoch ends by "
                               "steps, not by records")
        if layouts == ((self.pipelines, resume.steps, self.global_batch, SPLIT),):
            return Plan(epoch=resume.epoch)  # the fit skips its done steps' batches of this very epoch
        read = consumed(self.files, resume.epoch, layouts)
        touched, keep = rest_part(self.files, resume.epoch, self.pipeline, self.pipelines, read)
        return Plan(epoch=resume.epoch, filler=resume.steps * (self.global_batch // self.pipelines),
                    touched=touched, keep=keep)

    def _warn(self, resume: fit_start.Resume, why: str) -> None:
        if resume.steps and self.pipeline == 0:
            warnings.warn(f"A fit resumed at step {resume.steps} of epoch {resume.epoch + 1} may read some records "
                          f"of that epoch twice and others not at all: {why}.", stacklevel=2)

    def dataset(self, epochs: int | None) -> tf.data.Dataset:
        """The pipeline's records from where its iterator's plan says, through ``epochs`` (None: forever)."""
        files, pipeline, pipelines = self.files, self.pipeline, self.pipelines
        end = np.iinfo(np.int64).max if epochs is None else epochs

        def from_plan(_):
            epoch, filler, touched, keep = tf.py_function(
                self.take, [], [tf.int64, tf.int64, tf.int64, tf.bool], name="tfdist_data_start")
            epoch, filler = tf.ensure_shape(epoch, []), tf.ensure_shape(filler, [])
            touched, keep = tf.ensure_shape(touched, [None]), tf.ensure_shape(keep, [None])
            resumed = tf.size(keep) > 0  # then the rest of ``epoch`` (no file is touched otherwise)
            skipped = tf.data.TFRecordDataset(files.paths[0]).take(1).repeat(filler)
            rest = tf.data.Dataset.from_tensors(epoch).flat_map(
                lambda e: rest_stream(files, e, pipeline, pipelines, touched, records(files, keep=keep)))
            whole = tf.data.Dataset.range(epoch + tf.cast(resumed, tf.int64), end).flat_map(
                lambda e: epoch_stream(files, e, pipeline, pipelines, records(files)))
            return skipped.concatenate(rest).concatenate(whole)
        options = tf.data.Options()  # tf.distribute's auto-shard would read this one source as a list of 1 file
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        return tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).flat_map(from_plan).with_options(options)
