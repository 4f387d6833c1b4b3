"""A 2-worker job reading TFRecord shards through tfdist.data: what each worker reads, and training.

Besides one epoch and a short training, it runs the scripts of issue 29 as every worker runs them: a global
seed per worker (``keras.utils.set_random_seed(100 + rank)``), one ``cache=`` path for all, built twice (the
second build reads the cache), and ``write_tfrecords(..., overwrite=True)`` then reading, 3 rounds, with the
chief's shard moves slowed down; also a write on the chief only. Then ``fit`` on 49 examples at global batch
4 (a last batch of 1).

argv: out_dir, shard pattern, global batch, steps per epoch, 16-file shard pattern, a work directory.
"""

import os
import sys
import time

import tfdist

out_dir, pattern, global_batch, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
pattern_16, work_dir = sys.argv[5], sys.argv[6]
with tfdist.scope() as strategy:
    pass
import keras  # noqa: E402  (after the strategy: TF must not start first)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.workers import common  # noqa: E402
from tfdist import collectives, data  # noqa: E402
from tfdist.data import writer  # noqa: E402

keras.utils.set_random_seed(100 + tfdist.rank())  # the usual idiom: other dropout and augmentation per worker


def to_xy(batch):
    return tf.cast(batch["image"], tf.float32) / 255.0, batch["label"]


def read(file_pattern, feature="index", **kwargs):
    """What this worker's replica receives, through the strategy, from one pass over the dataset."""
    dataset = data.distribute(strategy, lambda ctx: data.tfrecord_dataset(
        file_pattern, batch_size=global_batch, input_context=ctx, features=[feature], drop_remainder=False,
        **kwargs))
    seen = []
    for batch in dataset:
        for local in strategy.experimental_local_results(batch[feature]):
            seen += local.numpy().tolist()
    return seen


def train():
    dataset = data.distribute(strategy, lambda ctx: data.tfrecord_dataset(
        pattern, batch_size=global_batch, input_context=ctx, repeat=True, seed=1, parse_fn=to_xy))
    with strategy.scope():
        model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Flatten(), keras.layers.Dense(2)])
        rng = np.random.default_rng(0)
        model.set_weights([rng.normal(scale=0.1, size=w.shape).astype("float32") for w in model.get_weights()])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(dataset, epochs=3, steps_per_epoch=steps, verbose=0)
    return history.history["loss"], model.get_weights()


def writer_race(rounds=3, num_records=40):
    """Every worker writes (overwrite=True) and reads at once; round r's labels are 1000 * r + index."""
    if tfdist.is_chief():
        writer._before_each_move = lambda: time.sleep(0.25)  # a wide window for a worker that does not wait
    labels = []
    for r in range(rounds):
        shards = data.write_tfrecords({"label": np.arange(num_records) + 1000 * r}, os.path.join(work_dir, "race"),
                                      num_shards=4, overwrite=True)
        labels.append(read(shards.pattern, feature="label", repeat=1, shuffle=True))
    return labels


def chief_only():
    """The other way to write: only the chief calls write_tfrecords, every worker then waits at a barrier."""
    out = os.path.join(work_dir, "chief_only")
    if tfdist.is_chief():
        data.write_tfrecords({"label": np.arange(8)}, out, num_shards=2)
    collectives.barrier()
    return read(os.path.join(out, "data-*.tfrecord"), feature="label")


cache = os.path.join(work_dir, "cache", "train")  # one path, in the script every worker runs
results = {
    "indices": read(pattern),
    "seeded": read(pattern_16, repeat=3, seed=7, deterministic=True),
    "cached": read(pattern_16, repeat=3, cache=cache, deterministic=True),
    "from_cache": read(pattern_16, repeat=3, cache=cache, deterministic=True),  # the cache files exist now
    "race": writer_race(),
    "chief_only": chief_only(),
    "partial_batch": common.train_equivalence_on_arrays_of(49, strategy=strategy),  # a last batch of 1
}
results["losses"], weights = train()
results["weights"] = [w.tolist() for w in weights]
common.write_result(out_dir, results)
