"""Kubernetes: docs/kubernetes/*.yaml give every pod what `tfdist run train.py` needs, with no flags.

No cluster is reachable here, so the test renders each manifest's pods (the environment and
host names Kubernetes gives them: JOB_COMPLETION_INDEX, HOSTNAME, the /etc/hosts line the
kubelet writes for a pod with a subdomain) and runs the manifest's command in each, every pod a
network namespace on one bridge (tests/netns.py), with a toy worker as train.py.
"""

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

from tests import netns
from tests.jobs import REPO, WORKERS
from tests.nodes_jobs import TOKEN, finish, start_node
from tfdist.errors import LaunchError
from tfdist.launch import kubernetes

MANIFESTS = REPO / "docs" / "kubernetes"
CLUSTER_DOMAIN = "default.svc.cluster.local"


def pods(manifest: str) -> tuple[dict, list[dict]]:
    """(the pod template's container, [each pod's host name, environment]) as Kubernetes would make them."""
    documents = [d for d in yaml.safe_load_all((MANIFESTS / manifest).read_text()) if d]
    kinds = {d["kind"]: d for d in documents}
    if "JobSet" in kinds:
        jobset = kinds["JobSet"]
        [replicated] = jobset["spec"]["replicatedJobs"]
        assert replicated["replicas"] == 1 and jobset["spec"]["network"]["publishNotReadyAddresses"] is True
        job, service = replicated["template"]["spec"], jobset["spec"]["network"].get("subdomain", jobset["metadata"]["name"])
        prefix = f"{jobset['metadata']['name']}-{replicated['name']}-0"  # <jobset>-<replicated job>-<job index>
    else:
        job, service = kinds["Job"]["spec"], kinds["Service"]["metadata"]["name"]
        assert job["template"]["spec"]["subdomain"] == service
        spec = kinds["Service"]["spec"]
        assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True
        assert spec["selector"] == {"batch.kubernetes.io/job-name": kinds["Job"]["metadata"]["name"]}
        prefix = kinds["Job"]["metadata"]["name"]
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"]
    [container] = job["template"]["spec"]["containers"]
    env = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            assert item["valueFrom"]["secretKeyRef"] == {"name": "tfdist-token", "key": "token"}
            env[item["name"]] = TOKEN
    assert env["TFDIST_NNODES"] == str(job["completions"])
    made = [{"hostname": f"{prefix}-{i}", "fqdn": f"{prefix}-{i}.{service}.{CLUSTER_DOMAIN}",
             "env": {**env, "JOB_COMPLETION_INDEX": str(i), "HOSTNAME": f"{prefix}-{i}"}}
            for i in range(job["completions"])]
    return container, made


@pytest.mark.parametrize("manifest, master", [("indexed-job.yaml", "train-0.train"),
                                              ("jobset.yaml", "train-node-0-0.train")])
def test_each_pod_of_a_manifest_finds_its_rank_the_node_count_and_the_master(manifest, master):
    _, made = pods(manifest)
    names = {pod["hostname"]: pod["fqdn"] for pod in made}
    for rank, pod in enumerate(made):
        found = kubernetes.defaults(pod["env"], fqdn=names.__getitem__)
        assert found == kubernetes.Defaults("2", rank, f"{master}.{CLUSTER_DOMAIN}:29400")


@pytest.mark.parametrize("env, fqdn, message", [
    ({"HOSTNAME": "train-1"}, "train-1", "this pod (train-1) has no DNS subdomain, so the other pods cannot reach it "
                                         "by name: set the pod template's subdomain to a headless Service"),
    ({"HOSTNAME": "worker"}, "worker.s", "this pod's host name 'worker' does not end in -1 (JOB_COMPLETION_INDEX): "
                                         "tfdist names the master after an Indexed Job's or a JobSet's pods; set "
                                         "TFDIST_MASTER=ADDR:PORT."),
    ({"HOSTNAME": "train-1", "TFDIST_MASTER_PORT": "x"}, "train-1.s", "TFDIST_MASTER_PORT must be a port number: "
                                                                     "received 'x'."),
    ({"JOB_COMPLETION_INDEX": "one"}, "", "JOB_COMPLETION_INDEX must be a pod's completion index (0, 1, ...): "
                                          "received 'one'."),
])
def test_a_pod_whose_master_cannot_be_named_says_why(env, fqdn, message):
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        kubernetes.defaults({"TFDIST_NNODES": "2", "JOB_COMPLETION_INDEX": "1", **env}, fqdn=lambda name: fqdn)


def test_tfdist_master_and_nnodes_stand_for_the_flags_anywhere():
    assert kubernetes.defaults({"TFDIST_NNODES": "2:4", "TFDIST_MASTER": "10.0.0.1:29400"}) == \
        kubernetes.Defaults("2:4", None, "10.0.0.1:29400")
    assert kubernetes.defaults({}) == kubernetes.Defaults()


@pytest.fixture(scope="module")
def two_pods():
    with netns.bridged_or_skip(2) as made:
        yield made


@pytest.mark.parametrize("manifest", ["indexed-job.yaml", "jobset.yaml"])
def test_the_manifests_command_runs_a_2_node_job_with_no_flags(two_pods, tmp_path, manifest):
    container, made = pods(manifest)
    assert container["command"] == ["tfdist", "run", "train.py"]
    lines = ["127.0.0.1 localhost"] + [f"{h.address} {p['fqdn']} {p['hostname']}" for h, p in zip(two_pods, made)]
    for host in two_pods:  # the kubelet's /etc/hosts (ip netns exec mounts it over /etc/hosts)
        hosts_file = pathlib.Path(f"/etc/netns/{host.namespace}/hosts")
        hosts_file.parent.mkdir(parents=True, exist_ok=True)
        hosts_file.write_text("\n".join(lines) + "\n")
    train = tmp_path / "app" / "train.py"
    train.parent.mkdir()
    shutil.copy(WORKERS / "toy_worker.py", train)
    command = [sys.executable, "-m", "tfdist.cli", *container["command"][1:], str(tmp_path), "echo"]
    nodes = [start_node(host.command(["env", "-C", str(train.parent), *command]), env=pod["env"])
             for host, pod in zip(two_pods, made)]
    results = finish(nodes, timeout=120)
    assert [r.returncode for r in results] == [0, 0], [r.output[-3000:] for r in results]
    assert "tfdist run [master]: all 2 nodes arrived; starting 2 workers" in results[0].output
    configs = [json.loads(json.loads((tmp_path / f"worker{rank}.json").read_text())["TF_CONFIG"]) for rank in (0, 1)]
    assert [a.rsplit(":", 1)[0] for a in configs[0]["cluster"]["worker"]] == [h.address for h in two_pods]
    assert all(not host.pids() for host in two_pods)

