"""The restart policy every launcher follows (``tfdist.launch.policy``): one verdict per attempt of the job."""

import pytest

from tfdist.launch import policy
from tfdist.launch.policy import Failure, Outcome, RestartPolicy

FAILED = Failure("worker 1 exited with code 3", 3)


def decide(rules, failure=FAILED, where="", **outcome):
    return rules.decide(Outcome(failure, seconds=1.23, **outcome), where=where)


def test_every_worker_finished():
    assert decide(RestartPolicy(0, fixed_ports=False), None) == policy.Verdict("all workers finished", 0)
    assert decide(RestartPolicy(0, fixed_ports=False), None, " on 2 nodes").message == "all workers finished on 2 nodes"


def test_a_failure_restarts_while_max_restarts_allows_then_ends_the_job_with_its_code():
    rules = RestartPolicy(1, fixed_ports=False)
    assert decide(rules) == policy.Verdict("worker 1 exited with code 3 after 1.2s; restarting all workers (1/1)")
    assert decide(rules) == policy.Verdict("worker 1 exited with code 3; stopped all workers after 1 restart(s)", 3)
    assert rules.restarts == 1


def test_after_restarts_the_end_says_how_many():
    rules = RestartPolicy(2, fixed_ports=False)
    decide(rules, where=" on 2 nodes")
    assert decide(rules, None, " on 2 nodes").message == "all workers finished on 2 nodes after 1 restart(s)"


def test_a_preempted_job_with_no_restart_left_ends_saved():
    verdict = decide(RestartPolicy(0, fixed_ports=False), Failure("worker 0 exited with code 85 (preempted)", 85))
    assert verdict == policy.Verdict("worker 0 exited with code 85 (preempted); the job was preempted and saved "
                                     "(exit code 85): run the same command to resume it", 85)


def test_a_port_clash_is_retried_on_fresh_ports_three_times_uncounted_then_as_any_failure():
    rules = RestartPolicy(1, fixed_ports=False)
    for attempt in (1, 2, 3):
        assert decide(rules, port_clash=("127.0.0.1:5000",)) == policy.Verdict(
            "worker 1 exited with code 3: port 127.0.0.1:5000 was taken by another process before tfdist's worker "
            f"could listen there; retrying on fresh ports ({attempt}/3)")
    assert rules.restarts == 0
    assert decide(rules, port_clash=("127.0.0.1:5000",)).message.endswith("restarting all workers (1/1)")


def test_a_port_clash_on_fixed_ports_ends_the_job_naming_the_ports():
    verdict = decide(RestartPolicy(3, fixed_ports=True), port_clash=("10.0.0.1:5000", "10.0.0.2:5000"),
                     where=" on 2 nodes")
    assert verdict == policy.Verdict(
        "worker 1 exited with code 3: ports 10.0.0.1:5000, 10.0.0.2:5000 were taken by another process before "
        "tfdist's workers could listen there (free them, or give another --port); stopped all workers on 2 nodes", 3)


def test_a_change_of_members_restarts_uncounted_unless_the_failure_cannot_be_restarted():
    rules = RestartPolicy(0, fixed_ports=False)
    assert decide(rules, None, change="node 2 joined") == policy.Verdict("node 2 joined")
    assert decide(rules, change="node 2 joined") == policy.Verdict("node 2 joined")
    lost = Failure("lost node 1's launcher", 1, restartable=False)
    assert decide(rules, lost, change="node 1 left").exit_code == 1
    assert rules.restarts == 0


@pytest.mark.parametrize("failure, nodes_lost", [
    (Failure("node 1: the job ran past --timeout", 124, restartable=False), False), (FAILED, True)])
def test_what_no_restart_can_mend_ends_the_job_whatever_restarts_are_left(failure, nodes_lost):
    verdict = decide(RestartPolicy(5, fixed_ports=False), failure, " on 2 nodes", nodes_lost=nodes_lost,
                     port_clash=("127.0.0.1:5000",))
    assert verdict == policy.Verdict(f"{failure.message}; stopped all workers on 2 nodes", failure.exit_code)
