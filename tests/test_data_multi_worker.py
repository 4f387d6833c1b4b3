"""A real 2-worker `tfdist run` job reads TFRecord shards through tfdist.data and trains.

It also runs issue 29's scripts for real: a global seed per worker, one cache path for every worker, and
write_tfrecords(overwrite=True) on every worker then reading (3 rounds, the chief's moves slowed down). A second
job (issue 40) reruns one write_tfrecords call on every worker and writes an unseeded shuffle. A third (issue 43)
reads from a directory per worker where one worker sees a shard fewer, as a lagging shared filesystem shows it.
"""

import os
import re
import shutil

import numpy as np
import pytest

from tests.jobs import run_job
from tests.test_data_exactly_once import NUM_RECORDS as NUM_RECORDS_16, split_epochs
from tests.workers import common
from tfdist import data

NUM_RECORDS, NUM_SHARDS, GLOBAL_BATCH = 128, 4, 16


def bright_or_dark(num_records):
    """Label 1: bright images, label 0: dark ones (learnable in a few SGD steps)."""
    rng = np.random.default_rng(0)
    labels = np.arange(num_records) % 2
    images = rng.integers(0, 100, (num_records, 8, 8, 3)) + 120 * labels[:, None, None, None]
    return images.astype(np.uint8), labels


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data_work")


@pytest.fixture(scope="module")
def job(tmp_path_factory, work_dir):
    shards = data.write_tfrecords(bright_or_dark(NUM_RECORDS), str(tmp_path_factory.mktemp("shards")),
                                  num_shards=NUM_SHARDS)
    shards_16 = data.write_tfrecords({"label": np.arange(NUM_RECORDS_16)}, str(tmp_path_factory.mktemp("shards16")),
                                     num_shards=16)  # the 101 records in 16 files
    steps = NUM_RECORDS // GLOBAL_BATCH
    return run_job("data_job.py", tmp_path_factory.mktemp("data_job"), shards.pattern, str(GLOBAL_BATCH),
                   str(steps), shards_16.pattern, str(work_dir), timeout=300).check()


def test_each_record_reaches_exactly_one_worker(job):
    first, second = job.results[0]["indices"], job.results[1]["indices"]
    assert len(first) == len(second) == NUM_RECORDS // 2  # whole files: 2 shards of 32 each
    assert sorted(first + second) == list(range(NUM_RECORDS))


@pytest.mark.parametrize("read", ["seeded", "cached", "from_cache"])
def test_a_global_seed_per_worker_and_one_cache_path_keep_every_epoch_exactly_once(job, work_dir, read):
    """keras.utils.set_random_seed(100 + rank) on each worker; cache=<one path> in the script; 3 epochs."""
    per_worker = [split_epochs(job.results[w][read], 16, 2, w) for w in (0, 1)]
    assert [len(epochs) for epochs in per_worker] == [3, 3]
    for epoch in range(3):
        assert sorted(per_worker[0][epoch] + per_worker[1][epoch]) == list(range(NUM_RECORDS_16))
    caches = sorted(name[:len("train-00000-of-00002")] for name in os.listdir(work_dir / "cache")
                    if name.endswith(".index"))
    assert caches == ["train-00000-of-00002", "train-00001-of-00002"]  # one cache per worker


def test_write_tfrecords_on_every_worker_then_reading_sees_each_new_set_whole(job):
    for r in range(3):
        first, second = job.results[0]["race"][r], job.results[1]["race"][r]
        assert sorted(first + second) == [1000 * r + i for i in range(40)], r


def test_write_tfrecords_on_the_chief_only_works_too(job):
    assert sorted(job.results[0]["chief_only"] + job.results[1]["chief_only"]) == list(range(8))


def test_an_uneven_last_batch_weighs_as_on_one_device(job):
    """docs/your-script.md: 49 examples at global batch 4 on 2 workers (the last batch splits 1/0) train as one
    device (Keras' 1/replicas weighting counted the last example half)."""
    one_device = common.train_equivalence_on_arrays_of(49)
    for rank in (0, 1):
        for a, b in zip(job.results[rank]["partial_batch"], one_device):
            np.testing.assert_allclose(a, b, atol=1e-6)


def test_training_on_shards_lowers_the_loss_with_identical_weights(job):
    first, second = job.results[0], job.results[1]
    assert first["losses"] == second["losses"]
    losses = first["losses"]
    assert losses[0] > losses[1] > losses[2], losses
    for a, b in zip(first["weights"], second["weights"]):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def writer_job(tmp_path_factory):
    """Fails by design: its last step stops worker 1 (tests/workers/writer_job.py)."""
    return run_job("writer_job.py", tmp_path_factory.mktemp("writer_job"), str(tmp_path_factory.mktemp("writer_work")),
                   timeout=90)


def test_a_rerun_of_the_same_call_returns_the_same_complete_set_on_every_worker(writer_job):
    first = writer_job.results[0]["first"]
    assert first[1] == 10 and len(first[0]) == 2
    for rank in (0, 1):
        assert writer_job.results[rank]["first"] == writer_job.results[rank]["again"] == first
    assert not writer_job.results[0]["rewritten"]


def test_a_rerun_with_other_examples_raises_the_same_file_exists_error_on_every_worker(writer_job):
    messages = [writer_job.results[rank]["other_examples"] for rank in (0, 1)]
    assert messages[0] == messages[1]
    assert re.fullmatch(r"\S+/rerun already holds 2 shard\(s\) named data-NNNNN-of-NNNNN\.tfrecord, not a complete "
                        r"write of these examples with these settings; pass overwrite=True to replace them, or choose "
                        r"another prefix or out_dir\.", messages[0])
    assert max(writer_job.results[rank]["other_examples_s"] for rank in (0, 1)) < 30


def test_an_unseeded_shuffle_stops_the_job_naming_the_order_instead_of_waiting(writer_job):
    assert writer_job.returncode != 0
    assert re.search(r"\[1\] tfdist\.errors\.DataError: write_tfrecords: worker 1 read the same 64 examples as "
                     r"worker 0 in another order: the source's order differs between workers \(e\.g\. an unseeded "
                     r"shuffle or tfds shuffle_files=True\)\. Seed it", writer_job.output)
    assert "worker 0 wrote the shuffled examples" in writer_job.output
    assert "worker 1 wrote the shuffled examples" not in writer_job.output
    seconds = float(re.search(r"2 worker\(s\), exit codes \[.*\], ([\d.]+)s", writer_job.output).group(1))
    assert seconds < 60, writer_job.output[-3000:]  # the job's timeout is 90 s: a worker that waited would reach it


@pytest.fixture(scope="module")
def reader_job(tmp_path_factory):
    """Fails by design: worker 1 does not see one of the training shards (tests/workers/reader_job.py)."""
    work = tmp_path_factory.mktemp("reader_work")
    shards = data.write_tfrecords({"label": np.arange(32)}, str(work / "0" / "shards"), num_shards=4)
    (work / "1" / "shards").mkdir(parents=True)
    for path in shards.paths[:3]:
        shutil.copy(path, work / "1" / "shards")
    return run_job("reader_job.py", tmp_path_factory.mktemp("reader_job"), str(work), timeout=90)


def test_workers_that_list_other_files_all_stop_before_the_first_step_naming_the_worker_and_the_file(reader_job):
    codes = re.search(r"2 worker\(s\), exit codes \[(\w+), (\w+)\]", reader_job.output).groups()
    assert "0" not in codes, reader_job.output[-3000:]  # the first to exit fails the job, which stops the other
    message = ("tfrecord_dataset(file_pattern='shards/data-*.tfrecord') lists other files on some workers, so the "
               "workers would not read every record once: worker 1 lists 3 files (24 records), worker 0 lists 4 (32 "
               "records): worker 1 does not see 'data-00003-of-00004.tfrecord' (8 records). A shared filesystem that "
               "lags (NFS attribute caching, an object store's listing) or files listed before their writer finished "
               "show workers different files: build the dataset once the writer has finished (write_tfrecords, called "
               "on every worker, returns only then), on a filesystem that shows every worker the same files.")
    for rank in (0, 1):
        assert f"[{rank}] tfdist.errors.DataError: {message}" in reader_job.output, reader_job.output[-3000:]
    assert "began its first step" not in reader_job.output
    seconds = [float(s) for s in re.findall(r"built or failed in ([\d.]+) s", reader_job.output)]
    assert len(seconds) == 2 and max(seconds) < 20, reader_job.output[-3000:]


def test_datasets_that_every_worker_lists_alike_are_checked_apart_and_read_as_before(reader_job):
    """Two builds of one pattern (a second fit) and an overlapping pattern: each its own exchange, digests only."""
    first, second = reader_job.results[0], reader_job.results[1]
    three_shards = [i for i in range(32) if i % 4 != 3]
    for read in ("first", "again"):
        assert sorted(first[read] + second[read]) == three_shards
    assert sorted(first["overlapping"] + second["overlapping"]) == [i for i in range(32) if i % 4 < 2]
    keys = {rank: reader_job.results[rank]["keys"] for rank in (0, 1)}
    assert keys[0] == [f"tfdist/data/tfrecord_dataset/0/{build}/digest/0" for build in (1, 2, 3)]  # the n-th build
    assert keys[1] == [key[:-1] + "1" for key in keys[0]]
