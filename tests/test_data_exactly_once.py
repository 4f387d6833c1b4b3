"""Exactly once, whatever the script does: every record once per epoch, on exactly one worker (issue 29).

Each worker's pipeline is built here with its own InputContext and, where the case says, its own global seed
(as ``tf.random.set_seed(100 + rank)`` in a real worker): cheap, and it failed as the real 2-worker jobs did
before the fix. The cases are generated so that every pair of values of any two dimensions meets in one case.
They read with ``deterministic=True``, so that each worker's records can be cut into its epochs in the order they come.
"""

import collections
import itertools
import os
import warnings

import numpy as np
import pytest
import tensorflow as tf

from tfdist import data
from tfdist.data import epochs as epochs_lib
from tfdist.data import reader

NUM_RECORDS = 101  # prime: no file or worker count divides it
PER_REPLICA_BATCH = 4
DIMENSIONS = {
    "files": (1, 3, 16),  # 1 file: more workers than files
    "workers": (2, 3),
    "seeds": ("none", "shared", "per_worker", "per_worker_and_pipeline_seed"),
    "cache": ("off", "memory", "file"),
    "shuffle": (True, False),
    "repeat": ("3_epochs", "steps_per_epoch"),
    "restart": (False, True),  # read again with new pipelines and process state, as a restarted job does
}


def pairwise(dimensions):
    """Few cases that together hold every pair of values of any two dimensions (greedy all-pairs)."""
    names = list(dimensions)
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
                 for x in dimensions[a] for y in dimensions[b]}
    candidates = [dict(zip(names, values)) for values in itertools.product(*dimensions.values())]
    cases = []
    while uncovered:
        def covers(case):
            return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(names, 2)} & uncovered
        best = max(candidates, key=lambda case: len(covers(case)))
        uncovered -= covers(best)
        cases.append(best)
    return cases


CASES = pairwise(DIMENSIONS)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The same 101 records (label = index) in 1, 3 and 16 files; record i is in file i % files."""
    root = tmp_path_factory.mktemp("exactly_once")
    source = {"label": np.arange(NUM_RECORDS)}
    return {n: data.write_tfrecords(source, str(root / str(n)), num_shards=n).pattern for n in DIMENSIONS["files"]}


@pytest.fixture(autouse=True)
def no_global_seed():
    yield
    tf.random.set_seed(None)


def read_worker(pattern, worker, workers, case, cache_prefix, run):
    """The record indices one worker's pipeline yields, its process state set as the case says."""
    if case["seeds"] == "none":
        tf.random.set_seed(None)
    elif case["seeds"] == "shared":
        tf.random.set_seed(5)
    else:  # each worker (and each restart) with a global seed of its own
        tf.random.set_seed(100 + worker + 10 * run)
    seed = 7 if case["seeds"] in ("shared", "per_worker_and_pipeline_seed") else None
    cache = {"off": False, "memory": True, "file": cache_prefix}[case["cache"]]
    context = tf.distribute.InputContext(num_input_pipelines=workers, input_pipeline_id=worker,
                                         num_replicas_in_sync=workers)
    epochs = case["repeat"] == "3_epochs"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", data.ShardingWarning)
        dataset = data.tfrecord_dataset(pattern, batch_size=PER_REPLICA_BATCH * workers, input_context=context,
                                        features=["index"], shuffle=case["shuffle"], seed=seed, cache=cache,
                                        repeat=3 if epochs else True, drop_remainder=not epochs,
                                        deterministic=True)  # else a batch may overtake the last of an epoch
    if not epochs:  # model.fit(dataset, epochs=3, steps_per_epoch=...): 3 * steps batches from one iterator
        dataset = dataset.take(3 * (NUM_RECORDS // (PER_REPLICA_BATCH * workers)))
    return dataset.map(lambda batch: batch["index"]).unbatch().batch(10**6).get_single_element().numpy().tolist()


def split_epochs(stream, files, workers, worker):
    """A worker's records cut into its epochs: each epoch is its share, ``NUM_RECORDS // workers`` records or one
    more (``tfdist.data.epochs.bounds``), whatever the ``files``. Returns the complete epochs."""
    first, stop = epochs_lib.bounds(NUM_RECORDS, worker, workers)
    share = stop - first
    return [stream[start:start + share] for start in range(0, len(stream) - share + 1, share)]


@pytest.mark.parametrize("case", CASES, ids=["-".join(f"{k}={v}" for k, v in case.items()) for case in CASES])
def test_each_record_once_per_epoch_on_exactly_one_worker(shards, tmp_path, case):
    workers, files = case["workers"], case["files"]
    for run in (0, 1) if case["restart"] else (0,):  # run 1: new pipelines, new global seeds, the file cache kept
        per_worker = [split_epochs(read_worker(shards[files], w, workers, case, str(tmp_path / "cache"), run),
                                   files, workers, w) for w in range(workers)]
        complete = min(len(epochs) for epochs in per_worker)
        assert complete == 3 or (case["repeat"] == "steps_per_epoch" and complete >= 2), [len(e) for e in per_worker]
        for epoch in range(complete):
            seen = [i for epochs in per_worker for i in epochs[epoch]]
            assert sorted(seen) == list(range(NUM_RECORDS)), (run, epoch, collections.Counter(seen).most_common(3))
    if case["cache"] == "file":  # one cache per worker, none shared
        caches = sorted(name for name in os.listdir(tmp_path) if name.endswith(".index"))
        assert [name[:len("cache-00000-of-00002")] for name in caches] == [
            f"cache-{w:05d}-of-{workers:05d}" for w in range(workers)]


def test_the_cases_hold_every_pair_of_values():
    assert len(CASES) < 30
    for a, b in itertools.combinations(DIMENSIONS, 2):
        assert {(case[a], case[b]) for case in CASES} == set(itertools.product(DIMENSIONS[a], DIMENSIONS[b]))


def cached_labels(pattern, cache, workers):
    """Every label the workers read in one epoch, each worker caching to ``cache``."""
    labels = []
    for worker in range(workers):
        context = tf.distribute.InputContext(workers, worker, workers)
        dataset = data.tfrecord_dataset(pattern, batch_size=4 * workers, input_context=context, cache=cache)
        labels += [int(i) for batch in dataset for i in batch["label"].numpy()]
    return sorted(labels)


def test_a_cache_of_another_worker_count_or_other_files_is_never_read(tmp_path):
    shards = str(tmp_path / "shards")
    cache = str(tmp_path / "caches" / "train")  # the directory is created
    data.write_tfrecords({"label": np.arange(30)}, shards, num_shards=6)
    pattern = os.path.join(shards, "data-*.tfrecord")
    assert cached_labels(pattern, cache, 2) == list(range(30))
    assert cached_labels(pattern, cache, 3) == list(range(30))  # 3 workers: 3 new caches, not the 2 workers' ones
    data.write_tfrecords({"label": np.arange(100, 130)}, shards, num_shards=6, overwrite=True)  # same names
    assert cached_labels(pattern, cache, 2) == list(range(100, 130))
    assert len([name for name in os.listdir(tmp_path / "caches") if name.endswith(".index")]) == 2 + 3 + 2


def test_a_lock_left_by_a_dead_worker_does_not_block_the_restart(tmp_path, monkeypatch):
    data.write_tfrecords({"label": np.arange(10)}, str(tmp_path), num_shards=2)
    pattern, cache = str(tmp_path / "data-*.tfrecord"), str(tmp_path / "cache")
    assert cached_labels(pattern, cache, 1) == list(range(10))
    (index,) = tmp_path.glob("cache-*.index")
    for path in tmp_path.glob("cache-*"):  # as a worker killed while writing its cache leaves it
        path.unlink()
    index.with_name(index.name.removesuffix(".index") + "_0.lockfile").write_text("Created at: 0")
    monkeypatch.setattr(reader, "_CACHES_IN_USE", set())  # a new process
    assert cached_labels(pattern, cache, 1) == list(range(10))
