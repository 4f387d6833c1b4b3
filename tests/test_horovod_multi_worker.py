"""tfdist.horovod on a real 2-worker job (tests/workers/horovod_job.py) started through `tfdist run`."""

import numpy as np
import pytest

from tests.jobs import run_job
from tests.workers import common


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_job("horovod_job.py", tmp_path_factory.mktemp("horovod")).check()


def each(job, key):
    return [job.results[rank][key] for rank in (0, 1)]


def test_shape_of_the_job_and_flags(job):
    for rank in (0, 1):
        result = job.results[rank]
        # size, rank, local_size, local_rank, cross_size, cross_rank, is_homogeneous, is_initialized
        assert result["shape"] == [2, rank, 2, rank, 1, 0, True, True]
        assert result["ops"] == [2, rank, rank, 2, 1, int(rank == 1)]
        assert result["flags"] == [False] * 7
        # global set, set [0], set [1]: size, rank in set, included
        assert result["sets"] == [[2, rank, True], [1, 0 if rank == 0 else None, rank == 0],
                                  [1, 0 if rank == 1 else None, rank == 1]]


def test_allreduce_ops_and_scaling_exact(job):
    expected = [
        [1.5, 10.0],    # Average of [1, 10] and [2, 10]
        [3.0, 20.0],    # Sum
        [3.0, 20.0],    # average=False (Horovod's deprecated form of Sum)
        [1, 4],         # Min of [1, 5] and [2, 4]
        [2, 5],         # Max
        [2, 20],        # Product
        [9.0],          # (2 * 0.5 + 4 * 0.5) * 3
    ]
    assert each(job, "allreduce") == [expected, expected]
    # fp16 on the wire: float16(1/3) + float16(4/3), summed in float16, back to float32
    want = float(np.float16(np.float16(1 / 3) + np.float16(4 / 3)))
    assert each(job, "allreduce_fp16") == [["float32", want]] * 2
    assert each(job, "allreduce_sparse") == [{"values": [[0.5], [1.0]], "indices": [0, 1]}] * 2
    assert each(job, "grouped_allreduce") == [[[[3.0, 3.0], [3.0, 3.0]], [1], 3.0]] * 2


def test_gather_broadcast_alltoall_reducescatter_exact(job):
    assert each(job, "allgather") == [[[0, 0], [1, 1], [1, 1]]] * 2        # rank 0 gave 1 row, rank 1 two
    assert each(job, "grouped_allgather") == [[[0, 1], [[7.0]]]] * 2       # rank 1 gave no rows to the second
    assert each(job, "broadcast") == [[1.5, 1.0]] * 2
    assert each(job, "broadcast_variables") == [[[1.0, 2.0], 4]] * 2
    assert each(job, "broadcast_") == [[[0.0]]] * 2
    assert each(job, "broadcast_object") == [{"rank": 1, "text": "xx"}] * 2
    assert each(job, "allgather_object") == [[{"rank": 0, "items": [0]}, {"rank": 1, "items": [0, 1]}]] * 2
    # rank 0 sends [0] to itself and [1, 2] to rank 1; rank 1 sends [10, 11] to rank 0 and [12] to itself
    assert each(job, "alltoall") == [[[0, 10, 11], [1, 2]], [[1, 2, 12], [2, 1]]]
    assert each(job, "alltoall_even") == [[0, 10], [1, 11]]
    # rows [[0, 1], [2, 3], [4, 5]] * 1 and * 2: 3 rows split 2 + 1
    assert each(job, "reducescatter") == [[[[0.0, 3.0], [6.0, 9.0]], [[0.0, 1.5], [3.0, 4.5]]],
                                          [[[12.0, 15.0]], [[6.0, 7.5]]]]
    assert each(job, "grouped_reducescatter") == [[[[0.0, 3.0], [6.0, 9.0]], [1.0]], [[[12.0, 15.0]], [3.0]]]
    first, second = each(job, "join")
    assert first == second and first in (0, 1)


def test_process_sets(job):
    assert each(job, "own_set") == [[1.0, 10.0], [2.0, 10.0]]  # a set of one rank: its own values
    for error in each(job, "other_set_error"):
        assert "which this rank is not part of; call it only on the ranks of the set" in error


def test_collectives_inside_tf_function(job):
    for rank in (0, 1):
        run_1, run_2 = job.results[rank]["in_graph"]
        assert run_1 == run_2
        average, gathered, broadcast, received, scattered = run_1
        assert average == [1.5, 5.0]
        assert gathered == [1.0, 2.0, 5.0]
        assert broadcast == [2.0, 5.0]
        assert received == [[1.0, 5.0, 2.0, 5.0], [1.0, 5.0, 2.0, 5.0]][rank]
        assert scattered == [[3.0], [10.0]][rank]


def test_gradients_flow_through_collectives_as_in_horovod(job):
    # allreduce: the mean of the upstream gradients (1 and 2) times each rank's own factor;
    # allgather: this rank's rows of the summed upstream [2, 4, 6]; broadcast: all to the root
    assert each(job, "gradients") == [[[1.5, 1.5], [2.0, 0.0], [0.0, 0.0]], [[3.0, 3.0], [4.0, 6.0], [3.0, 3.0]]]


@pytest.mark.parametrize("key, atol", [("optimizer_weights", 1e-5), ("tape_weights", 1e-5),
                                       ("predivide_weights", 1e-5), ("accumulated_weights", 1e-5),
                                       ("fp16_weights", 1e-3)])
def test_two_processes_of_batch_b_equal_one_process_of_batch_2b(job, key, atol):
    reference = common.train_equivalence()  # 5 SGD steps at batch 16, one process
    first, second = each(job, key)
    for a, b, want in zip(first, second, reference):
        np.testing.assert_array_equal(a, b)  # identical on both processes
        np.testing.assert_allclose(a, want, atol=atol)


def test_iterations_count_updates(job):
    assert each(job, "optimizer_iterations") == [5, 5]
    assert each(job, "accumulated_iterations") == [5, 5]  # 10 micro-batches of 4, 5 updates


def test_step_counts_k_does_not_divide_are_the_users(job):
    """steps_per_execution=4 with DistributedOptimizer runs exactly the steps asked for, as K=1 does."""
    for rank in (0, 1):
        counts = job.results[rank]["step_counts"]
        common.assert_same_steps(counts["1"], counts["4"])


def test_gradient_tape_with_fp16_compression_rounds_on_the_wire(job):
    """Mean of 1/3 and 4/3 (5/6): float32 exactly, fp16 within float16's rounding, and not equal."""
    for rank in (0, 1):
        fp16, f32 = job.results[rank]["tape_fp16_gradient"]
        assert f32 == pytest.approx(5 / 6, abs=1e-7)
        assert fp16 == pytest.approx(5 / 6, abs=1e-3) and fp16 != f32  # it went through float16
    assert job.results[0]["tape_fp16_gradient"] == job.results[1]["tape_fp16_gradient"]


def test_loss_scaling_skips_on_every_process_when_one_overflows(job):
    # step 1 applied, step 2 overflowed on rank 1 only: both skipped it and halved the scale
    assert each(job, "loss_scale") == [[16384.0, 1, True]] * 2
    first, second = each(job, "loss_scale_weights")
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_mismatched_allreduce_fails_fast_on_every_rank_and_the_job_goes_on(job):
    for name, message, seconds in each(job, "mismatch"):
        assert name == "CollectiveMismatchError"
        assert message == ("Mismatched allreduce tensors: every rank must pass the same shape and dtype; received "
                           "rank 0: float32 [2]; rank 1: float32 [3]. Make the tensors agree on every rank "
                           "(allgather accepts a different first dimension).")
        assert seconds < 10
    assert each(job, "after_mismatch") == [2.0, 2.0]
