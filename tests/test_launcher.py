"""`tfdist run`: starting, watching and stopping workers (toy workers, no TensorFlow)."""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.jobs import WORKERS, job_env
from tfdist.launch import local

LAUNCH_TIMEOUT = 60


def launch(tmp_path, mode, *launcher_args, num_workers=2, env=None):
    command = [sys.executable, "-m", "tfdist.run", "-n", str(num_workers), "--grace-period", "1",
               *launcher_args, "--", sys.executable, str(WORKERS / "toy_worker.py"), str(tmp_path), mode]
    return subprocess.run(command, env=job_env(env), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def all_gone(pids, within: float) -> bool:
    """Whether every process in ``pids`` has ended within ``within`` seconds."""
    deadline = time.monotonic() + within
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(alive(pid) for pid in pids)


def wait_for_pids(tmp_path, count, within=60):
    deadline = time.monotonic() + within
    while len(worker_pids(tmp_path)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(worker_pids(tmp_path)) == count, f"only {len(worker_pids(tmp_path))} of {count} workers started"
    return worker_pids(tmp_path)  # toy_worker.py sets its SIGTERM handler before it writes its pid


def worker_pids(tmp_path):
    return [int(p.read_text()) for p in tmp_path.glob("pid*")]


def test_workers_get_distinct_tf_configs_and_prefixed_output(tmp_path):
    result = launch(tmp_path, "echo", "--cpu-devices", "2")
    assert result.returncode == 0, result.stdout
    assert "[0] hello from 0" in result.stdout and "[1] hello from 1" in result.stdout
    envs = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in (0, 1)]
    configs = [json.loads(env["TF_CONFIG"]) for env in envs]
    assert configs[0]["cluster"] == configs[1]["cluster"]
    assert [c["task"]["index"] for c in configs] == [0, 1]
    addresses = configs[0]["cluster"]["worker"]
    assert len(set(addresses)) == 2 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert [env["TFDIST_WORKER_INDEX"] for env in envs] == ["0", "1"]
    assert all(env["TFDIST_NUM_WORKERS"] == "2" and env["TFDIST_CPU_DEVICES"] == "2" for env in envs)
    assert [env["TFDIST_GRACE_PERIOD"] for env in envs] == ["1", "1"]  # --grace-period, for tfdist.preemption


def test_failed_worker_stops_the_others_and_sets_the_exit_code(tmp_path):
    started = time.monotonic()
    result = launch(tmp_path, "fail1")
    assert result.returncode == 3
    assert time.monotonic() - started < 30
    assert "worker 1 exited with code 3; stopped all workers" in result.stdout
    assert not any(alive(pid) for pid in worker_pids(tmp_path))


def test_a_scripts_own_address_in_use_is_not_a_port_clash(tmp_path):
    """Two workers' own metrics servers on one fixed port: the second's "Address already in use" is the script's
    failure, not tfdist's (only a worker's TensorFlow server failing to bind its TF_CONFIG port is retried)."""
    port = local.free_ports(1)[0]
    result = launch(tmp_path, "metrics_port", "--max-restarts", "0", env={"TOY_METRICS_PORT": str(port)})
    assert "Address already in use" in result.stdout
    assert result.returncode == 1, result.stdout
    assert sorted((tmp_path / "starts").read_text().split()) == ["0", "1"], result.stdout  # each started once
    assert "exited with code 1; stopped all workers (2 worker(s)" in result.stdout
    assert "fresh ports" not in result.stdout


def test_worker_that_ignores_sigterm_is_killed(tmp_path):
    result = launch(tmp_path, "ignore_term", "--timeout", "3")
    assert result.returncode == 124
    assert "the job ran past --timeout; stopped all workers" in result.stdout
    assert not any(alive(pid) for pid in worker_pids(tmp_path))


def test_workers_that_never_join_are_stopped_after_the_start_timeout(tmp_path):
    started = time.monotonic()
    result = launch(tmp_path, "join_alone", "--start-timeout", "1")
    assert result.returncode == 124
    assert ("worker(s) [0, 1] did not join the cluster within --start-timeout 1s; worker(s) [1] never reached "
            "tfdist.scope()/init()") in result.stdout
    assert time.monotonic() - started < 20
    assert not any(alive(pid) for pid in worker_pids(tmp_path))


def test_interrupt_stops_every_worker(tmp_path):
    command = [sys.executable, "-m", "tfdist.run", "-n", "2", "--grace-period", "1", "--",
               sys.executable, str(WORKERS / "toy_worker.py"), str(tmp_path), "sleep"]
    launcher = subprocess.Popen(command, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while len(worker_pids(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        launcher.send_signal(signal.SIGINT)
        output, _ = launcher.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        launcher.kill()
    assert launcher.returncode == 130
    assert "interrupted; stopped all workers" in output
    assert not any(alive(pid) for pid in worker_pids(tmp_path))


@pytest.mark.parametrize("signals, exit_code", [
    (["SIGINT", "SIGINT"], 130), (["SIGTERM", "SIGTERM"], 143), (["SIGTERM", "SIGHUP"], 143), (["SIGKILL"], None),
])
def test_no_worker_outlives_its_launcher(tmp_path, signals, exit_code):
    """Workers that swallow SIGTERM (as TensorFlow's preemption handler can), a 60 s grace period: a second signal
    SIGKILLs them at once and the launcher waits for them; a launcher killed outright takes them with it."""
    command = [sys.executable, "-m", "tfdist.run", "-n", "2", "--grace-period", "60", "--",
               sys.executable, str(WORKERS / "toy_worker.py"), str(tmp_path), "ignore_term"]
    launcher = subprocess.Popen(command, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pids = wait_for_pids(tmp_path, 2)
        for i, name in enumerate(signals):
            if i:
                time.sleep(1)  # the launcher has taken the first signal
            launcher.send_signal(getattr(signal, name))
        started = time.monotonic()
        output, _ = launcher.communicate(timeout=LAUNCH_TIMEOUT)
        assert all_gone(pids, within=20), output
    finally:
        launcher.kill()
    if exit_code is not None:
        assert launcher.returncode == exit_code, output
        assert time.monotonic() - started < 20  # not the grace period
        assert "stopped all workers (2 worker(s), exit codes [SIGKILL, SIGKILL]" in output, output
        assert "Traceback" not in output


def test_sighup_stops_the_job_as_sigterm_does(tmp_path):
    command = [sys.executable, "-m", "tfdist.run", "-n", "2", "--grace-period", "1", "--",
               sys.executable, str(WORKERS / "toy_worker.py"), str(tmp_path), "sleep"]
    launcher = subprocess.Popen(command, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pids = wait_for_pids(tmp_path, 2)
        launcher.send_signal(signal.SIGHUP)
        output, _ = launcher.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        launcher.kill()
    assert launcher.returncode == 129
    assert "received SIGHUP; stopped all workers (2 worker(s), exit codes [SIGTERM, SIGTERM]" in output, output
    assert not any(alive(pid) for pid in pids)


def test_a_closed_reader_never_holds_up_the_job(tmp_path):
    """`tfdist run ... | head -c 100` ends by itself; a 200 MB line without a newline is relayed in pieces."""
    measure = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
               "print('launcher', code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)")
    worker = "import sys; piece = b'x' * (1 << 20); [sys.stdout.buffer.write(piece) for _ in range(200)]"
    launcher = subprocess.Popen([sys.executable, "-c", measure, sys.executable, "-m", "tfdist.run", "-n", "2", "--",
                                 sys.executable, "-c", worker],
                                env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        head = launcher.stdout.read(100)
        launcher.stdout.close()  # as `head -c 100` does
        _, errors = launcher.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        launcher.kill()
    errors = errors.decode()
    assert head.startswith(b"[0] xxxx") or head.startswith(b"[1] xxxx"), head
    _, code, max_rss_kib = errors.splitlines()[-1].split()
    assert code == "0", errors
    assert errors.count("the reader of this output went away (Broken pipe); dropping the rest of it") == 1, errors
    assert "Traceback" not in errors and "Exception ignored" not in errors, errors
    assert int(max_rss_kib) < 120 * 1024, errors  # the launcher (and each worker) stayed far below the line's 200 MB


def test_max_restarts_starts_every_worker_again(tmp_path):
    result = launch(tmp_path, "fail_first_attempt", "--max-restarts", "1")
    assert result.returncode == 0, result.stdout
    assert "worker 1 exited with code 5" in result.stdout and "restarting all workers (1/1)" in result.stdout
    assert sorted(p.name for p in tmp_path.glob("pid*")) == ["pid0.0", "pid0.1", "pid1.0", "pid1.1"]


@pytest.mark.parametrize("args, message", [
    (["-n", "0", "--", "python"], "-n must be at least 1: received -n 0"),
    (["-n", "2"], "no command to run: put it after --"),
    (["-n", "2", "--", "no-such-program-xyz"], "command 'no-such-program-xyz' was not found"),
    (["-n", "2", "--cpu-devices", "0", "--", "python"], "--cpu-devices must be at least 1: received 0"),
    (["-n", "2", "--timeout", "-1", "--", "python"], "--timeout must be positive seconds: received -1.0"),
    (["-n", "2", "--max-restarts", "-1", "--", "python"], "--max-restarts must be 0 or more: received -1"),
    (["-n", "2", "--start-timeout", "0", "--", "python"], "--start-timeout must be positive seconds: received 0.0"),
    (["-n", "2", "--port", "80", "--", "python"], "--port must leave room for 2 ports in 1024..65535: received 80"),
    (["-n", "2", "--timeout", "nan", "--", "python"], "--timeout must be positive seconds: received nan"),
    (["-n", "2", "--timeout", "inf", "--", "python"], "--timeout must be positive seconds: received inf (give a number "
                                                       "up to 1e+08)"),
    (["-n", "2", "--start-timeout", "nan", "--", "python"], "--start-timeout must be positive seconds: received nan"),
    (["-n", "2", "--grace-period", "nan", "--", "python"], "--grace-period must be 0..3600 seconds (between SIGTERM "
                                                            "and SIGKILL): received nan"),
    (["-n", "2", "--grace-period", "-1", "--", "python"], "--grace-period must be 0..3600 seconds (between SIGTERM "
                                                           "and SIGKILL): received -1.0"),
    (["-n", "2", "--grace-period", "1e10", "--", "python"], "--grace-period must be 0..3600 seconds (between SIGTERM "
                                                             "and SIGKILL): received 10000000000.0"),
    (["-n", "2", "--ray", "--cpus-per-worker", "nan", "--", "python"], "--cpus-per-worker must be 0 or more: "
                                                                       "received nan"),
    (["-n", "100000", "--", "python"], "-n 100000 needs about 300064 open files in this launcher, more than its limit "
                                       "of 1024 (ulimit -n): raise it (ulimit -n 300064) or start fewer workers"),
    (["-n", "2", "--", "{no_shebang}"], "command '{no_shebang}' cannot be run: it is neither a program nor a script "
                                        "with a '#!' line (Exec format error): make its first line '#!/usr/bin/env "
                                        "python3'"),
    (["-n", "2", "--", "{no_interpreter}"], "command '{no_interpreter}' cannot be run: its interpreter "
                                            "/no/such/python (its '#!' line) does not exist or is not executable"),
    (["-n", "2", "--", "{env_no_program}"], "command '{env_no_program}' cannot be run: its '#!' line runs "
                                            "'python9.99', which is not on PATH"),
])
def test_bad_launcher_arguments_fail_fast(tmp_path, args, message):
    scripts = {"no_shebang": "print('hi')\n", "no_interpreter": "#!/no/such/python\nprint('hi')\n",
               "env_no_program": "#!/usr/bin/env python9.99\nprint('hi')\n"}
    for name, text in scripts.items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    paths = {name: str(tmp_path / name) for name in scripts}
    args, message = [a.format(**paths) for a in args], message.format(**paths)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "tfdist.run", *args], env=job_env(), capture_output=True,
                            text=True, timeout=LAUNCH_TIMEOUT, preexec_fn=lambda: resource.setrlimit(
                                resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1])))
    assert result.returncode == 2
    assert f"tfdist run: error: {message}" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 10


def test_cli_dispatches_and_rejects_unknown_commands():
    ok = subprocess.run([sys.executable, "-m", "tfdist.cli", "run", "--help"], env=job_env(),
                        capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert ok.returncode == 0 and "tfdist run" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "tfdist.cli", "fly"], env=job_env(),
                         capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert bad.returncode == 2 and "unknown command 'fly'" in bad.stderr


def test_launcher_never_imports_tensorflow():
    code = "import sys, tfdist, tfdist.run, tfdist.cli; print('tensorflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], env=job_env(), capture_output=True, text=True,
                            timeout=LAUNCH_TIMEOUT)
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client (apt-get install openssh-client)")
def test_hosts_resolve_as_ssh_does(tmp_path):
    """-H names are ssh's: HostName from --ssh-config-file; every name that resolves nowhere, named on one line."""
    config = tmp_path / "ssh_config"
    config.write_text("Host gpu1\n  HostName 127.0.0.1\nHost gpu2\n  HostName no-such-host.invalid\n")

    def run(hosts):
        return subprocess.run([sys.executable, "-m", "tfdist.run", "-H", hosts, "--ssh-config-file", str(config),
                               "--", sys.executable, str(WORKERS / "toy_worker.py"), str(tmp_path), "echo"],
                              env=job_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)

    here = run("gpu1:2")  # this machine, by its ssh alias: started without ssh
    assert here.returncode == 0, here.stdout
    assert "node 0 (gpu1): 2 worker(s)" in here.stdout and "[1] hello from 1" in here.stdout
    assert json.loads((tmp_path / "worker1.json").read_text())["TFDIST_GRACE_PERIOD"] == "25"  # the default
    nowhere = run("gpu2:1,no-such-host-either.invalid:1")
    assert nowhere.returncode == 2
    assert ("tfdist run [hosts]: cannot resolve 'gpu2' (HostName no-such-host.invalid): Name or service not known; "
            "'no-such-host-either.invalid': Name or service not known: check the host names in -H/--hostfile and "
            "~/.ssh/config (or --ssh-config-file).\n") == nowhere.stdout
    assert nowhere.stderr == ""
