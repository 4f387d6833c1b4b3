"""Keras tests that may fail with tfdist: each only where Keras itself trains other than asked on one device.

An entry names the upstream issue, why the test fails with tfdist, and the one-device case where plain Keras trains
other than asked (tfdist's own test of that case is named in ``tfdist_test``). Keys are pytest node ids relative to
``keras/src``. The gate fails on an entry that passes with tfdist (stale) as on a new failure.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Allowed:
    issue: str
    why: str
    one_device_case: str
    tfdist_test: str


_K_PAST_STEPS_PER_EPOCH = Allowed(
    issue="keras#20861 (steps and batch numbers under steps_per_execution; no issue filed yet for the extra steps)",
    why="steps_per_epoch=5 with steps_per_execution=2 over 10 batches: Keras trains 6 steps in epoch 1 and 4 in "
        "epoch 2 (3 and 2 calls), and the test pins those 5 calls and their losses; tfdist trains 5 and 5 (3 calls "
        "an epoch, the last of one step).",
    one_device_case="fit(steps_per_epoch=10, epochs=3) at steps_per_execution=4 over a repeated dataset: Keras "
                    "trains 36 steps where 30 were asked (each epoch ends with a whole call of 4).",
    tfdist_test="tests/test_steps_per_execution.py::test_without_the_fix_keras_trains_whole_calls_past_the_step_count")

ALLOWED: dict[str, Allowed] = {
    **{f"trainers/trainer_test.py::TestTrainer::test_steps_per_execution_steps_per_epoch_match_multi_epoch_{mode}":
       _K_PAST_STEPS_PER_EPOCH for mode in ("eager", "non_jit", "jit")},
    "callbacks/backup_and_restore_test.py::BackupAndRestoreCallbackTest::test_best_case_step": Allowed(
        issue="keras#19179 (BackupAndRestore restores the epoch only; no issue filed yet for the batch it saved)",
        why="BackupAndRestore(save_freq=1) saved after 2 of epoch 0's 3 batches; resumed, Keras starts epoch 0 "
            "again and trains those 2 batches twice (17 steps for a 15-step fit), which the test pins; tfdist "
            "resumes at the saved batch (15).",
        one_device_case="fit(epochs=5) of 3 batches an epoch, interrupted after 2 steps and resumed with the same "
                        "BackupAndRestore(save_freq=1): Keras trains 17 steps, batches 0 and 1 of epoch 0 twice.",
        tfdist_test="tests/test_keras_callbacks.py::test_without_the_fix_keras_replays_the_batches_a_mid_epoch_backup_"
                    "had_trained (and test_backup_and_restore_resumes_where_the_backup_was_taken[one-device])"),
}
