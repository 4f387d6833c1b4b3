"""Preemption: a stop signal (to the launcher, one worker, every process, one node) or one worker's
callback stops every worker after the same step; a preempted job saves through Keras' own
BackupAndRestore, exits 85, and the same command resumes exactly there (tests/workers/preempt_job.py)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.jobs import WORKERS, job_env, run_job
from tests.nodes_jobs import node_command, run_nodes
from tests.workers import common
from tfdist import cluster
from tfdist.launch import local

EPOCHS, STEPS = 3, 8
ALL_STEPS = [[e, b] for e in range(EPOCHS) for b in range(STEPS)]
GRACE = ("--grace-period", "25")
# For a stop that must fail or run the grace period out: 6 s gives the agreed stop 3 s to hear from every worker
# (the grace period less tfdist.preemption's 3 s margin), well before TensorFlow's heartbeats fail a frozen peer (11 s).
SHORT_GRACE_S = "6"
SHORT_GRACE = ("--grace-period", SHORT_GRACE_S, "--hang-timeout", "0")


@pytest.fixture(scope="module")
def uninterrupted():
    """Weights and optimizer iterations of the job never interrupted (one process, the same global batch)."""
    model = common.resumable_model()
    x, y = common.regression_data(common.GLOBAL_BATCH * STEPS)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH), epochs=EPOCHS, verbose=0)
    return model.get_weights(), int(model.optimizer.iterations.numpy())


def steps_by_run(out_dir, rank):
    """The (epoch, batch) steps worker ``rank`` trained, one list per process it ran in, oldest first."""
    paths = sorted(out_dir.glob(f"steps{rank}-*.json"), key=os.path.getmtime)
    return [json.loads(p.read_text()) for p in paths]


def assert_resumed_exactly(out_dir, results, uninterrupted):
    weights, iterations = uninterrupted
    for rank in (0, 1):
        runs = steps_by_run(out_dir, rank)
        assert len(runs) == 2 and runs[0][-1][0] == 1, runs  # stopped mid-epoch 1
        assert runs[0] + runs[1] == ALL_STEPS  # no step lost, none repeated
        assert results[rank]["iterations"] == iterations
        for got, want in zip(results[rank]["weights"], weights):
            np.testing.assert_allclose(got, want, atol=1e-5)
    assert not (out_dir / "backup").exists()  # deleted once training ended


@pytest.mark.parametrize("mode", ["launcher", "all"])
def test_sigterm_saves_every_worker_at_one_step_exits_85_and_the_same_command_resumes_there(
        tmp_path, uninterrupted, mode):
    first = run_job("preempt_job.py", tmp_path, mode, timeout=240, launcher_args=GRACE)
    stopped_at = time.time()
    assert first.returncode == cluster.EXIT_PREEMPTED, first.output[-4000:]
    assert stopped_at - (tmp_path / "signalled").stat().st_mtime < 30
    assert "every worker stopped after step" in first.output and "saved to" in first.output
    assert "every worker saved at the step they agreed on" in first.output
    metadata = json.loads((tmp_path / "backup" / "training_metadata.json").read_text())
    assert metadata["epoch"] == 1 and 0 < metadata["steps_done_in_epoch"] < STEPS
    second = run_job("preempt_job.py", tmp_path, mode, timeout=240, launcher_args=GRACE).check()
    assert_resumed_exactly(tmp_path, second.results, uninterrupted)


def test_sigterm_to_one_worker_under_max_restarts_resumes_in_the_same_command(tmp_path, uninterrupted):
    """With a timeline: the preempted attempt's file (its steps, the agreed stop) is kept beside the resumed one's
    (the exit skipped the last publication, and the restart overwrote the file)."""
    result = run_job("preempt_job.py", tmp_path, "worker", timeout=300,
                     launcher_args=(*GRACE, "--max-restarts", "1", "--timeline", str(tmp_path / "trace.json"))).check()
    assert "exited with code 85 (preempted" in result.output and "restarting all workers (1/1)" in result.output
    assert "SIGTERM to worker 1" in result.output
    assert_resumed_exactly(tmp_path, result.results, uninterrupted)
    for name, attempt in (("trace.attempt0.json", 0), ("trace.json", 1)):
        events = json.loads((tmp_path / name).read_text())["traceEvents"]
        steps = [[e for e in events if e["ph"] == "X" and e["pid"] == pid and e["name"].startswith("step ")]
                 for pid in (0, 1)]
        assert len(steps[0]) == len(steps[1]) == len(steps_by_run(tmp_path, 0)[attempt]), name
        instants = [e["name"] for e in events if e["ph"] == "i" and e["pid"] == 0]
        assert f"attempt {attempt}: 2 workers" in instants
        assert any(n.startswith("agreed stop after step") for n in instants) == (attempt == 0), instants


def test_a_callback_stopping_one_worker_mid_epoch_stops_every_worker_after_the_same_step(tmp_path):
    result = run_job("preempt_job.py", tmp_path, "callback", timeout=240).check()
    runs = [steps_by_run(tmp_path, rank) for rank in (0, 1)]
    assert len(runs[0]) == len(runs[1]) == 1 and runs[0] == runs[1], runs
    assert runs[0][0][-1][0] == 1 and runs[0][0][-1][1] < STEPS - 1  # stopped mid-epoch 1, after batch 2
    assert result.results[0]["weights"] == result.results[1]["weights"]
    assert result.results[0]["iterations"] == result.results[1]["iterations"] == len(runs[0][0])


def test_sigterm_to_one_nodes_launcher_saves_both_nodes_at_one_step(tmp_path, uninterrupted):
    def both_nodes():
        master = f"127.0.0.1:{local.free_ports(1)[0]}"
        worker = [sys.executable, str(WORKERS / "preempt_job.py"), str(tmp_path), "launcher"]
        return run_nodes([node_command(rank, 2, master, worker, *GRACE, timeout=240) for rank in (0, 1)],
                         timeout=300)

    first = both_nodes()
    assert [r.returncode for r in first] == [cluster.EXIT_PREEMPTED] * 2, [r.output[-3000:] for r in first]
    second = both_nodes()
    assert [r.returncode for r in second] == [0, 0], [r.output[-3000:] for r in second]
    results = {rank: json.loads((tmp_path / f"worker{rank}.json").read_text()) for rank in (0, 1)}
    assert_resumed_exactly(tmp_path, results, uninterrupted)


def test_a_custom_loop_with_should_stop_saves_at_the_agreed_step_and_resumes_there(tmp_path):
    result = run_job("custom_loop_job.py", tmp_path, timeout=300, launcher_args=(*GRACE, "--max-restarts", "1")).check()
    assert "restarting all workers (1/1)" in result.output
    start = result.results[0]["start"]
    for rank in (0, 1):
        runs = steps_by_run(tmp_path, rank)
        assert len(runs) == 2 and runs[0] == list(range(start)) and runs[1] == list(range(start, 24)), runs
        assert result.results[rank]["start"] == start > 10
    model = common.equivalence_model()
    x, y = common.regression_data(common.GLOBAL_BATCH * 24)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH), epochs=1, verbose=0)
    for rank in (0, 1):
        for got, want in zip(result.results[rank]["weights"], model.get_weights()):
            np.testing.assert_allclose(got, want, atol=1e-5)


def test_stop_signals_come_from_the_environment_and_a_bad_name_is_a_clear_error():
    from tfdist import stop_signals

    assert stop_signals.signals_from_env({}) == (signal.SIGTERM, signal.SIGUSR1)
    assert stop_signals.signals_from_env({"TFDIST_STOP_SIGNALS": "usr2, SIGTERM"}) == (signal.SIGUSR2, signal.SIGTERM)
    assert stop_signals.signals_from_env({"TFDIST_STOP_SIGNALS": ""}) == ()
    with pytest.raises(ValueError, match=r"TFDIST_STOP_SIGNALS='SIGTERM,FOO': SIGFOO is not a signal .* SIGTERM,SIGUSR1"):
        stop_signals.signals_from_env({"TFDIST_STOP_SIGNALS": "SIGTERM,FOO"})
    with pytest.raises(ValueError, match="SIGKILL is not a signal a process can catch"):
        stop_signals.signals_from_env({"TFDIST_STOP_SIGNALS": "KILL"})


# Edges of the control plane (issue 40) -----------------------------------------------------------

def test_sigterm_to_the_launcher_with_a_multiprocessing_pydataset_saves_and_resumes_exactly(tmp_path):
    """The pool's forked children take no part in the stop (a SIGTERM ends them: the default action; they
    inherited their worker's handler, and wrote stale requests under its rank), and the launcher's SIGTERM
    goes to the worker alone, so the children it is waiting for keep making its batches until the agreed
    step; the worker saves and resumes exactly."""
    reference = run_job("preempt_job.py", tmp_path / "reference", "pydataset-none", timeout=240).check()
    first = run_job("preempt_job.py", tmp_path, "pydataset", timeout=120, launcher_args=GRACE)
    assert first.returncode == cluster.EXIT_PREEMPTED, first.output[-4000:]
    assert "every worker saved at the step they agreed on" in first.output
    second = run_job("preempt_job.py", tmp_path, "pydataset", timeout=240, launcher_args=GRACE).check()
    for rank in (0, 1):
        runs = steps_by_run(tmp_path, rank)
        assert len(runs) == 2 and runs[0] + runs[1] == ALL_STEPS, runs
        assert second.results[rank]["iterations"] == reference.results[rank]["iterations"] == len(ALL_STEPS)
        np.testing.assert_array_equal(np.concatenate([np.ravel(w) for w in second.results[rank]["weights"]]),
                                      np.concatenate([np.ravel(w) for w in reference.results[rank]["weights"]]))


def test_fits_in_a_row_a_local_fit_and_a_fit_inside_a_fit_each_keep_their_own_stops(tmp_path):
    result = run_job("stop_edges_job.py", tmp_path, "sequence", timeout=240,
                     env={"KUBERNETES_SERVICE_HOST": "10.0.0.1"}).check()
    first, second = result.results[0], result.results[1]
    # A stop asked in the last step of a fit does not leak into the next one.
    assert first["steps"][:2] == second["steps"][:2] == [6, 20]
    assert first["iterations"] == second["iterations"] == 26
    assert first["weights"] == second["weights"]
    # Worker 0's local fit takes no session number; a fit inside a fit's callback does not end the outer
    # session: worker 1's later stop stops both after the same step, mid-epoch 1.
    assert first["steps"][2] == second["steps"][2] and 8 < first["steps"][2] < 16
    assert first["nested_weights"] == second["nested_weights"]
    # Where a scheduler may preempt (here Kubernetes), worker 0 says once that nothing would be saved.
    assert result.output.count("tfdist: fit has no keras.callbacks.BackupAndRestore") == 1
    assert "[0] tfdist: fit has no keras.callbacks.BackupAndRestore" in result.output


def test_a_signal_after_a_workers_report_still_makes_every_worker_agree_on_a_preemption(tmp_path):
    result = run_job("stop_edges_job.py", tmp_path, "disagree", timeout=240, launcher_args=GRACE)
    assert result.returncode == cluster.EXIT_PREEMPTED, result.output[-4000:]
    assert "preempted (SIGTERM to worker 0): every worker stopped after step 3" in result.output
    assert "exit codes [85, 85]" in result.output and "the job was preempted and saved" in result.output
    assert not result.results  # no worker returned from fit as if nothing happened
    assert json.loads((tmp_path / "backup" / "training_metadata.json").read_text())["steps_done_in_epoch"] == 3


def test_local_fits_and_a_fit_inside_a_fit_do_not_disturb_a_preemption(tmp_path):
    result = run_job("stop_edges_job.py", tmp_path, "probes", timeout=240, launcher_args=GRACE)
    assert result.returncode == cluster.EXIT_PREEMPTED, result.output[-4000:]
    assert "exit codes [85, 85]" in result.output
    metadata = json.loads((tmp_path / "backup" / "training_metadata.json").read_text())
    assert metadata["epoch"] == 1 and 2 < metadata["steps_done_in_epoch"] < 8


def test_a_signal_during_the_last_validation_saves_and_the_same_command_goes_on_after_that_fit(tmp_path):
    first = run_job("stop_edges_job.py", tmp_path, "last-validation", timeout=240, launcher_args=GRACE)
    assert first.returncode == cluster.EXIT_PREEMPTED, first.output[-4000:]
    assert "exit codes [85, 85]" in first.output and "every worker saved at the step they agreed on" in first.output
    assert json.loads((tmp_path / "backup1" / "training_metadata.json").read_text())["epoch"] == 2  # both done
    second = run_job("stop_edges_job.py", tmp_path, "last-validation", timeout=240, launcher_args=GRACE).check()
    for rank in (0, 1):
        assert second.results[rank]["iterations"] == [16, 20]  # fit 1 was done: restored, not trained again


@pytest.mark.parametrize("mode", ["loop", "elastic"])
def test_a_sigterm_after_a_custom_loop_or_hvd_elastic_run_takes_its_default_action(tmp_path, mode):
    began = time.monotonic()
    result = run_job("stop_edges_job.py", tmp_path, mode, timeout=120, launcher_args=GRACE)
    assert (tmp_path / "signalled").exists(), result.output[-3000:]
    assert result.returncode == 128 + signal.SIGTERM, result.output[-3000:]
    assert "worker 1 was killed by SIGTERM" in result.output
    assert "[1] tfdist: worker 1: SIGTERM takes its default action: no training runs" in result.output
    assert time.monotonic() - began < 45  # not the 60 s of post-loop work


@pytest.mark.parametrize("mode", ["unanswered", "unanswered-elastic"])
def test_a_peer_that_never_answers_fails_the_stop_inside_the_grace_period_saying_so(tmp_path, mode):
    result = run_job("stop_edges_job.py", tmp_path, mode, timeout=120, launcher_args=SHORT_GRACE)
    ended = time.time()
    assert result.returncode == 1, result.output[-3000:]
    assert "but worker 1 did not answer in time (it may have died, or be stuck in a step)" in result.output, \
        result.output[-3000:]
    assert ended - (tmp_path / "signalled").stat().st_mtime < 20  # the grace period, not TensorFlow's heartbeat


def test_a_signal_while_waiting_inside_tensorflow_takes_its_default_action_after_the_grace_period(tmp_path):
    """Python runs signal handlers between bytecodes only: the stop thread notes the signal at once instead."""
    result = run_job("stop_edges_job.py", tmp_path, "blocked", timeout=120, launcher_args=SHORT_GRACE)
    ended = time.time()
    assert result.returncode == 128 + signal.SIGTERM, result.output[-3000:]
    assert ("[0] tfdist: worker 0: SIGTERM takes its default action: no agreed step honoured it within the grace "
            "period (6 s)") in result.output
    assert ended - (tmp_path / "signalled").stat().st_mtime < 25  # not the 40 s worker 1 sleeps


def test_a_stop_signal_after_the_process_chose_its_exit_code_does_not_replace_it():
    """The hang watchdog decided on EXIT_HANG; the launcher, seeing a peer leave, sends SIGTERM while this worker
    waits for its peers to leave too: the job read "killed by SIGTERM" for a worker its watchdog had stopped."""
    script = textwrap.dedent("""
        import os, signal, sys, time
        from tfdist import stop_signals
        watcher = stop_signals.Watcher((signal.SIGTERM,), stop_signals.default_action)  # as with no fit running
        watcher.start()
        stop_signals.exiting()
        os.kill(os.getpid(), signal.SIGTERM)
        watcher.wait(0.5)
        time.sleep(0.2)  # the handler's turn, in the main thread
        stop_signals.default_action(signal.SIGTERM)  # a grace period that ran out meanwhile
        sys.exit(86)
    """)
    result = subprocess.run([sys.executable, "-c", script], env=job_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 86, result.stderr[-2000:]


def test_a_store_that_fails_at_once_is_read_with_pauses_until_the_deadline(monkeypatch):
    from tfdist import kvstore

    calls = []

    class Gone:
        def get_config_key_value(self, key, timeout_ms):
            calls.append(key)
            raise RuntimeError("UNAVAILABLE: the coordination service is gone")

    monkeypatch.setattr(kvstore, "_context", lambda: Gone())
    began = time.monotonic()
    assert kvstore.wait_for("tfdist/stop/1/report/1", began + 2.0) is None
    assert 1.9 < time.monotonic() - began < 3.0
    assert len(calls) <= 8, len(calls)  # 0.05, 0.1, 0.2, 0.4, 0.8, 1 s pauses: not a busy loop


def test_a_key_set_before_the_deadline_is_found_after_it_though_the_store_answers_slowly(monkeypatch):
    """Callers read each peer's key in turn with one deadline (the agreed stop, a checkpoint's commit, the data's
    file lists, the straggler report): once a late peer used it up, the next peer's key, there all along, got one
    1 ms read. Worker 1 reading worker 0's store beside two busy loops missed 17 of 300 such reads (5 ms: none)."""
    from tfdist import kvstore

    from tests.slow_store import SlowStore

    monkeypatch.setattr(kvstore, "_context", lambda: SlowStore({"tfdist/stop/1/report/2": "{}"}))
    began = time.monotonic()
    deadline = began + 0.3
    assert kvstore.wait_for("tfdist/stop/1/report/1", deadline) is None  # a peer that never answers: the deadline
    assert kvstore.wait_for("tfdist/stop/1/report/2", deadline) == "{}"  # one that did
    assert kvstore.wait_for("tfdist/stop/1/report/3", deadline) is None  # past the deadline: one short read
    assert time.monotonic() - began < 0.3 + 0.3 + 0.2, time.monotonic() - began


def test_the_grace_period_comes_from_the_environment_and_a_bad_one_is_a_clear_error():
    from tfdist import stop_signals

    assert stop_signals.grace_from_env({}) == 25.0
    assert stop_signals.grace_from_env({"TFDIST_GRACE_PERIOD": "7.5"}) == 7.5
    with pytest.raises(ValueError, match=r"TFDIST_GRACE_PERIOD='soon' is not a number of seconds: .* --grace-period"):
        stop_signals.grace_from_env({"TFDIST_GRACE_PERIOD": "soon"})


def test_an_evaluate_before_training_does_not_take_the_mid_epoch_resume_and_the_next_fit_starts_at_0(tmp_path):
    """One device. The resume position belongs to the fit's first training epoch (an evaluate in a callback's
    on_train_begin took it, and the epoch restarted at 0); Keras kept the restored epoch for every later fit."""
    import keras

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch) == (1, 3):
                raise RuntimeError("cut")

    class EvaluateFirst(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.model.evaluate(data, verbose=0)

    x, y = common.regression_data(common.GLOBAL_BATCH * STEPS)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH)
    model = common.resumable_model()
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=1)
    with pytest.raises(RuntimeError, match="cut"):
        model.fit(data, epochs=EPOCHS, verbose=0, callbacks=[backup, Crash()])
    model = common.resumable_model()
    model.fit(data, epochs=EPOCHS, verbose=0, callbacks=[backup, EvaluateFirst()])
    assert int(model.optimizer.iterations.numpy()) == EPOCHS * STEPS
    model.fit(data, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == (EPOCHS + 1) * STEPS


def test_a_process_forked_while_the_stop_thread_holds_the_planes_lock_can_still_train():
    from tfdist import preemption

    with preemption._plane.lock:
        pid = os.fork()
        if pid == 0:  # the child: a fit's session opens and closes
            try:
                preemption.end_fit(preemption.begin_fit(of_the_job=False))
            finally:
                os._exit(0)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung on the plane's lock")


def one_process(tmp_path, *args):
    return subprocess.run([sys.executable, str(WORKERS / "one_process_stops_job.py"), str(tmp_path), *args],
                          env=job_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("k", [1, 4])
def test_a_stop_at_the_last_call_of_an_epoch_of_unknown_length_resumes(tmp_path, k):
    """Keras does not know the epoch's length: the backup says mid-epoch with every step done (with K > 1, more);
    the rerun skipped past the data's end and crashed ("generator raised StopIteration") on every rerun."""
    first = one_process(tmp_path, "unknown-length", str(k))
    assert first.returncode == cluster.EXIT_PREEMPTED, first.stderr[-3000:]
    second = one_process(tmp_path, "unknown-length", str(k))
    assert second.returncode == 0 and "returned" in second.stdout, second.stderr[-3000:]
    trained = [int(line.split()[1]) for line in (first.stdout + second.stdout).splitlines() if line.startswith("batches")]
    assert trained[0] >= 10 and trained[1] == 10 + (-10 % k)  # the second epoch, whole (K rounds a last call up)


def test_a_second_signal_during_the_preemptions_save_still_exits_85_saved(tmp_path):
    result = one_process(tmp_path, "second-signal")
    assert result.returncode == cluster.EXIT_PREEMPTED, result.stderr[-3000:]
    assert "saved to" in result.stderr and "default action" not in result.stderr


def test_a_preemption_names_what_a_checkpoint_manager_saved_not_nothing(tmp_path):
    """No BackupAndRestore, but a CheckpointManager saving at every epoch end: the message said "nothing was saved
    (no keras.callbacks.BackupAndRestore in fit's callbacks): the steps this run trained are lost" either way. (The
    save at the stop, async, must also commit before the exit: it did not in one process.)"""
    at_stop = one_process(tmp_path / "at-stop", "manager-at-stop")
    assert at_stop.returncode == cluster.EXIT_PREEMPTED, at_stop.stderr[-3000:]
    checkpoint = tmp_path / "at-stop" / "ckpt" / "step-10"
    assert (f"every worker stopped after step 10 and tfdist.CheckpointManager saved it to {checkpoint}; "
            "run the same command to resume there") in at_stop.stderr
    assert "nothing was saved" not in at_stop.stderr
    assert (checkpoint / "manifest.json").exists()  # committed before the process exited
    before = one_process(tmp_path / "before", "manager-before")
    assert before.returncode == cluster.EXIT_PREEMPTED, before.stderr[-3000:]
    assert (f"every worker stopped after step 15; nothing was saved at that step (no keras.callbacks.BackupAndRestore "
            f"in fit's callbacks): the 5 steps since tfdist.CheckpointManager saved step 10 to "
            f"{tmp_path / 'before' / 'ckpt' / 'step-10'} are lost") in before.stderr


def test_a_custom_loop_driving_a_callback_list_of_an_uncompiled_model(tmp_path):
    """The agreed stop's batch end read model.stop_training, which only compile creates: AttributeError."""
    result = one_process(tmp_path, "callback-list")
    assert result.returncode == 0 and "returned" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("mode", ["thread", "slow-epoch-end"])
def test_a_callbacks_stop_on_one_worker_is_agreed_from_a_thread_and_after_a_long_epoch_end(tmp_path, mode):
    """thread: the plane started only in the main thread (Ray Train trains in another): worker 1 stopped alone and
    worker 0 failed in the next collective. slow-epoch-end: the end verdict waited on the round's passed deadline
    and fit raised 'worker 0 did not answer in time' on both."""
    result = run_job("plane_edges_job.py", tmp_path, mode, timeout=180).check()
    assert result.results[0]["steps"] == result.results[1]["steps"] == 4  # the step after the one that asked


def test_a_frozen_store_holder_does_not_hang_the_job(tmp_path):
    """Worker 0 (the store) frozen, a SIGTERM to worker 1: every store write blocked for ever (no grace period,
    no hang timeout acted; the job ran until --timeout). Now the job ends well inside it, naming the failure."""
    began = time.monotonic()
    result = run_job("plane_edges_job.py", tmp_path, "frozen", timeout=150,
                     launcher_args=("--grace-period", SHORT_GRACE_S, "--hang-timeout", "20"))
    assert result.returncode not in (0, 124) and time.monotonic() - began < 100, result.output[-3000:]
    assert "ran past --timeout" not in result.output


def test_a_store_write_that_does_not_return_is_given_up_and_writes_go_on_once_it_does(monkeypatch):
    """A frozen store held every writer for ever; a store that was only slow once must not silence the process
    for good (its heartbeats stopping would make the peers' watchdogs name it silent)."""
    import threading

    from tfdist import kvstore

    release, written = threading.Event(), []

    class Store:
        def delete_config_key_value(self, key):
            pass

        def set_config_key_value(self, key, value):
            if value == "slow":
                release.wait(30)
            written.append(value)

    monkeypatch.setattr(kvstore, "_context", lambda: Store())
    monkeypatch.setattr(kvstore, "WRITE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(kvstore, "_stuck", None)
    began = time.monotonic()
    kvstore.put("key", "slow")
    assert time.monotonic() - began < 5
    kvstore.put("key", "while it waits")
    release.set()
    while written != ["slow"] and time.monotonic() - began < 20:
        time.sleep(0.01)
    kvstore.put("key", "after")
    assert written == ["slow", "after"]
