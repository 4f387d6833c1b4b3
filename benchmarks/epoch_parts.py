"""What equal shares cost to read: an epoch cut into contiguous parts against whole files per worker (issue 49).

    python benchmarks/epoch_parts.py [--records 96000] [--bytes 2048] [--rounds 6] [--only WORD]

Writes ``--records`` records (an int and ``--bytes`` of payload each) in the layouts below, then, in alternating
rounds, reads one epoch of every input pipeline of each layout both ways (records counted in batches, not parsed,
so the read itself is all that is timed: the ratio's worst case):

  parts    ``tfdist.data.epochs.epoch_stream`` now: the epoch's records in its file order cut into N contiguous
           parts of equal size; a pipeline skips the records before its run in the files at its part's ends
  files    the path before (commit e417d86): pipeline p reads every N-th file of the epoch's order, whole, or, with
           fewer files than pipelines, every file keeping every N-th record (rebuilt here from its code)

Prints, per layout, the records epoch 1's parts skip, and per round the seconds of all pipelines one after another
(the reading the job does in all) and of the slowest pipeline (what an epoch waits for when the workers read in
parallel), and the ratios parts / files. Both ways shuffle through the same seeded buffer. Last, what skipping a
file's records costs against reading them (a TFRecordDataset alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tfdist.data import epochs  # noqa: E402

LAYOUTS = {  # name: (relative file sizes, pipelines)
    "5 files / 2 workers (the issue)": ([1] * 5, 2),
    "7 unequal files / 3 workers": ([5, 30, 8, 22, 17, 26, 12], 3),
    "64 files / 3 workers": ([1] * 64, 3),
    "2 files / 3 workers (fewer files)": ([1] * 2, 3),
}


def write(root: str, name: str, weights: list[int], records: int, payload: int) -> epochs.Files:
    sizes = np.floor(np.array(weights) / sum(weights) * records).astype(int)
    sizes[0] += records - sizes.sum()
    paths, first, rng = [], 0, np.random.default_rng(0)
    for index, size in enumerate(sizes):
        path = os.path.join(root, f"{name}-{index:05d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for label in range(first, first + size):
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
                    "data": tf.train.Feature(bytes_list=tf.train.BytesList(value=[rng.bytes(payload)]))})
                ).SerializeToString())
        paths.append(path)
        first += size
    return epochs.Files(tuple(paths), tuple(int(s) for s in sizes), 5, True, True, 4096, True, False)


def whole_files_stream(files: epochs.Files, epoch: tf.Tensor, pipeline: int, pipelines: int) -> tf.data.Dataset:
    """The path before issue 49 (tfdist/data/epochs.py at e417d86): every N-th file of the epoch's order, or
    every N-th record of every file when there are fewer files than pipelines."""
    paths, counts = tf.constant(files.paths), tf.constant(files.counts, tf.int64)
    record_level = len(files.paths) < pipelines

    def read(index):
        found = tf.data.TFRecordDataset(tf.gather(paths, index)).take(tf.gather(counts, index))
        return found.shard(pipelines, pipeline) if record_level else found
    order = tf.data.Dataset.from_tensor_slices(epochs.file_order(files, epoch))
    if not record_level:
        order = order.shard(pipelines, pipeline)
    stream = order.interleave(read, cycle_length=min(len(files.paths), 16), num_parallel_calls=tf.data.AUTOTUNE,
                              deterministic=True)
    return epochs.shuffled(stream, files, epoch, pipeline, pipelines, 0)


def parts_stream(files: epochs.Files, epoch: tf.Tensor, pipeline: int, pipelines: int) -> tf.data.Dataset:
    return epochs.epoch_stream(files, epoch, pipeline, pipelines, epochs.records(files))


@dataclasses.dataclass(frozen=True)
class Timing:
    total_s: float     # every pipeline's epoch, one after another
    slowest_s: float   # the slowest pipeline's epoch
    records: int


def time_epoch(make, files: epochs.Files, pipelines: int) -> Timing:
    seconds, records = [], 0
    for pipeline in range(pipelines):
        dataset = tf.data.Dataset.from_tensors(tf.constant(1, tf.int64)).flat_map(
            lambda e, pipeline=pipeline: make(files, e, pipeline, pipelines)).batch(1024)
        began = time.perf_counter()
        records += int(dataset.reduce(tf.constant(0, tf.int64), lambda n, batch: n + tf.size(batch, tf.int64)))
        seconds.append(time.perf_counter() - began)
    return Timing(sum(seconds), max(seconds), records)


def skipped(files: epochs.Files, pipelines: int) -> int:
    """The records the pipelines skip in epoch 1: those before each run that starts inside a file."""
    return sum(int(first) for pipeline in range(pipelines) for _, first, _ in
               epochs.parts(files, tf.constant(1, tf.int64), pipeline, pipelines).as_numpy_iterator())


def skip_against_read(files: epochs.Files) -> tuple[float, float]:
    """Seconds to skip the largest file's records but its last, and to read them all (no shuffle, batch, parse)."""
    path, count = max(zip(files.paths, files.counts), key=lambda pair: pair[1])
    seconds = []
    for dataset in (tf.data.TFRecordDataset(path).skip(count - 1), tf.data.TFRecordDataset(path)):
        began = time.perf_counter()
        dataset.batch(1024).reduce(tf.constant(0, tf.int64), lambda n, batch: n + tf.size(batch, tf.int64))
        seconds.append(time.perf_counter() - began)
    return seconds[0], seconds[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=96000)
    parser.add_argument("--bytes", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--only", default="", help="only the layouts whose name holds this word")
    args = parser.parse_args()
    ways = {"parts": parts_stream, "files": whole_files_stream}
    with tempfile.TemporaryDirectory() as root:
        layouts = {name: (write(root, f"l{i}", weights, args.records, args.bytes), pipelines)
                   for i, (name, (weights, pipelines)) in enumerate(LAYOUTS.items()) if args.only in name}
        print(f"{args.records} records of {args.bytes} bytes (and an int) per layout; {args.rounds} rounds, "
              f"alternating which way reads first; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
        for name, (files, pipelines) in layouts.items():
            ratios_total, ratios_slowest = [], []
            shown = list(files.counts) if len(files.counts) < 10 else f"{len(files.counts)} x {files.counts[1]}"
            print(f"\n{name}: files of {shown} records; epoch 1's parts skip {skipped(files, pipelines)} records")
            for number in range(args.rounds):
                order = ("parts", "files") if number % 2 == 0 else ("files", "parts")
                found = {way: time_epoch(ways[way], files, pipelines) for way in order}
                assert found["parts"].records == found["files"].records == files.total
                ratios_total.append(found["parts"].total_s / found["files"].total_s)
                ratios_slowest.append(found["parts"].slowest_s / found["files"].slowest_s)
                print(f"  round {number + 1} ({order[0]} first): parts {found['parts'].total_s:.3f} s in all, slowest "
                      f"{found['parts'].slowest_s:.3f} s; files {found['files'].total_s:.3f} s in all, slowest "
                      f"{found['files'].slowest_s:.3f} s; ratio in all {ratios_total[-1]:.2f}, slowest "
                      f"{ratios_slowest[-1]:.2f}")
            print(f"  median ratio parts / files: in all {np.median(ratios_total):.2f} (rounds "
                  f"{min(ratios_total):.2f}-{max(ratios_total):.2f}), slowest pipeline {np.median(ratios_slowest):.2f} "
                  f"(rounds {min(ratios_slowest):.2f}-{max(ratios_slowest):.2f}); "
                  f"load average {os.getloadavg()[0]:.2f}")
        files = max((files for files, _ in layouts.values()), key=lambda files: max(files.counts))
        pairs = [skip_against_read(files) for _ in range(args.rounds)]
        print(f"\nskipping {max(files.counts) - 1} records of one file against reading them (TFRecordDataset alone), "
              "seconds per round: " + ", ".join(f"{skip:.3f} / {read:.3f}" for skip, read in pairs)
              + f"; median ratio {np.median([skip / read for skip, read in pairs]):.2f}")


if __name__ == "__main__":
    main()
