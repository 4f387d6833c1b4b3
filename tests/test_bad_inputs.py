"""A catalogue of bad inputs across the API and the CLI.

Each case asserts the exception type (or exit code), a message fragment that names the
bad value and the fix, and that the answer came back in under 10 seconds.
"""

import time

import keras
import pytest
import tensorflow as tf

import tfdist
from tfdist import callbacks, cluster, collectives, data, precision, process_group, strategy
from tfdist.bench import cli as bench_cli
from tfdist.data import convert
from tfdist.run import main as run_main

FAST_SECONDS = 10
ONE_WORKER = cluster.ClusterInfo()


def sgd():
    return keras.optimizers.SGD(0.1)


def not_a_tfrecord(tmp_dir):
    path = tmp_dir / "notes-00000-of-00001.tfrecord"
    path.write_text("these are notes, not records")
    return str(path)


def one_shard(tmp_dir):
    import numpy as np

    images, labels = np.zeros((4, 8, 8, 3), "uint8"), np.arange(4)
    return data.write_tfrecords((images, labels), str(tmp_dir), num_shards=1).pattern


# (name, call, exception type, message fragment)
API_CASES = [
    ("tf_config not json", lambda: cluster.cluster_from_env({"TF_CONFIG": "[1,"}), cluster.ClusterConfigError,
     "TF_CONFIG is not valid JSON"),
    ("tf_config ps task", lambda: cluster.cluster_from_env(
        {"TF_CONFIG": '{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 0}}'}),
     cluster.ClusterConfigError, "task type(s) ['ps'] that tfdist does not support"),
    ("tf_config index", lambda: cluster.cluster_from_env(
        {"TF_CONFIG": '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 5}}'}),
     cluster.ClusterConfigError, "task index 5 is out of range"),
    ("slurm procid", lambda: cluster.cluster_from_env({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"}),
     cluster.ClusterConfigError, "SLURM_PROCID must be an integer: received 'x'"),
    ("strategy name", lambda: strategy.make_strategy("mirored", cluster=ONE_WORKER), strategy.StrategyError,
     "Unknown strategy 'mirored'; choose one of"),
    ("device pattern", lambda: strategy.resolve_devices("TPU:*"), strategy.StrategyError,
     "Cannot read devices='TPU:*'"),
    ("device missing", lambda: strategy.resolve_devices(["GPU:97"]), strategy.StrategyError,
     "Device 'GPU:97' in devices=['GPU:97'] is not visible; visible devices:"),
    ("too many devices", lambda: strategy.resolve_devices(99), strategy.StrategyError,
     "devices=99 asks for 99 device(s), but "),  # the GPUs where there are some, else the 4 logical CPUs
    ("scope option", lambda: strategy.make_strategy("mirrored", cluster=ONE_WORKER, timeout=3),
     strategy.StrategyError, "Unknown option(s) ['timeout']"),
    ("multi_worker alone", lambda: strategy.make_strategy("multi_worker", cluster=ONE_WORKER),
     strategy.StrategyError, "strategy='multi_worker' needs a cluster of several workers, but the environment describes 1"),
    ("scale_lr", lambda: tfdist.scale_lr(-0.1), ValueError, "scale_lr needs a positive learning rate; received lr=-0.1"),
    ("allreduce op", lambda: collectives.allreduce(1.0, op="max"), ValueError, "allreduce op must be one of"),
    ("collective value", lambda: collectives.allreduce("three"), TypeError,
     "tfdist collectives take a number, NumPy array or tensor"),
    ("broadcast root", lambda: collectives.broadcast(1.0, root_rank=3), ValueError,
     "root_rank=3 is not among the ranks taking part"),
    ("optimizer type", lambda: tfdist.DistributedOptimizer("adam"), TypeError,
     "DistributedOptimizer wraps a keras.optimizers.Optimizer"),
    ("accumulation steps", lambda: tfdist.DistributedOptimizer(sgd(), backward_passes_per_step=0), ValueError,
     "backward_passes_per_step must be an int >= 1; received"),
    ("warmup epochs", lambda: callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=0), ValueError,
     "warmup_epochs must be an int >= 1; received warmup_epochs=0"),
    ("schedule lr", lambda: callbacks.LearningRateScheduleCallback(-1, multiplier=0.1), ValueError,
     "initial_lr must be a positive number; received initial_lr=-1"),
    ("schedule epochs", lambda: callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=3, end_epoch=2),
     ValueError, "end_epoch must be after start_epoch; received start_epoch=3"),
    ("data no files", lambda tmp: data.tfrecord_dataset(str(tmp / "nope-*.tfrecord"), batch_size=8),
     FileNotFoundError, "matches no file"),
    ("data not a tfrecord", lambda tmp: data.tfrecord_dataset(not_a_tfrecord(tmp), batch_size=8), data.DataError,
     "notes-00000-of-00001.tfrecord"),
    ("data batch size", lambda tmp: data.tfrecord_dataset(one_shard(tmp), batch_size=0), data.DataError,
     "batch_size must be a positive int: received batch_size=0"),
    ("data missing feature", lambda tmp: data.tfrecord_dataset(one_shard(tmp), batch_size=2, features=["mask"]),
     data.DataError, "Feature(s) ['mask'] requested in features= are not in the records"),
    ("data batch per replica", lambda: data.per_pipeline_batch_size(
        10, tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=4)),
     data.DataError, "The global batch_size=10 does not divide by the 4 replicas in sync"),
    ("writer shards", lambda tmp: data.write_tfrecords({"x": [1, 2]}, str(tmp), num_shards=0), data.DataError,
     "num_shards must be an int from 1 to 99999 (shard names hold 5 digits): received num_shards=0"),
    ("convert source", lambda tmp: convert.convert("tf_flowers", "train", str(tmp), source="web"),
     convert.ConvertError, "Unknown source='web'; choose one of"),
    ("precision name", lambda: precision.set_policy("fp8"), precision.PrecisionError,
     "Unknown precision 'fp8'; choose one of"),
    ("scope precision", lambda: tfdist.scope(precision="half").__enter__(), precision.PrecisionError,
     "Unknown precision 'half'"),
    ("loss scale", lambda: precision.wrap_optimizer(sgd(), initial_scale=0), precision.PrecisionError,
     "initial_scale must be positive: received 0"),
    ("process group lane", lambda: process_group.ProcessGroup([0, 1], 0).lane(0), ValueError,
     r"lane number must be an int from 1 to 63; received 0"),
]


@pytest.mark.parametrize("name, call, error, fragment", API_CASES, ids=[c[0] for c in API_CASES])
def test_api_rejects_bad_input(name, call, error, fragment, fresh_tfdist_strategy, tmp_path):
    started = time.monotonic()
    with pytest.raises(error) as caught:
        call(tmp_path) if call.__code__.co_argcount else call()
    assert fragment in str(caught.value)
    assert time.monotonic() - started < FAST_SECONDS


# (name, main, argv, exit code, fragment on stderr)
CLI_CASES = [
    ("run -n 0", run_main, ["-n", "0", "--", "python"], 2, "-n must be at least 1: received -n 0"),
    ("run no command", run_main, ["-n", "2"], 2, "no command to run: put it after --"),
    ("run missing program", run_main, ["-n", "1", "--", "nope-xyz"], 2, "command 'nope-xyz' was not found"),
    ("run bad port", run_main, ["-n", "2", "--port", "70000", "--", "python"], 2, "--port must leave room"),
    ("run timeout nan", run_main, ["-n", "1", "--timeout", "nan", "--", "python"], 2,
     "--timeout must be positive seconds: received nan"),
    ("run grace period", run_main, ["-n", "1", "--grace-period", "-1", "--", "python"], 2,
     "--grace-period must be 0..3600 seconds (between SIGTERM and SIGKILL): received -1.0"),
    ("bench model", bench_cli.main, ["--model", "vgg"], 2, "Unknown --model 'vgg'; choose one of"),
    ("bench source", bench_cli.main, ["--source", "web"], 2, "Unknown --source 'web'; choose one of"),
    ("bench batch", bench_cli.main, ["--replicas", "1,3", "--batch-size", "64"], 2,
     "Global batch 64 does not divide over 3 replicas"),
    ("bench epochs", bench_cli.main, ["--epochs", "1"], 2, "--epochs 1 leaves nothing to time"),
    ("bench replicas list", bench_cli.main, ["--replicas", "one"], 2, "expected integers separated by commas"),
    ("bench tfrecord pattern", bench_cli.main, ["--source", "tfrecord"], 2, "--source tfrecord needs --tfrecords"),
    ("bench too many replicas", bench_cli.main, ["--replicas", "64", "--batch-size", "64"], 2,
     "--replicas 64 is more than the"),
    ("bench unknown dataset", bench_cli.main, ["--dataset", "imagenet_typo"], 2,
     "Unknown --dataset 'imagenet_typo': not a tensorflow-datasets name"),
    ("bench failed download", bench_cli.main, ["--source", "tfds", "--cache-dir", "/tmp/tfdist-bad-input-cache",
                                               "--data-dir", "/tmp/tfdist-bad-input-tfds"], 2, "--source mock"),
    ("convert unknown dataset", convert.main, ["--dataset", "flowerz", "--out", "/tmp/x", "--source", "mock"], 1,
     "tfds has no dataset named 'flowerz'"),
]


@pytest.mark.parametrize("name, main, argv, code, fragment", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_rejects_bad_input(name, main, argv, code, fragment, capsys, monkeypatch):
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):  # downloads fail at once
        monkeypatch.setenv(proxy, "http://127.0.0.1:9")
    started = time.monotonic()
    try:
        returned = main(argv)
    except SystemExit as exit_:  # argparse errors
        returned = exit_.code
    assert returned == code
    assert fragment in capsys.readouterr().err
    assert time.monotonic() - started < FAST_SECONDS


@pytest.mark.parametrize("workers", ["three", "-1", "2.5"])
def test_the_test_command_refuses_a_worker_count_that_is_not_a_whole_number_before_building(workers):
    import os
    import pathlib
    import subprocess

    script = pathlib.Path(__file__).resolve().parent / "run.sh"
    started = time.monotonic()
    done = subprocess.run(["bash", str(script)], env={**os.environ, "TFDIST_TEST_WORKERS": workers},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"received TFDIST_TEST_WORKERS='{workers}'. Set a whole number, e.g. TFDIST_TEST_WORKERS=3." in done.stderr
    assert time.monotonic() - started < FAST_SECONDS  # before the wheel build
