"""tfdist.cluster: reading TF_CONFIG, SLURM and the launcher's variables (no TensorFlow)."""

import json

import pytest

from tfdist.cluster import (ClusterConfigError, ClusterInfo, cluster_from_env, cpu_devices_from_env,
                            expand_slurm_nodelist, expand_slurm_tasks_per_node, make_tf_config)


def tf_config(cluster, task_type="worker", index=0):
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})}


def test_no_cluster_is_one_chief_worker():
    assert cluster_from_env({}) == ClusterInfo(num_workers=1, worker_index=0, is_chief=True, source="none")
    assert not cluster_from_env({}).is_multi_worker


def test_tf_config_workers_on_two_hosts():
    info = cluster_from_env(tf_config({"worker": ["a:1", "a:2", "b:1"]}, index=1))
    assert (info.num_workers, info.worker_index, info.is_chief, info.source) == (3, 1, False, "tf_config")
    assert (info.local_rank, info.local_size) == (1, 2)
    assert info.worker_addresses == ("a:1", "a:2", "b:1")
    other_host = cluster_from_env(tf_config({"worker": ["a:1", "a:2", "b:1"]}, index=2))
    assert (other_host.local_rank, other_host.local_size) == (0, 1)


def test_tf_config_chief_comes_first():
    cluster = {"chief": ["c:1"], "worker": ["w:1", "w:2"]}
    chief = cluster_from_env(tf_config(cluster, "chief", 0))
    worker = cluster_from_env(tf_config(cluster, "worker", 1))
    assert (chief.worker_index, chief.is_chief) == (0, True)
    assert (worker.worker_index, worker.is_chief, worker.num_workers) == (2, False, 3)


def test_launcher_variables_mark_the_source_and_local_rank():
    env = {**tf_config({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, index=1),
           "TFDIST_WORKER_INDEX": "1", "TFDIST_LOCAL_RANK": "1", "TFDIST_LOCAL_SIZE": "2"}
    info = cluster_from_env(env)
    assert (info.source, info.worker_index, info.local_rank, info.local_size) == ("tfdist", 1, 1, 2)


def test_reading_does_not_mutate_the_environment():
    env = tf_config({"worker": ["a:1", "b:1"]}, index=1)
    before = dict(env)
    cluster_from_env(env)
    assert env == before


@pytest.mark.parametrize("raw, message", [
    ("{not json", r"TF_CONFIG is not valid JSON .*received '\{not json'.*A valid TF_CONFIG looks like"),
    ('{"cluster": {"worker": ["a:1"]}}', r"needs both 'cluster' and 'task' keys"),
    ('{"cluster": ["a:1"], "task": {}}', r"'cluster' and 'task' must be objects"),
    ('{"cluster": {"worker": ["a:1"], "ps": ["p:1"]}, "task": {"type": "worker", "index": 0}}',
     r"task type\(s\) \['ps'\] that tfdist does not support"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "evaluator", "index": 0}}',
     r"task type 'evaluator' is not one of \['chief', 'worker'\]"),
    ('{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 2}}',
     r"task index 2 is out of range: cluster\['worker'\] has 2 address\(es\), so use 0..1"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "0"}}', r"task index '0' is out of range"),
])
def test_malformed_tf_config_names_the_value_and_shows_a_valid_one(raw, message):
    with pytest.raises(ClusterConfigError, match=message):
        cluster_from_env({"TF_CONFIG": raw})


def test_make_tf_config_round_trips():
    raw = make_tf_config(["127.0.0.1:5000", "127.0.0.1:5001"], 1)
    info = cluster_from_env({"TF_CONFIG": raw})
    assert (info.num_workers, info.worker_index) == (2, 1)


@pytest.mark.parametrize("addresses, index, message", [
    ([], 0, r"needs at least one worker address"),
    (["a:1"], 1, r"Worker index 1 is out of range for 1 workers; use 0..0"),
])
def test_make_tf_config_rejects_bad_arguments(addresses, index, message):
    with pytest.raises(ClusterConfigError, match=message):
        make_tf_config(addresses, index)


SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
         "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}


def test_slurm_job_gives_every_task_an_address():
    info = cluster_from_env(SLURM)
    assert (info.source, info.num_workers, info.worker_index, info.is_chief) == ("slurm", 4, 3, False)
    assert (info.local_rank, info.local_size) == (1, 2)
    assert info.worker_addresses == ("gpu01:23456", "gpu01:23457", "gpu02:23456", "gpu02:23457")
    assert cluster_from_env({**SLURM, "TFDIST_PORT": "4000"}).worker_addresses[0] == "gpu01:4000"


def test_tf_config_wins_over_slurm():
    assert cluster_from_env({**SLURM, **tf_config({"worker": ["a:1"]})}).source == "tf_config"


@pytest.mark.parametrize("update, message", [
    ({"SLURM_PROCID": "4"}, r"SLURM_PROCID=4 is out of range for SLURM_NTASKS=4"),
    ({"SLURM_STEP_NODELIST": ""}, r"start the workers with srun"),
    ({"SLURM_STEP_TASKS_PER_NODE": "3(x2)"}, r"SLURM variables disagree"),
    ({"SLURM_NTASKS": "four"}, r"SLURM_NTASKS must be an integer: received 'four'"),
])
def test_bad_slurm_variables(update, message):
    with pytest.raises(ClusterConfigError, match=message):
        cluster_from_env({**SLURM, **update})


def test_slurm_list_expansion():
    assert expand_slurm_nodelist("gpu[01-03,07],login") == ["gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert expand_slurm_nodelist("n[8-10]") == ["n8", "n9", "n10"]
    assert expand_slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ClusterConfigError, match=r"Cannot read SLURM tasks per node 'x2'"):
        expand_slurm_tasks_per_node("x2")


def test_cpu_devices_variable():
    assert cpu_devices_from_env({}) is None
    assert cpu_devices_from_env({"TFDIST_CPU_DEVICES": "2"}) == 2
    with pytest.raises(ClusterConfigError, match=r"TFDIST_CPU_DEVICES must be >= 1: received 0"):
        cpu_devices_from_env({"TFDIST_CPU_DEVICES": "0"})
