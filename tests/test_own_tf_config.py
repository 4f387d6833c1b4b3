"""A script that sets TF_CONFIG itself, as the TensorFlow guide's multi-worker script does, under ``tfdist run``.

The stand-in below is that script cut to what matters here (the guide's also loads
cats_vs_dogs, which cannot download here; it never gets that far): it fixes TF_CONFIG to
worker index 0 on localhost ports 20000/20001, then builds MultiWorkerMirroredStrategy.
"""

import json
import subprocess
import sys
import time

import pytest

from tests.jobs import job_env
from tfdist import cluster

GUIDE_LIKE = '''\
import json
import os

import tensorflow as tf

os.environ['TF_CONFIG'] = json.dumps({
    'cluster': {'worker': ["localhost:20000", "localhost:20001"]},
    'task': {'type': 'worker', 'index': 0}
})
strategy = tf.distribute.MultiWorkerMirroredStrategy()
print("trained")
'''

SAME_AS_LAUNCHER = '''\
import json
import os

import tensorflow as tf

config = json.loads(os.environ["TF_CONFIG"])
os.environ["TF_CONFIG"] = json.dumps({"task": config["task"], "cluster": config["cluster"]}, indent=1)
strategy = tf.distribute.MultiWorkerMirroredStrategy()
print("workers", strategy.extended._num_workers)
'''

LAUNCHER = cluster.make_tf_config(["127.0.0.1:1", "127.0.0.1:2"], 1)


def run(tmp_path, source, timeout=150):
    script = tmp_path / "multi_worker.py"
    script.write_text(source)
    command = [sys.executable, "-m", "tfdist.run", "-n", "2", "--timeout", str(timeout), "--grace-period", "2",
               "--", sys.executable, str(script)]
    began = time.monotonic()
    result = subprocess.run(command, env=job_env(), capture_output=True, text=True, timeout=timeout + 30)
    return result, time.monotonic() - began


def test_changed_tf_config_is_an_error_naming_both():
    env = {"TF_CONFIG": cluster.make_tf_config(["localhost:20000", "localhost:20001"], 0),
           cluster.ENV_LAUNCHER_TF_CONFIG: LAUNCHER}
    with pytest.raises(cluster.TFConfigChangedError, match=r"TF_CONFIG was changed inside this worker.*localhost:20000"
                                                           r".*gave this worker .*127.0.0.1:1.*Fix: delete the line"):
        cluster.cluster_from_env(env)


def test_the_same_tf_config_written_differently_is_no_change():
    same = json.dumps(json.loads(LAUNCHER), indent=2, sort_keys=True)
    assert cluster.cluster_from_env({"TF_CONFIG": same, cluster.ENV_LAUNCHER_TF_CONFIG: LAUNCHER}).worker_index == 1


def test_guide_script_that_sets_tf_config_stops_every_worker_naming_the_line(tmp_path):
    result, seconds = run(tmp_path, GUIDE_LIKE)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "TF_CONFIG was changed inside this worker (multi_worker.py:6: os.environ['TF_CONFIG'] = " in result.stdout
    assert "Fix: delete the line that sets os.environ['TF_CONFIG']" in result.stdout
    assert "stopped all workers" in result.stdout and "trained" not in result.stdout
    assert "Could not start gRPC server" not in result.stdout
    assert seconds < 60  # TensorFlow's import is most of it


def test_script_that_sets_the_launchers_tf_config_carries_on(tmp_path):
    result, _ = run(tmp_path, SAME_AS_LAUNCHER)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "[0] workers 2" in result.stdout and "[1] workers 2" in result.stdout


def test_a_scripts_own_mirrored_strategy_trains_each_workers_copy_in_a_job(tmp_path):
    """tf.distribute.MirroredStrategy() of a script run on 2 workers: each trains its own copy (tfdist says so once).
    The job's strategy, built before TensorFlow's first op, makes the cluster's task 0 resolve every collective
    group: both workers' local groups took group key 1, and worker 1's first all-reduce failed with "joining a
    group that is already full (group_key=1)" (found running keras/src/backend/tensorflow/distribute_test.py under
    tfdist run -n 2, tests/keras_gate)."""
    from tests.jobs import run_job

    job = run_job("own_mirrored_job.py", tmp_path, launcher_args=("--cpu-devices", "2")).check()
    assert job.results[0]["weights"] == job.results[1]["weights"]  # the same data, each worker's own copy
    for rank in (0, 1):
        assert [w for w in job.results[rank]["warnings"] if "trains its own copy" in w and "must be the last to exit" in w]
