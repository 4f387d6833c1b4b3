"""A 2-worker job: helpers, fit/evaluate/predict, the equivalence run, and fit/evaluate on per-worker data of
different lengths (rank 1: 40% fewer batches) through ``distribute_datasets_from_function``."""

import sys

import numpy as np

import tfdist
from tests.workers import common

out_dir = sys.argv[1]
with tfdist.scope() as strategy:
    pass
import keras  # noqa: E402  (after the strategy: TF must not start first)
import tensorflow as tf  # noqa: E402

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

UNEVEN_BATCHES = (10, 6)


def per_worker(x, y):
    return strategy.distribute_datasets_from_function(
        lambda context: tf.data.Dataset.from_tensor_slices((x, y)).batch(common.JOIN_BATCH))


class Batches(keras.callbacks.Callback):
    """Counts batches (a batch-level callback also makes Keras run one step per call)."""

    def __init__(self):
        super().__init__()
        self.train = self.test = 0

    def on_train_batch_end(self, batch, logs=None):
        self.train += 1

    def on_test_batch_end(self, batch, logs=None):
        self.test += 1


rank, batches = tfdist.rank(), Batches()
# steps_per_execution "auto" with a per-batch callback on worker 0 only: every worker must run one step a call.
with strategy.scope():
    auto = common.equivalence_model()
auto.fit(dataset, epochs=1, verbose=0, callbacks=[Batches()] if rank == 0 else [])
payload["auto_k_callback_on_one_worker"] = {"weights": [w.tolist() for w in auto.get_weights()],
                                            "steps": int(auto.optimizer.iterations.numpy())}
with strategy.scope():
    uneven = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    uneven.set_weights(common.join_start())
    uneven.compile(keras.optimizers.SGD(common.JOIN_LR), "mse", metrics=["mae"])
history = uneven.fit(per_worker(*common.join_data(rank, UNEVEN_BATCHES[rank])), epochs=1, verbose=0,
                     callbacks=[batches])
payload["uneven"] = {
    "fit": {"weights": [w.tolist() for w in uneven.get_weights()], "loss": history.history["loss"],
            "steps": int(uneven.optimizer.iterations.numpy())},
    "evaluate": uneven.evaluate(per_worker(*common.join_data(10 + rank, UNEVEN_BATCHES[rank])), verbose=0,
                                return_dict=True, callbacks=[batches]),
    "batches": [batches.train, batches.test]}
common.write_result(out_dir, payload)
