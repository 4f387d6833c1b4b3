"""Workers that list different files for one ``tfrecord_dataset`` (issue 43), after datasets that agree.

Each worker runs in its own directory (``WORK/<rank>``), where the same relative pattern
``shards/data-*.tfrecord`` matches what that worker sees, as a lagging shared filesystem shows it: worker 0
sees all 4 shards, worker 1 three of them (``data-00003-of-00004.tfrecord`` is missing). First every worker
reads the 3 shards both see (``shards/data-0000[0-2]-of-00004.tfrecord``) twice, as a second ``fit`` rebuilds
its dataset, and a dataset whose pattern overlaps it (2 of those shards); it records what it read and the store
keys its builds published, and writes its results. Then it builds the training dataset on the pattern whose
files differ, and fits: the build must stop every worker before the first step.

argv: out_dir, the work directory.
"""

import os
import sys
import time

import tfdist

out_dir, work_dir = sys.argv[1], sys.argv[2]
with tfdist.scope() as strategy:
    pass
import keras  # noqa: E402  (after the strategy: TF must not start first)
import tensorflow as tf  # noqa: E402

from tests.workers import common  # noqa: E402
from tfdist import kvstore  # noqa: E402
from tfdist.data import distribute, tfrecord_dataset  # noqa: E402

os.chdir(os.path.join(work_dir, str(tfdist.rank())))
published = []
_put = kvstore.put
kvstore.put = lambda key, value: (published.append(key), _put(key, value))[1]


def read(pattern):
    """What this worker's replica receives from one pass over the dataset."""
    dataset = distribute(strategy, lambda ctx: tfrecord_dataset(pattern, batch_size=4, input_context=ctx,
                                                                features=["index"], drop_remainder=False))
    return [i for batch in dataset for local in strategy.experimental_local_results(batch["index"])
            for i in local.numpy().tolist()]


both_see = "shards/data-0000[0-2]-of-00004.tfrecord"
results = {"first": read(both_see), "again": read(both_see), "overlapping": read("shards/data-0000[0-1]-*.tfrecord")}
results["keys"] = [key for key in published if key.startswith("tfdist/data/")]
common.write_result(out_dir, results)

started = time.monotonic()
with strategy.scope():
    model = keras.Sequential([keras.Input(()), keras.layers.Reshape((1,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
try:
    dataset = distribute(strategy, lambda ctx: tfrecord_dataset(
        "shards/data-*.tfrecord", batch_size=4, input_context=ctx, repeat=True, features=["index"],
        parse_fn=lambda b: (tf.cast(b["index"], "float32"), tf.cast(b["index"], "float32"))))
finally:
    print(f"worker {tfdist.rank()} built or failed in {time.monotonic() - started:.1f} s", flush=True)


common.fit_two_steps_saying_when_the_first_began(model, dataset)
