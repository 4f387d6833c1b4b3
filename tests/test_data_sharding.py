"""Every record read exactly once per epoch, for any number of input pipelines and files; shuffling order."""

import collections
import warnings

import numpy as np
import pytest
import tensorflow as tf

from tfdist import data
from tfdist.strategy import make_strategy

NUM_RECORDS = 37  # prime: no file count or pipeline count divides it


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Pattern per number of files: the same 37 records in 1, 2, 3 and 5 files."""
    images = np.arange(NUM_RECORDS * 4 * 4 * 3, dtype=np.uint32).reshape(NUM_RECORDS, 4, 4, 3).astype(np.uint8)
    source = {"image": images, "label": np.arange(NUM_RECORDS) % 3}
    root = tmp_path_factory.mktemp("shards")
    return {n: data.write_tfrecords(source, str(root), num_shards=n, prefix=f"n{n}").pattern for n in (1, 2, 3, 5)}


def read_pipelines(pattern, num_pipelines, **kwargs):
    """Indices each of ``num_pipelines`` input pipelines yields, and the warnings raised building them."""
    per_pipeline, caught = [], []
    for pipeline in range(num_pipelines):
        context = tf.distribute.InputContext(num_input_pipelines=num_pipelines, input_pipeline_id=pipeline,
                                             num_replicas_in_sync=num_pipelines)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            dataset = data.tfrecord_dataset(pattern, batch_size=2 * num_pipelines, input_context=context, **kwargs)
        caught += [w for w in record if issubclass(w.category, data.ShardingWarning)]
        per_pipeline.append([int(i) for batch in dataset for i in batch["index"].numpy()])
    return per_pipeline, caught


CASES = [(pipelines, files) for pipelines in (1, 2, 3, 4) for files in (5, pipelines - 1) if files >= 1]


@pytest.mark.parametrize("pipelines,files", CASES, ids=[f"{p}pipelines-{f}files" for p, f in CASES])
def test_one_epoch_reads_every_record_exactly_once(shards, pipelines, files):
    per_pipeline, caught = read_pipelines(shards[files], pipelines)
    assert sorted(i for seen in per_pipeline for i in seen) == list(range(NUM_RECORDS))
    assert all(per_pipeline)
    size, extra = divmod(NUM_RECORDS, pipelines)  # equal shares, to one record, whatever the files
    assert [len(seen) for seen in per_pipeline] == [size + (p < extra) for p in range(pipelines)]
    if files >= pipelines:  # whole files, but for a run of the files at its part's two ends (record i: file i % files)
        assert not caught
        for seen in per_pipeline:
            held = collections.Counter(i % files for i in seen)
            assert sum(held[f] < len(range(f, NUM_RECORDS, files)) for f in held) <= 2
    else:
        assert len(caught) == pipelines
        assert f"Write at least {pipelines} files" in str(caught[0].message)


def test_every_epoch_is_exactly_once_though_files_move_between_pipelines(shards):
    per_pipeline, _ = read_pipelines(shards[5], 2, repeat=3, drop_remainder=False)
    counts = collections.Counter(i for seen in per_pipeline for i in seen)
    assert counts == {i: 3 for i in range(NUM_RECORDS)}


def indices(dataset):
    return [int(i) for batch in dataset for i in batch["index"].numpy()]


def test_same_seed_same_order_other_seed_other_order(shards):
    first = indices(data.tfrecord_dataset(shards[3], batch_size=4, seed=7))
    assert first == indices(data.tfrecord_dataset(shards[3], batch_size=4, seed=7))
    assert first != indices(data.tfrecord_dataset(shards[3], batch_size=4, seed=8))
    assert sorted(first) == list(range(NUM_RECORDS))


def test_each_epoch_has_a_new_order(shards):
    dataset = data.tfrecord_dataset(shards[3], batch_size=4, seed=7)
    epochs = [indices(dataset), indices(dataset)]
    assert epochs[0] != epochs[1] and sorted(epochs[0]) == sorted(epochs[1])
    repeated = indices(data.tfrecord_dataset(shards[3], batch_size=4, seed=7, repeat=2, drop_remainder=False))
    assert repeated[:NUM_RECORDS] != repeated[NUM_RECORDS:]
    assert sorted(repeated[NUM_RECORDS:]) == list(range(NUM_RECORDS))


def test_no_shuffle_reads_files_in_order(shards):
    assert indices(data.tfrecord_dataset(shards[1], batch_size=5, shuffle=False)) == list(range(NUM_RECORDS))


def test_global_batch_is_split_per_replica():
    context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=0, num_replicas_in_sync=4)
    assert data.per_pipeline_batch_size(32, context) == 8
    with pytest.raises(data.DataError, match=r"global batch_size=10 does not divide by the 4 replicas"):
        data.per_pipeline_batch_size(10, context)


def test_distribute_gives_each_replica_its_share(shards):
    strategy = make_strategy("mirrored", devices="CPU:[0-1]")
    dataset = data.distribute(strategy, lambda ctx: data.tfrecord_dataset(shards[5], batch_size=8, input_context=ctx))
    seen, sizes = [], set()
    for batch in dataset:
        for local in strategy.experimental_local_results(batch["index"]):
            seen += local.numpy().tolist()
            sizes.add(len(local))
    assert sorted(seen) == list(range(NUM_RECORDS))
    assert max(sizes) == 4  # the global batch of 8 over 2 replicas
    with pytest.raises(data.DataError, match="dataset_fn must be a function"):
        data.distribute(strategy, shards[5])
