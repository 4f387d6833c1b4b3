"""A 2-worker job: helpers, fit/evaluate/predict, and the equivalence run."""

import sys

import numpy as np

import tfdist
from tests.workers import common

out_dir = sys.argv[1]
with tfdist.scope() as strategy:
    pass
import tensorflow as tf  # noqa: E402  (after the strategy: TF must not start first)

payload = {
    "strategy": type(strategy).__name__,
    "size": tfdist.size(),
    "rank": tfdist.rank(),
    "num_workers": tfdist.num_workers(),
    "is_chief": tfdist.is_chief(),
    "equivalence_weights": [w.tolist() for w in common.train_equivalence(strategy)],
    "arrays": common.train_equivalence_on_arrays(strategy),
    "steps_per_execution_3": [w.tolist() for w in common.train_equivalence(strategy, steps_per_execution=3)],
    "step_counts": {str(k): common.step_counts(strategy, k) for k in (1, 4, None)},
}

x, y = common.regression_data(256)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
with strategy.scope():
    model = common.equivalence_model()
history = model.fit(dataset, epochs=3, verbose=0)
payload["loss_history"] = history.history["loss"]
payload["evaluate_loss"] = float(model.evaluate(dataset, verbose=0))
payload["predict_shape"] = list(model.predict(dataset, verbose=0).shape)
payload["final_weights"] = [w.tolist() for w in model.get_weights()]
common.write_result(out_dir, payload)
