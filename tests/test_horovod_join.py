"""2 real Horovod-style ranks with uneven data: ``hvd.join()``, one-rank retraces, ``hvd.SyncBatchNormalization``."""

import keras
import numpy as np
import pytest

from tests.jobs import run_job
from tests.workers import common


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_job("horovod_join_job.py", tmp_path_factory.mktemp("join"), timeout=240).check()


def assert_equal_on_both_ranks(job, key: str, expected: list) -> None:
    """Both ranks' ``key`` weights are bit-equal, and equal ``expected`` within float rounding."""
    first, second = job.results[0][key], job.results[1][key]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    for got, want in zip(first, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def assert_joined(job, run: str, data: list, last: int, per_example: bool = False) -> None:
    """Both ranks' weights of ``run`` are equal, equal NumPy's join average of ``data`` (``per_example``: one
    device's mean over the rows of every step), and agree on the last rank."""
    assert_equal_on_both_ranks(job, f"{run}_weights", common.join_by_hand(data, per_example=per_example))
    assert job.results[0][f"{run}_last"] == job.results[1][f"{run}_last"] == last


def test_fit_with_fewer_batches_on_rank_1_joins_weighing_every_example_as_one_device(job):
    """fit's DistributedOptimizer weighs each rank by its examples: once rank 1 joined, a step is rank 0's
    batch alone (Horovod would halve it)."""
    assert_joined(job, "fit", [common.join_data(0, 10), common.join_data(1, 6)], last=0,  # rank 0 joined last
                  per_example=True)


def test_a_loss_one_rank_computes_outside_a_tape_weighs_no_later_step(job):
    """Rank 0 validated with tfdist.compute_average_loss: the ranks' later tf.function tape steps still match."""
    assert_equal_on_both_ranks(job, "validated_weights", common.join_by_hand(
        [common.join_data(10, 2), common.join_data(11, 2)]))


def test_a_tape_loop_weighed_by_compute_average_loss_joins_as_one_device(job):
    assert_joined(job, "weighed", [common.join_data(12, 3), common.join_data(13, 2)], last=0, per_example=True)


def test_tf_function_loop_with_distributed_gradient_tape_joins(job):
    """No broadcast after join (Horovod's users need one): rank 0 joined after 3 of rank 1's 5 steps."""
    assert_joined(job, "loop", [common.join_data(2, 3), common.join_data(3, 5)], last=1)


def test_sync_batch_normalization_on_two_ranks_equals_one_process_on_the_global_batch(job):
    x, y = common.sync_bn_data()
    reference = common.sync_bn_model(keras.layers.BatchNormalization(momentum=0.5))
    reference.compile(keras.optimizers.SGD(0.1), "mse")
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for rank in (0, 1):
        for got, want in zip(job.results[rank]["sync_bn_weights"], reference.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_sync_batch_normalization_refuses_fused():
    import tfdist.horovod as hvd

    with pytest.raises(ValueError, match=r"SyncBatchNormalization does not support fused=True: pass fused=False"):
        hvd.SyncBatchNormalization(fused=True)
    assert hvd.SyncBatchNormalization(momentum=0.9, epsilon=1e-3).get_config()["momentum"] == 0.9


def test_eager_distributed_gradient_tape_loop_joins(job):
    assert_joined(job, "eager", [common.join_data(8, 2), common.join_data(9, 4)], last=1)


def test_tape_made_inside_a_tf_function_survives_one_rank_retracing_for_a_partial_batch(job):
    x, y = common.join_data(6, 3)  # rank 0 trains on 10 rows: batches of 4, 4 and 2
    assert_equal_on_both_ranks(job, "retrace_weights", common.join_by_hand([(x[:10], y[:10]), common.join_data(7, 3)]))


def test_sparse_gradients_survive_one_rank_retracing_for_a_partial_batch(job):
    batch = common.JOIN_BATCH
    per_rank = [[(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]
                for x, y in (common.embedding_data(0, 10), common.embedding_data(1, 12))]
    assert_equal_on_both_ranks(job, "sparse_weights", common.mean_of_gradients(common.embedding_model(), per_rank))


def test_gradient_buckets_do_not_wait_for_sync_batch_normalizations_backward_all_reduce(job):
    """The layer's collectives run in their own lane: the first bucket (last layers) starts before the backward
    pass reaches the layer; the bucket holding the layer before it waits, as its data needs."""
    lane = job.results[0]["sync_bn_lane"]
    assert lane["buckets"] >= 2 and lane["layer_collectives"] == 2, lane
    assert not lane["first_bucket_waits"] and lane["last_bucket_waits"], lane
    for a, b in zip(job.results[0]["sync_bn_lane_weights"], job.results[1]["sync_bn_lane_weights"]):
        np.testing.assert_array_equal(a, b)


def test_fp16_wire_under_loss_scaling_skips_no_step_one_device_takes(job):
    for rank in (0, 1):
        result = job.results[rank]["fp16_loss_scale"]
        assert (result["steps"], result["scale"]) == (2, 2.0**15), result
        np.testing.assert_allclose(result["weights"], [1.0 - 0.01 * 3 * 2, 2.0 - 0.01 * 2], rtol=1e-6)


def test_join_makes_every_tower_equal_when_their_eager_tapes_share_gradient_shapes(job):
    """Two models of one shape, a tape each: their reductions share a name, and join broadcast only the latest
    tape's variables (the first tower stayed 0.2 apart across ranks)."""
    assert job.results[0]["towers_last"] == job.results[1]["towers_last"] == 1
    for first, second in zip(job.results[0]["towers_weights"], job.results[1]["towers_weights"]):
        for a, b in zip(first, second):
            np.testing.assert_array_equal(a, b)
    assert job.results[0]["towers_weights"][0] != job.results[0]["towers_weights"][1]  # two towers, trained apart


def test_join_refuses_ranks_whose_tape_loops_differentiated_different_variables(monkeypatch):
    """The broadcast after join would mismatch (or hang): the ranks' counts are compared first, in the one
    all-gather join makes anyway."""
    import tensorflow as tf

    from tfdist.horovod import uneven

    class TwoRanks:  # rank 0's view: its peer's loop differentiated 2 variables, its own none
        size, ranks = 2, [0, 1]

        def allgather(self, tensor):
            return tf.concat([tensor, tf.constant([0, 2, 7], tf.int64)], 0)

    monkeypatch.setattr(uneven, "_steps", {})
    with pytest.raises(ValueError, match=r"hvd\.join\(\): the ranks' DistributedGradientTape loops differentiated "
                                         r"different variables \(rank 0: 0, rank 1: 2 variables\)"):
        uneven.join(TwoRanks())


def test_metric_average_callback_weighs_every_rank_by_its_examples(job):
    """Rank 0: 8 training and 6 validation examples, rank 1: 5 and 3. The averaged loss and val_loss equal one
    device's over the 13 and 9 examples (Horovod's mean of the ranks' means would not)."""
    import tensorflow as tf

    x0, y0 = common.join_data(14, 2)
    vx, vy = common.join_data(15, 2)
    x1, y1 = x0[:5], y0[:5]
    batches = [(np.concatenate([x0[:4], x1[:4]]), np.concatenate([y0[:4], y1[:4]])),
               (np.concatenate([x0[4:8], x1[4:5]]), np.concatenate([y0[4:8], y1[4:5]]))]
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.set_weights(common.join_start())
    model.compile(keras.optimizers.SGD(common.JOIN_LR), "mse")
    losses = [float(model.train_on_batch(bx, by)) for bx, by in batches]
    val_x, val_y = np.concatenate([vx[:6], vx[:3]]), np.concatenate([vy[:6], vy[:3]])
    val_loss = float(model.evaluate(tf.constant(val_x), tf.constant(val_y), verbose=0))
    for rank in (0, 1):
        logs = job.results[rank]["averaged_logs"]
        np.testing.assert_allclose(logs["loss"], (8 * losses[0] + 5 * losses[1]) / 13, rtol=1e-5)
        np.testing.assert_allclose(logs["val_loss"], val_loss, rtol=1e-5)
        for got, want in zip(job.results[rank]["averaged_weights"], model.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_rank_without_validation_data_logs_the_others_val_loss(job):
    first, second = job.results[0]["one_validates"], job.results[1]["one_validates"]
    assert first == second and set(first) == {"loss", "val_loss"}
    np.testing.assert_allclose(first["val_loss"], job.results[0]["one_validates_own"], rtol=1e-6)


def test_a_joined_rank_of_an_accumulating_optimizer_ends_with_the_last_ranks_weights(job):
    """backward_passes_per_step=2: the joined rank's stand-in cannot apply (it would accumulate), so join
    broadcasts the optimizer's weights from the last rank to join (they were stale on the joined rank)."""
    first, second = job.results[0]["accumulated_weights"], job.results[1]["accumulated_weights"]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert job.results[0]["accumulated_last"] == job.results[1]["accumulated_last"] == 0
    assert first != [w.tolist() for w in common.join_start()]  # it trained
