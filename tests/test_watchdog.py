"""The hang watchdog: a collective that one worker never joins stops the job, naming it, with exit code 86."""

import json
import re
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
    """Worker 1 traces its first step for 20 s (busy: no report although worker 0 waits longer than the
    timeout), then makes an eager tfdist.allreduce that worker 0 never makes."""
    result = run_job("hang_job.py", tmp_path, "extra_allreduce", timeout=SLOW,
                     launcher_args=("--hang-timeout", "10"), env={"SLOW_TRACE_S": "20"})
    ended = time.time()
    out = result.output
    assert result.returncode == EXIT_HANG, out[-6000:]
    assert ended - json.loads((tmp_path / "hang1.json").read_text())["at"] < 10 + 30
    assert "has waited" in out and "(hang timeout 10 s)" in out
    # both wait (each in its own collective), so either may report first
    assert re.search(r"reached it: worker\(s\) \[(1|0)\]; not reached: worker\(s\) \[(?!\1)[01]\]", out)
    assert re.search(r"worker 1 \(pid \d+\): in eager tfdist\.allreduce #\d+ \(group of ranks \[0, 1\]\)", out)
    # worker 0 went past its slow first step (call 1) and waits in its third train step
    assert re.search(r"worker 0 \(pid \d+\): in call 3 of tf\.function '\w+'", out)
    for rank in (0, 1):
        assert f"[{rank}] Python stacks of worker {rank}" in out
    assert re.search(r"\[1\] +File .*hang_job\.py\", line \d+, in on_train_batch_end", out)
    assert "worker 0 exited with code 86 (tfdist's hang watchdog" in out or \
           "worker 1 exited with code 86 (tfdist's hang watchdog" in out
    assert "exit codes [86, 86]" in out
    assert all(r["watchdogs"] == ["tfdist-hang-watchdog"] for r in result.results.values())  # one thread each


def test_a_worker_that_never_arrives_stops_workers_started_by_hand(tmp_path):
    """No launcher: each worker has its own TF_CONFIG and TFDIST_HANG_TIMEOUT=10; worker 1 sleeps before
    training. Worker 0's watchdog reports it; worker 1's own watchdog stops it too."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    workers = []
    for rank in (0, 1):
        env = job_env({"TF_CONFIG": cluster.make_tf_config(addresses, rank), "TFDIST_HANG_TIMEOUT": "10"})
        workers.append(subprocess.Popen([sys.executable, str(WORKERS / "hang_job.py"), str(tmp_path), "sleep"],
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [w.communicate(timeout=SLOW)[0] for w in workers]
    finally:
        for w in workers:
            w.kill()
    ended = time.time()
    assert [w.returncode for w in workers] == [EXIT_HANG, EXIT_HANG], outputs[0][-4000:] + outputs[1][-4000:]
    assert ended - json.loads((tmp_path / "hang1.json").read_text())["at"] < 10 + 40
    assert "reached it: worker(s) [0]; not reached: worker(s) [1]" in outputs[0]
    # fit's first collective: autotune's agreement with worker 0 as it builds the train function (a broadcast),
    # Keras' eager strategy reduce, or the first train step
    assert re.search(r"worker 0 \(pid \d+\): in (eager tfdist\.broadcast #1|eager MultiWorkerMirroredStrategy reduce #1|"
                     r"call 1 of tf\.function)", outputs[0])
    assert re.search(r"worker 1 \(pid \d+\): in no collective for \d+ s", outputs[0])
    assert "tfdist hang watchdog: stopping worker 1: worker 0 reported a hang" in outputs[1]
    assert re.search(r"File .*hang_job\.py\", line \d+, in <module>\n\s+time\.sleep\(3600\)", outputs[1])
