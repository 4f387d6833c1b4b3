"""tfdist.strategy in one process, over the 4 logical CPU devices conftest creates."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist import strategy as strategy_lib
from tfdist.cluster import ClusterInfo
from tfdist.strategy import StrategyError, make_strategy, resolve_devices
from tests.workers import common

ONE_WORKER = ClusterInfo()


def short(names):
    return [n.rsplit("device:", 1)[1] for n in names]


@pytest.mark.parametrize("spec, expected", [
    (None, ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]),
    (2, ["CPU:0", "CPU:1"]),
    ("CPU:*", ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]),
    ("cpu:[1-2]", ["CPU:1", "CPU:2"]),
    ("CPU:3", ["CPU:3"]),
    (["/cpu:2", "CPU:0"], ["CPU:2", "CPU:0"]),
    (["/job:localhost/replica:0/task:0/device:CPU:1"], ["CPU:1"]),
])
def test_device_specs(spec, expected):
    assert short(resolve_devices(spec)) == expected


@pytest.mark.parametrize("spec, message", [
    ("GPU:*", r"devices='GPU:\*' matches no visible device; visible devices: \['CPU:0', 'CPU:1', 'CPU:2', 'CPU:3'\]"),
    (["GPU:0"], r"Device 'GPU:0' in devices=\['GPU:0'\] is not visible; visible devices: \['CPU:0'"),
    (5, r"devices=5 asks for 5 device\(s\), but 4 are visible: .*Pass 1..4"),
    (0, r"devices=0 asks for 0 device\(s\)"),
    ("all the gpus", r"Cannot read devices='all the gpus': use a pattern like 'GPU:\*'"),
    (3.5, r"Cannot read devices=3.5: pass None, an int, a list of names"),
])
def test_bad_device_specs_name_the_visible_devices(spec, message, no_gpu_here):
    with pytest.raises(StrategyError, match=message):
        resolve_devices(spec)


@pytest.mark.parametrize("replicas", [2, 4])
def test_mirrored_over_logical_cpus(replicas):
    built = make_strategy("mirrored", devices=replicas, cluster=ONE_WORKER)
    assert isinstance(built, tf.distribute.MirroredStrategy)
    assert built.num_replicas_in_sync == replicas


def test_auto_picks_by_devices_and_cluster():
    assert make_strategy("auto", devices="CPU:[0-1]", cluster=ONE_WORKER).num_replicas_in_sync == 2
    assert isinstance(make_strategy("auto", devices=["CPU:1"], cluster=ONE_WORKER), tf.distribute.OneDeviceStrategy)
    assert make_strategy("default", cluster=ONE_WORKER) is tf.distribute.get_strategy()


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "horovod"}, r"Unknown strategy 'horovod'; choose one of \['auto', 'default', 'one_device', 'mirrored', 'multi_worker'\]"),
    ({"strategy": "mirrored", "batch": 4}, r"Unknown option\(s\) \['batch'\]; tfdist.scope\(\) accepts"),
    ({"strategy": "mirrored", "cross_device_ops": "mpi"}, r"Unknown cross_device_ops='mpi'; choose one of \['nccl'"),
    ({"strategy": "multi_worker", "communication": "gloo"}, r"Unknown communication='gloo'; choose one of \['auto', 'ring', 'nccl'\]"),
    ({"strategy": "multi_worker", "collective_timeout": 0}, r"collective_timeout must be positive seconds or None: received 0"),
    ({"strategy": "one_device", "devices": 2}, r"strategy='one_device' needs exactly one device; devices=2 selected"),
    ({"strategy": "default", "devices": 2}, r"strategy='default' uses TensorFlow's placement; received devices=2"),
])
def test_bad_strategy_requests(kwargs, message):
    with pytest.raises(StrategyError, match=message):
        make_strategy(cluster=ONE_WORKER, **kwargs)


def test_multi_worker_after_tensorflow_started_names_where_it_started():
    """This process saw no cluster when TensorFlow started (the real-job tests cover the usual cases)."""
    two_workers = ClusterInfo(num_workers=2, worker_addresses=("127.0.0.1:1", "127.0.0.1:2"), source="tf_config")
    tf.constant(1.0)  # any op starts the runtime
    assert strategy_lib.runtime_initialized()
    with pytest.raises(StrategyError, match=r"must be built before TensorFlow's runtime starts, and it started at "
                                            r"\w+\.py:\d+, when this process did not see a multi-worker cluster"):
        make_strategy("multi_worker", cluster=two_workers)


def test_scope_builds_once_and_refuses_a_different_request(fresh_tfdist_strategy):
    with tfdist.scope(devices="CPU:[0-1]") as first:
        assert tf.distribute.get_strategy() is first
    with tfdist.scope(devices="CPU:[0-1]") as again:
        assert again is first
    assert tfdist.get_strategy() is first and tfdist.size() == 2
    with pytest.raises(StrategyError, match=r"already built a strategy for strategy='auto', devices='CPU:\[0-1\]'.*received strategy='mirrored', devices=4"):
        tfdist.get_strategy("mirrored", devices=4)


def test_size_needs_a_strategy(fresh_tfdist_strategy):
    with pytest.raises(RuntimeError, match=r"needs a strategy: call tfdist.init\(\) or enter tfdist.scope\(\) first"):
        tfdist.size()


def test_init_makes_the_strategy_the_process_default(fresh_tfdist_strategy):
    built = tfdist.init(devices="CPU:[0-1]")
    try:
        assert tf.distribute.get_strategy() is built and tfdist.size() == 2
    finally:
        tf.distribute.experimental_set_strategy(None)


def test_fit_under_mirrored_matches_one_device():
    two_replicas = make_strategy("mirrored", devices="CPU:[0-1]", cluster=ONE_WORKER)
    reference = common.train_equivalence()
    for got, want in zip(common.train_equivalence(two_replicas), reference):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert not np.allclose(reference[0], common.equivalence_model().get_weights()[0])  # it did train


@pytest.mark.parametrize("preset, expected", [(None, "true"), ("false", "false")])
def test_the_cpu_allocator_switch_is_set_before_the_runtime_unless_the_user_chose(preset, expected):
    """configure_cpu_allocator (called when a multi-worker strategy is built) turns on TensorFlow's BFC
    allocator for CPU tensors, and keeps a value the user set."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    if preset is not None:
        env["TF_CPU_ALLOCATOR_USE_BFC"] = preset
    code = ("import os; from tfdist import devices; devices.configure_cpu_allocator(); "
            "print(os.environ['TF_CPU_ALLOCATOR_USE_BFC'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == expected
