"""Global batches that do not split evenly over the workers (``common.UNEVEN_CASES``: fit, evaluate, predict; and
``common.REDUCTION_CASES``: a loss of another reduction on even and uneven splits),
and a custom loop whose loss is ``tfdist.compute_average_loss`` over batches of 5 (on 2 workers 3/2, on 3
workers 2/2/1, the last batch of 1 example on one worker only). Writes worker<rank>.json."""

import sys

import tfdist
from tests.workers import common

out_dir = sys.argv[1]
with tfdist.scope() as strategy:
    pass
payload = {"replicas": strategy.num_replicas_in_sync}
for examples, batch, optimizer in common.UNEVEN_CASES:
    with strategy.scope():
        model = common.uneven_model(optimizer)
    payload[f"{examples}/{batch}"] = common.uneven_run(model, examples, batch)
for examples, batch, reduction in common.REDUCTION_CASES:
    payload[f"{examples}/{batch}/{reduction}"] = common.reduction_run(examples, batch, reduction, strategy)

payload["loop"] = common.uneven_loop(strategy)
common.write_result(out_dir, payload)
