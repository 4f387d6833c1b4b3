"""mixed_float16 on a real 2-worker cluster: an overflow on one worker is skipped by both."""

import pytest

from tests.jobs import run_job


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_job("precision_job.py", tmp_path_factory.mktemp("precision")).check()


def test_an_overflow_on_either_worker_skips_the_step_on_both(job):
    first, second = job.results[0]["direct"], job.results[1]["direct"]
    assert first == second  # identical weights and scale on both workers after every step
    start, finite, bad_on_1, bad_on_0, finite_again = first
    assert start == {"w": [1.0, 2.0], "scale": 8.0}
    assert finite == {"w": [0.875, 1.875], "scale": 8.0}  # 1 - 0.5 * (1 + 1) / 8
    assert bad_on_1 == {"w": finite["w"], "scale": 4.0}
    assert bad_on_0 == {"w": finite["w"], "scale": 2.0}
    assert finite_again == {"w": [0.375, 1.375], "scale": 2.0}  # 0.875 - 0.5 * 2 / 2


def test_custom_loop_trains_in_float16_and_skips_a_poisoned_batch(job):
    first, second = job.results[0], job.results[1]
    assert first["compute_dtype"] == "float16"
    assert first["losses"] == second["losses"]
    assert first["losses"][-1] < 0.5 * first["losses"][0]
    assert first["weights_after"] == first["weights_before"] == second["weights_after"]
    assert first["scale_after"] == second["scale_after"] == first["scale_before"] / 2
