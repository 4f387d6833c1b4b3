"""``common.UNEVEN_CASES`` under tfdist.horovod: each rank holds its share of every global batch, split as
tf.distribute splits one (the first ranks take the extra examples: 49 in batches of 4 on 2 ranks end 1/0, 5 on
2 ranks 3/2), so a rank may have a batch fewer per epoch. Each epoch is a ``fit`` with a DistributedOptimizer
followed by ``hvd.join()``; predictions are gathered in the global order. Writes worker<rank>.json."""

import sys

import numpy as np
import tensorflow as tf

import tfdist.horovod as hvd
from tests.workers import common

hvd.init()
out_dir, size, rank = sys.argv[1], hvd.size(), hvd.rank()
payload = {}
HVD_CASES = ((49, 4, "sgd_scaled"),)  # a rank that joined must not unscale the others' update again


def shares(examples: int, batch: int) -> list[list[int]]:
    """Each rank's rows of every global batch, as tf.distribute splits a batch over ``size`` replicas."""
    mine = [[] for _ in range(size)]
    for start in range(0, examples, batch):
        rows = list(range(start, min(start + batch, examples)))
        cut = np.cumsum([0] + [len(rows) // size + (r < len(rows) % size) for r in range(size)])
        for r in range(size):
            mine[r].append(rows[cut[r]:cut[r + 1]])
    return mine


for examples, batch, optimizer in common.UNEVEN_CASES + HVD_CASES:
    x, y = common.uneven_data(examples)
    batches = [b for b in shares(examples, batch)[rank] if b]
    model = common.uneven_model(optimizer)
    model.compile(hvd.DistributedOptimizer(model.optimizer), "mse", metrics=["mae"])
    rows = [i for b in batches for i in b]
    dataset = tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(len(batches[0]))
    for epoch in range(common.UNEVEN_EPOCHS):
        model.fit(dataset, epochs=1, verbose=0)
        hvd.join()
    predicted = hvd.allgather(tf.constant(np.concatenate([model.predict(x[b], verbose=0) for b in batches])))
    order = np.argsort([i for r in range(size) for b in shares(examples, batch)[r] if b for i in b], kind="stable")
    payload[f"{examples}/{batch}/{optimizer}"] = {"weights": [w.tolist() for w in model.get_weights()],
                                      "predict": predicted.numpy()[order].tolist(), "batches": len(batches)}
common.write_result(out_dir, payload)
