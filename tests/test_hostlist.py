"""``tfdist run -H`` / ``--hostfile``: reading host lists, filling slots, and the errors for bad ones.

Jobs across hosts over ssh: tests/test_ssh_hosts.py. Here the hosts are this machine
(two names for it, so two node launchers, no ssh).
"""

import json
import subprocess
import sys

import pytest

from tests.jobs import REPO, WORKERS, job_env
from tfdist.launch import hostlist


def test_host_lists_as_horovodrun_and_mpirun_write_them(tmp_path):
    assert hostlist.parse_hosts("a:2,b:2") == [("a", 2), ("b", 2)]
    assert hostlist.parse_hosts("a,[fd00::1]:3") == [("a", 1), ("fd00::1", 3)]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the job\nnode1 slots=2\nnode2:4  # comment\n\nnode3\nnode4 slots=1 max_slots=2\n")
    assert hostlist.parse_hostfile(str(hostfile)) == [("node1", 2), ("node2", 4), ("node3", 1), ("node4", 1)]


def test_workers_fill_hosts_in_order():
    assert hostlist.assign([("a", 2), ("b", 2)], None) == [("a", 2), ("b", 2)]
    assert hostlist.assign([("a", 2), ("b", 2)], 3) == [("a", 2), ("b", 1)]
    assert hostlist.assign([("a", 2), ("b", 2)], 1) == [("a", 1)]


@pytest.mark.parametrize("value, match", [
    ("a:0", r"-H 'a:0': cannot read 'a:0'; give host:slots.*-H node1:2,node2:2"),
    ("a:2,,b", r"cannot read ''"),
    ("a:2,a:1", r"lists \['a'\] more than once; list each host once"),
])
def test_bad_host_list_is_an_error_naming_it(value, match):
    with pytest.raises(hostlist.HostListError, match=match):
        hostlist.parse_hosts(value)


def test_hostfile_with_a_bad_line_is_an_error_naming_the_line(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2 slots=two\n")
    with pytest.raises(hostlist.HostListError, match=r"hosts, line 2: cannot read 'node2 slots=two'; write one host "
                                                     r"per line as 'HOST slots=N' or 'HOST:N'"):
        hostlist.parse_hostfile(str(hostfile))


def test_fewer_slots_than_workers_is_an_error_naming_both():
    with pytest.raises(hostlist.HostListError, match=r"-n 5 workers do not fit in 4 slot\(s\) of a:2,b:2: give fewer "
                                                     r"workers \(-n 4\), or more slots"):
        hostlist.assign([("a", 2), ("b", 2)], 5)


def run(*args, timeout=150):
    command = [sys.executable, "-m", "tfdist.run", *args]
    return subprocess.run(command, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=timeout + 30)


def test_bad_hostfile_stops_the_launcher_before_anything_starts(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\nlocalhost:x\n")
    result = run("--hostfile", str(hostfile), "--", sys.executable, "-c", "print('ran')")
    assert result.returncode == 2 and "ran" not in result.stdout
    assert "line 2: cannot read 'localhost:x'" in result.stderr


def test_two_local_hosts_train_one_job_with_equal_weights(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = run("-H", "localhost:1,127.0.0.1:1", "--timeout", "150", "--grace-period", "2", "--",
                 sys.executable, str(WORKERS / "horovod_example_job.py"), str(out), str(REPO / "examples" /
                 "multi_worker_fit.py"), str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "node 0 (localhost): 1 worker(s), node 1 (127.0.0.1): 1 worker(s)" in result.stdout
    assert "all workers finished on 2 nodes" in result.stdout
    workers = [json.loads((out / f"worker{rank}.json").read_text()) for rank in (0, 1)]
    assert workers[0]["final_weights"] == workers[1]["final_weights"]
    logs = workers[0]["fits"][-1]["epoch_logs"]
    assert logs[-1]["loss"] < logs[0]["loss"]


def test_ssh_options_without_hosts_are_an_error_saying_to_add_them():
    result = run("-n", "1", "-x", "FOO", "--", sys.executable, "-c", "print('ran')")
    assert result.returncode == 2 and "-x apply to hosts started over ssh: add -H HOST:N,... or --hostfile" in result.stderr
