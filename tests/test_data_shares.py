"""Every worker's share of an epoch is equal to one record, whatever the number of files and their sizes (issue 49).

The arithmetic (``tfdist.data.epochs.bounds`` and ``parts``) in-process, then real pipelines: with the shares equal,
a run that never resizes reads epoch after epoch in lock-step, no worker starting its next epoch while another still
reads this one (with 5 files on 2 workers, one read 3 files an epoch and the other 2).
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

from tests.test_data_resume import write_unequal_shards
from tfdist import data
from tfdist.data import epochs

UNEQUAL = [5, 30, 8, 22, 17, 26, 12]  # 120 records in 7 files


@pytest.mark.parametrize("total", [0, 1, 5, 96, 101, 120])
@pytest.mark.parametrize("pipelines", [1, 2, 3, 4, 7])
def test_the_parts_are_contiguous_cover_every_record_once_and_differ_by_one_record_at_most(total, pipelines):
    runs = [epochs.bounds(total, p, pipelines) for p in range(pipelines)]
    assert runs[0][0] == 0 and runs[-1][1] == total
    assert all(runs[p][1] == runs[p + 1][0] for p in range(pipelines - 1))
    sizes = [stop - first for first, stop in runs]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def files_of(counts, seed=3, shuffle=True):
    return epochs.Files(tuple(f"f{i}" for i in range(len(counts))), tuple(counts), seed, True, shuffle, 16, True, False)


@pytest.mark.parametrize("counts", [[24] * 5, UNEQUAL, [40, 1], [3], [0 + 1] * 11], ids=str)
@pytest.mark.parametrize("pipelines", [2, 3, 4])
@pytest.mark.parametrize("epoch", [0, 1, 5])
def test_each_pipeline_reads_its_run_of_the_epochs_file_order_whole_files_but_at_its_two_ends(counts, pipelines,
                                                                                                epoch):
    files = files_of(counts)
    order = epochs.file_order(files, tf.constant(epoch, tf.int64)).numpy()
    in_order = [number for f in order for number in range(files.offsets[f], files.offsets[f] + counts[f])]
    for pipeline in range(pipelines):
        runs = list(epochs.parts(files, tf.constant(epoch, tf.int64), pipeline, pipelines).as_numpy_iterator())
        numbers = [files.offsets[f] + r for f, first, stop in runs for r in range(first, stop)]
        first, stop = epochs.bounds(files.total, pipeline, pipelines)
        assert numbers == in_order[first:stop]
        assert sum((first, stop) != (0, counts[f]) for f, first, stop in runs) <= 2  # a part of a file: its ends only


@pytest.fixture(scope="module")
def patterns(tmp_path_factory):
    root = tmp_path_factory.mktemp("shares")
    return {"5_files": data.write_tfrecords({"label": np.arange(120)}, str(root / "five"), num_shards=5).pattern,
            "7_unequal_files": write_unequal_shards(root / "seven", UNEQUAL)}


@pytest.mark.parametrize("layout", ["5_files", "7_unequal_files"])
@pytest.mark.parametrize("workers", [2, 3, 4])
def test_a_run_that_never_resizes_reads_epoch_after_epoch_in_lock_step(patterns, layout, workers):
    """Each worker's first share is epoch 0's part, its second epoch 1's: together, every record once per epoch."""
    streams = []
    for worker in range(workers):
        tf.random.set_seed(100 + worker)
        dataset = data.tfrecord_dataset(patterns[layout], batch_size=workers, repeat=True, seed=3, features=["label"],
                                        input_context=tf.distribute.InputContext(workers, worker, workers))
        streams.append(dataset.unbatch().map(lambda record: record["label"]).take(3 * 120 // workers + 1))
    streams = [list(stream.as_numpy_iterator()) for stream in streams]
    for epoch in range(3):
        seen = []
        for stream in streams:  # every worker count here divides 120
            seen += stream[epoch * 120 // workers:(epoch + 1) * 120 // workers]
        assert sorted(seen) == list(range(120)), (epoch, collections.Counter(collections.Counter(seen).values()))


@pytest.mark.parametrize("where", ["head", "tail"])
def test_a_damaged_record_in_a_file_two_workers_share_never_makes_one_read_into_the_others_run(tmp_path, where):
    """skip_corrupt=True: 5 files of 24 records on 2 workers share the file at the middle of epoch 0's order. TF's
    reader ends a file at a damaged payload, so the worker reading the damaged part loses the rest of its run in
    that file; the other worker's run is whole, and no record is read twice."""
    from tests.test_faults import damage_a_payload

    written = data.write_tfrecords({"label": np.arange(120)}, str(tmp_path), num_shards=5)
    files = files_of([24] * 5)
    shared, _, split = list(epochs.parts(files, tf.constant(0, tf.int64), 0, 2).as_numpy_iterator())[-1]
    damaged = split - 4 if where == "head" else split + 4
    damage_a_payload(written.paths[shared], record=damaged)
    seen = []
    for worker in range(2):
        dataset = data.tfrecord_dataset(written.pattern, batch_size=2, seed=3, features=["label"], skip_corrupt=True,
                                        input_context=tf.distribute.InputContext(2, worker, 2), drop_remainder=False)
        seen += [label for batch in dataset.as_numpy_iterator() for label in batch["label"].tolist()]
    end = split if where == "head" else 24  # the damaged run's end
    lost = {5 * record + shared for record in range(damaged, end)}  # record i is the (i // 5)-th of shard i % 5
    assert sorted(seen) == [label for label in range(120) if label not in lost]


@pytest.mark.timeout(120, method="thread")  # a spin inside TensorFlow ignores the signal method
def test_fewer_records_than_pipelines_with_repeat_is_refused_instead_of_looking_for_ever(tmp_path):
    """Worker 1's part of an epoch of 1 record is empty: its repeating dataset looked for a record for ever."""
    written = data.write_tfrecords({"label": np.arange(1)}, str(tmp_path), num_shards=1)
    with pytest.raises(data.DataError, match=r"^file_pattern='.*-of-00001\.tfrecord' holds 1 "
                                             r"record\(s\), fewer than the 2 input pipelines: with repeat, every "
                                             r"pipeline needs one at least\. Write more records, or read with fewer "
                                             r"workers\.$"):
        next(iter(data.tfrecord_dataset(written.pattern, batch_size=2, repeat=True, features=["label"],
                                         input_context=tf.distribute.InputContext(2, 1, 2))))
