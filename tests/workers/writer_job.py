"""Reruns of one ``write_tfrecords`` call on every worker, and a source whose order differs per worker (issue 40).

Every worker runs the same call twice (the rerun returns the complete set), then the same call with other
examples and ``overwrite=False`` (every worker raises the same FileExistsError, caught here to record each
worker's message and time), writes its results, and last writes an unseeded shuffle: that stops worker 1 with
an error naming the order, while the chief, having written, waits at a barrier as a script's first training
step would. ``write_tfrecords`` runs before ``tfdist.scope()``, as in scripts that prepare their data first.

argv: out_dir, a work directory.
"""

import os
import sys
import time

import numpy as np
import tensorflow as tf

import tfdist
from tests.workers import common
from tfdist import collectives, data

out_dir, work_dir = sys.argv[1], sys.argv[2]


def write(labels):
    return data.write_tfrecords({"label": labels}, os.path.join(work_dir, "rerun"), num_shards=2)


first = write(np.arange(10))
times = [os.stat(path).st_mtime_ns for path in first.paths]
again = write(np.arange(10))
results = {"first": [list(first.paths), first.num_records], "again": [list(again.paths), again.num_records],
           "rewritten": [os.stat(path).st_mtime_ns for path in first.paths] != times}
started = time.monotonic()
try:
    write(np.arange(100, 110))
    results["other_examples"] = "returned"
except FileExistsError as error:
    results["other_examples"] = str(error)
results["other_examples_s"] = time.monotonic() - started
common.write_result(out_dir, results)

shuffled = tf.data.Dataset.range(64).shuffle(64).map(lambda i: {"label": i})  # unseeded: an order per process
data.write_tfrecords(shuffled, os.path.join(work_dir, "shuffled"), num_shards=2)
print(f"worker {tfdist.rank()} wrote the shuffled examples", flush=True)
collectives.barrier()
