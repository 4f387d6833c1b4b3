"""The hang watchdog: a collective one worker never joins, a worker spinning in one call or a frozen one stops
the job with exit code 86, naming it; a slow first step or a worker that exits first does not."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.jobs import WORKERS, job_env, run_job
from tfdist import cluster, run, watchdog
from tfdist.launch import local, supervisor
from tfdist.launch.local import free_ports

EXIT_HANG = 86
SLOW = 300  # test timeouts: generous for a loaded 2-core machine
# The hang timeout of the jobs that must stop: what the frozen-worker cases need (below TensorFlow's own 11.4 s).
# A first call (tracing the train step on both workers at once) measured 0.5 s on 2 cores at load 3: 10x margin.
HANG_S = 5


def test_exit_code_is_the_documented_one():
    assert watchdog.EXIT_HANG == cluster.EXIT_HANG == EXIT_HANG


@pytest.mark.parametrize("raw, seconds", [(None, 600.0), ("", 600.0), ("0", 0.0), ("20", 20.0), ("2.5", 2.5)])
def test_timeout_from_the_environment(raw, seconds):
    assert watchdog.timeout_from_env({} if raw is None else {"TFDIST_HANG_TIMEOUT": raw}) == seconds


@pytest.mark.parametrize("raw", ["-1", "ten", "inf", "nan"])
def test_a_bad_timeout_is_an_error_naming_it(raw):
    with pytest.raises(ValueError, match=rf"TFDIST_HANG_TIMEOUT='{raw}' is not a number of seconds: set it to e.g. "
                                         r"600 \(the default\), or 0 to turn the hang watchdog off"):
        watchdog.timeout_from_env({"TFDIST_HANG_TIMEOUT": raw})


def test_zero_or_one_worker_starts_no_watchdog():
    assert watchdog.start(0, 2, timeout=0) is False and watchdog.start(0, 1, timeout=600) is False
    assert not any(t.name.startswith("tfdist-hang-watchdog") for t in threading.enumerate())


def test_launcher_flag_reaches_every_worker_and_every_host():
    args = run.build_parser().parse_args(["-n", "2", "--hang-timeout", "20", "--", "python"])
    assert "--hang-timeout 20.0" in " ".join(run._node_args(args))  # -H: each host's launcher gets it
    settings = supervisor.WorkerSettings(hang_timeout=20.0)
    env = local.worker_env(["127.0.0.1:1", "127.0.0.1:2"], 1, settings, 0, "/tmp", base_env={})
    assert env["TFDIST_HANG_TIMEOUT"] == "20"
    assert "TFDIST_HANG_TIMEOUT" not in local.worker_env(["127.0.0.1:1"], 0, supervisor.WorkerSettings(), 0, "/tmp",
                                                         base_env={})


@pytest.mark.parametrize("value", ["-1", "nan", "1e9"])
def test_a_hang_timeout_out_of_range_is_refused_by_the_launcher(value):
    result = subprocess.run([sys.executable, "-m", "tfdist.run", "-n", "2", "--hang-timeout", value, "--", "python"],
                            env=job_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"--hang-timeout must be 0 (off) or positive seconds up to 1e+08: received {float(value)}." in result.stderr
    assert "Traceback" not in result.stderr


def test_an_extra_allreduce_on_one_worker_stops_the_job_under_tfdist_run(tmp_path):
    """After its second step worker 1 makes an eager tfdist.allreduce that worker 0 never makes."""
    result = run_job("hang_job.py", tmp_path, "extra_allreduce", timeout=SLOW,
                     launcher_args=("--hang-timeout", str(HANG_S)))
    ended = time.time()
    out = result.output
    assert result.returncode == EXIT_HANG, out[-6000:]
    assert ended - json.loads((tmp_path / "hang1.json").read_text())["at"] < HANG_S + 30
    assert "has been in" in out and f"(hang timeout {HANG_S} s)" in out
    # both wait (each in its own collective), so either may report first
    assert re.search(r": reached by worker\(s\) \[(1|0)\]; not by worker\(s\) \[(?!\1)[01]\]", out)
    assert re.search(r"worker 1 \(pid \d+\): in eager tfdist\.allreduce #\d+ \(group of ranks \[0, 1\]\)", out)
    # worker 0 went past the two steps worker 1 made and waits in its third
    assert re.search(r"worker 0 \(pid \d+\): in call 3 of tf\.function '\w+'", out)
    # The flight recorder: each worker's last calls, so the mismatch shows (worker 1's last is the allreduce).
    assert "Each worker's last 8 calls (tf.functions and eager collectives), oldest first:" in out
    assert re.search(r"worker 0: .*call 2 of tf\.function '\w+' \([\d.e-]+ s\); call 3 of tf\.function '\w+' "
                     r"\([\d.e-]+ s, still in it\)", out)
    assert re.search(r"worker 1: .*call 2 of tf\.function '\w+' \([\d.e-]+ s\); eager tfdist\.allreduce #\d+ "
                     r"\(group of ranks \[0, 1\]\) \([\d.e-]+ s, still in it\)", out)
    for rank in (0, 1):
        assert f"[{rank}] Python stacks of worker {rank}" in out
    assert re.search(r"\[1\] +File .*hang_job\.py\", line \d+, in on_train_batch_end", out)
    assert "worker 0 exited with code 86 (tfdist's hang watchdog" in out or \
           "worker 1 exited with code 86 (tfdist's hang watchdog" in out
    assert "exit codes [86, 86]" in out
    assert all(r["watchdogs"] == ["tfdist-hang-watchdog"] for r in result.results.values())  # one thread each


def test_a_worker_that_never_arrives_stops_workers_started_by_hand(tmp_path):
    """No launcher: each worker has its own TF_CONFIG and TFDIST_HANG_TIMEOUT (HANG_S); worker 1 sleeps before
    training. Worker 0's watchdog reports it; worker 1's own watchdog stops it too."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    workers = []
    for rank in (0, 1):
        env = job_env({"TF_CONFIG": cluster.make_tf_config(addresses, rank), "TFDIST_HANG_TIMEOUT": str(HANG_S)})
        workers.append(subprocess.Popen([sys.executable, str(WORKERS / "hang_job.py"), str(tmp_path), "sleep"],
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [w.communicate(timeout=SLOW)[0] for w in workers]
    finally:
        for w in workers:
            w.kill()
    ended = time.time()
    assert [w.returncode for w in workers] == [EXIT_HANG, EXIT_HANG], outputs[0][-4000:] + outputs[1][-4000:]
    assert ended - json.loads((tmp_path / "hang1.json").read_text())["at"] < HANG_S + 40
    assert ": reached by worker(s) [0]; not by worker(s) [1]" in outputs[0]
    # fit's first collective: the workers' agreement on steps_per_execution "auto" (an allreduce), autotune's
    # agreement with worker 0 as it builds the train function (a broadcast), Keras' eager strategy reduce, or the
    # first train step
    assert re.search(r"worker 0 \(pid \d+\): in (eager tfdist\.allreduce #1|eager tfdist\.broadcast #1|"
                     r"eager MultiWorkerMirroredStrategy reduce #1|"
                     r"call 1 of tf\.function)", outputs[0])
    assert re.search(r"worker 1 \(pid \d+\): in no call for \d+ s", outputs[0])
    assert "tfdist hang watchdog: stopping worker 1: worker 0 reported a hang" in outputs[1]
    assert re.search(r"File .*hang_job\.py\", line \d+, in <module>\n\s+time\.sleep\(3600\)", outputs[1])


def kill_leftover(out_dir, rank: int) -> None:
    """SIGKILLs worker ``rank`` of the job writing to ``out_dir`` if it still runs (a frozen one may outlive it)."""
    try:
        pid = json.loads((out_dir / f"worker{rank}.json").read_text())["pid"]
        if str(out_dir) in pathlib.Path(f"/proc/{pid}/cmdline").read_text():
            os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError, KeyError):
        pass  # it never started, or it is gone


@pytest.mark.parametrize("rank, how, timeout", [(1, "sigstop", 5), (0, "sigstop", 3), (1, "gil", 5)],
                         ids=["worker-1-sigstopped", "worker-0-with-the-store-sigstopped", "worker-1-holding-the-gil"])
def test_a_frozen_worker_is_named_silent_and_the_job_stops(tmp_path, rank, how, timeout):
    """Worker ``rank`` freezes while busy in a call: its last state says busy, but no heartbeat follows.

    TensorFlow's own heartbeats fail the job about 11.4 s after a SIGSTOP of worker 1 (exit 1, "stopped sending
    heartbeats"), and never while only Python's lock is held; a hang timeout of 5 s reports it first (about 7 s).
    A frozen worker 0 holds the coordination service: worker 1's next heartbeat to it (every 5 s) fails 5 s after it
    left, then 1 s later the job (TensorFlow's coordination_service_agent.cc), so as soon as 6 s after the freeze
    (seen once, a loaded suite run: the watchdog's 5 s lost). A hang timeout of 3 s reports it by 5 s."""
    try:
        result = run_job("hang_job.py", tmp_path, "freeze", str(rank), how, timeout=60,
                         launcher_args=("--hang-timeout", str(timeout)))
    finally:
        kill_leftover(tmp_path, rank)
    ended = time.time()
    out = result.output
    assert result.returncode == EXIT_HANG, out[-6000:]
    assert "stopped sending heartbeats" not in out
    assert ended - json.loads((tmp_path / f"hang{rank}.json").read_text())["at"] < 11  # before TensorFlow's
    assert re.search(rf"worker\(s\) \[{rank}\] sent no heartbeat for {timeout} s or more \(hang timeout {timeout} s\)",
                     out)
    assert re.search(rf"worker {rank} \(pid \d+\): silent for [{timeout}-{timeout + 4}] s; its last heartbeat said: in "
                     r"call 1 of tf\.function 'spin' for [0-3] s, CPU busy", out)
    assert re.search(rf"worker {1 - rank} \(pid \d+\): in call 3 of tf\.function '\w+' for \d+ s", out)


def test_a_worker_spinning_in_one_call_past_the_timeout_is_named(tmp_path):
    """Worker 1 keeps publishing heartbeats but stays busy inside one tf.function call."""
    result = run_job("hang_job.py", tmp_path, "spin", timeout=60, launcher_args=("--hang-timeout", str(HANG_S)))
    ended = time.time()
    out = result.output
    assert result.returncode == EXIT_HANG, out[-6000:]
    assert ended - json.loads((tmp_path / "hang1.json").read_text())["at"] < HANG_S + 15
    # reported once a call has lasted the timeout, within a few wake-ups (1 s apart): 5 to 9 s
    assert re.search(r"worker 1 \(pid \d+\): in call 1 of tf\.function 'spin' for [5-9] s, CPU busy", out)
    assert re.search(rf"worker [01] has been in call \d+ of tf\.function '\w+' for [5-9] s \(hang timeout {HANG_S} s\)",
                     out)
    assert "sent no heartbeat" not in out


@pytest.mark.parametrize("first", [1, 0], ids=["worker-1-exits-first", "worker-0-and-its-store-exit-first"])
def test_a_slow_start_and_a_worker_that_exits_first_are_not_hangs(tmp_path, first):
    """Worker 0 waits in its first step longer than the timeout while worker 1 computes, then traces (for less
    than the timeout); after fit worker ``first`` exits and the other stays longer than the timeout."""
    result = run_job("hang_job.py", tmp_path, "slow_start", str(first), timeout=120,
                     launcher_args=("--hang-timeout", "10"))
    result.check()
    assert "hang watchdog" not in result.output
    assert result.results[0]["first_call_s"] >= 10  # the wait the watchdog must have forgiven
    assert "[0] finished" in result.output and "[1] finished" in result.output
