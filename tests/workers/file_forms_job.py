"""Workers whose file lists differ, in every form ``tfrecord_dataset`` takes (issue 49).

Each worker runs in its own directory (``WORK/<rank>``): worker 0 sees the 4 shards ``shards/train-0000N-of-00004``,
worker 1 the first 3 (its listing lags by one shard). ``MODE``:

- ``list``: every worker passes ``sorted(tf.io.gfile.glob(...))`` of what it sees, so worker 1's list is one
  shorter, and fits: the build must stop every worker before the first step, within seconds.
- ``forms``: every worker builds one sharded dataset per form (a pattern, a list of names, a list of patterns that
  differ per worker, a ``tf.data.Dataset.list_files``, a list that is empty on worker 1: its glob found nothing yet),
  records the error each build raised and how long it took,
  then builds and reads a dataset that every worker lists alike (the checks that failed must not shift the next
  one's key), and writes its results.

argv: out_dir, the work directory, MODE.
"""

import os
import sys
import time

import tfdist

out_dir, work_dir, mode = sys.argv[1], sys.argv[2], sys.argv[3]
with tfdist.scope() as strategy:
    pass
import keras  # noqa: E402  (after the strategy: TF must not start first)
import tensorflow as tf  # noqa: E402

from tests.workers import common  # noqa: E402
from tfdist.data import DataError, distribute, tfrecord_dataset  # noqa: E402

os.chdir(os.path.join(work_dir, str(tfdist.rank())))
listed = sorted(tf.io.gfile.glob("shards/train-*.tfrecord"))


def build(file_pattern, **options):
    return distribute(strategy, lambda ctx: tfrecord_dataset(file_pattern, batch_size=4, input_context=ctx,
                                                             features=["index"], **options))


if mode == "list":
    started = time.monotonic()
    with strategy.scope():
        model = keras.Sequential([keras.Input(()), keras.layers.Reshape((1,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    try:
        dataset = build(listed, repeat=True, parse_fn=lambda b: (tf.cast(b["index"], "float32"),) * 2)
    finally:
        print(f"worker {tfdist.rank()} built or failed in {time.monotonic() - started:.1f} s", flush=True)

    common.fit_two_steps_saying_when_the_first_began(model, dataset)
    sys.exit(0)

FORMS = {
    "pattern": "shards/train-*.tfrecord",
    "list": listed,
    "patterns": ["shards/train-0000[0-1]-*", "shards/train-0000[2-3]-*"] if tfdist.rank() == 0
    else ["shards/train-0000[0-1]-*", "shards/train-00002-*"],
    "list_files": tf.data.Dataset.list_files("shards/train-*.tfrecord"),  # shuffled: another order per worker
    "empty": listed if tfdist.rank() == 0 else [],
}
results = {}
for form, file_pattern in FORMS.items():
    started = time.monotonic()
    try:
        build(file_pattern)
        results[form] = ["built", time.monotonic() - started]
    except DataError as error:
        results[form] = [str(error), time.monotonic() - started]
both_see = build("shards/train-0000[0-2]-*.tfrecord", drop_remainder=False)
results["after"] = [i for batch in both_see for local in strategy.experimental_local_results(batch["index"])
                    for i in local.numpy().tolist()]
common.write_result(out_dir, results)
