"""Fault injection: a worker SIGKILLed mid-epoch stops the job fast, or a restart resumes it."""

import re
import socket
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.jobs import run_job
from tests.workers import common
from tfdist.launch import local


def test_killed_worker_stops_the_job_within_30s_naming_it(tmp_path):
    result = run_job("fault_job.py", tmp_path, timeout=120)
    stopped_at = time.time()
    assert result.returncode == 137, result.output[-3000:]
    assert "worker 1 was killed by SIGKILL; stopped all workers" in result.output
    assert stopped_at - float((tmp_path / "killed_at").read_text()) < 30
    assert not result.results  # nobody finished


def test_restart_resumes_from_keras_backup_at_the_batch_after_it(tmp_path):
    """Keras' own BackupAndRestore, one shared backup_dir, a backup every 2 batches: the restarted
    job resumes at epoch 1, batch 2 (the backup was taken after batch 1), and ends where an
    uninterrupted run ends."""
    result = run_job("fault_job.py", tmp_path, timeout=180, launcher_args=("--max-restarts", "1")).check()
    assert "worker 1 was killed by SIGKILL" in result.output and "restarting all workers (1/1)" in result.output
    for rank in (0, 1):
        assert result.results[rank]["attempt"] == 1
        assert result.results[rank]["steps"] == [[1, 2], [1, 3]] + [[e, b] for e in (2, 3) for b in range(4)]
        assert not result.results[rank]["backup_left"]  # the chief deleted it when training ended
    reference = uninterrupted_weights(epochs=4)
    for rank in (0, 1):
        for got, want in zip(result.results[rank]["weights"], reference):
            np.testing.assert_allclose(got, want, atol=1e-5)


def uninterrupted_weights(epochs):
    model = common.equivalence_model()
    x, y = common.regression_data(64)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH), epochs=epochs, verbose=0)
    return model.get_weights()


def test_a_stuck_peer_makes_the_others_fail_after_the_collective_timeout(tmp_path):
    result = run_job("stuck_peer_job.py", tmp_path, "5", timeout=120)
    assert result.returncode == 1, result.output[-3000:]
    assert "worker 0 exited with code 1" in result.output and "Collective has timed out" in result.output
    waited = result.results[0]["timed_out_at"] - result.results[1]["stuck_at"]
    assert 4 < waited < 20


def damage_a_payload(path: str, record: int) -> None:
    """Flips a byte inside record ``record``'s payload (its header stays valid)."""
    import struct

    content = bytearray(open(path, "rb").read())
    offset = 0
    for _ in range(record):
        offset += 12 + struct.unpack("<Q", content[offset:offset + 8])[0] + 4
    content[offset + 12 + 5] ^= 0xFF
    open(path, "wb").write(bytes(content))


@pytest.fixture
def shards_with_a_damaged_middle(tmp_path):
    from tfdist import data

    images = np.random.default_rng(0).integers(0, 255, (64, 8, 8, 3), dtype="uint8")
    result = data.write_tfrecords((images, np.arange(64) % 2), str(tmp_path), num_shards=4)
    damage_a_payload(result.paths[2], record=3)
    return result.pattern


def fit_one_epoch(pattern, skip_corrupt, model=None):
    import keras

    from tfdist import data

    dataset = data.tfrecord_dataset(pattern, batch_size=8, skip_corrupt=skip_corrupt, shuffle=False,
                                    parse_fn=lambda b: (tf.cast(b["image"], "float32") / 255, b["label"]))
    if model is None:
        model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Flatten(), keras.layers.Dense(2)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, model.fit(dataset, epochs=1, verbose=0, shuffle=False)


def test_a_damaged_record_mid_epoch_stops_training_at_its_batch(shards_with_a_damaged_middle):
    """The fit fails at the damaged batch with TensorFlow's error, not after the epoch's 8 batches, nor silently."""
    import keras

    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Flatten(), keras.layers.Dense(2)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(tf.errors.DataLossError, match="corrupted record"):
        fit_one_epoch(shards_with_a_damaged_middle, skip_corrupt=False, model=model)
    assert int(model.optimizer.iterations) <= 2  # of 8: the damaged record (shard 2, record 3) is in batch 1 or 2


def test_skip_corrupt_trains_through_a_damaged_record(shards_with_a_damaged_middle):
    model, history = fit_one_epoch(shards_with_a_damaged_middle, skip_corrupt=True)
    assert np.isfinite(history.history["loss"][0])
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


@pytest.mark.usefixtures("restore_dtype_policy")
@pytest.mark.filterwarnings("ignore::tfdist.precision.PrecisionWarning")
def test_float16_training_survives_many_non_finite_gradients_on_one_replica():
    """Every 4th batch carries inf on replica 0's half: those steps are skipped on both replicas."""
    import keras

    from tfdist import precision, strategy as strategy_lib

    mirrored = strategy_lib.make_strategy("mirrored", devices="CPU:[0-1]")
    precision.set_policy("mixed_float16")
    steps, poisoned = 40, list(range(0, 40, 4))
    x, y = common.regression_data(16 * steps)
    x[[i * 16 + r for i in poisoned for r in range(8)]] = np.inf  # rows 0-7 of a batch go to replica 0
    with mirrored.scope():
        model = common.equivalence_model()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    start = [w.copy() for w in model.get_weights()]
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1, verbose=0, shuffle=False)
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert not np.allclose(start[0], model.get_weights()[0])  # the clean steps trained
    assert precision.current_loss_scale(model.optimizer) <= 2.0**15 / 2 ** len(poisoned)
    for weight in model.weights:
        first, second = (v.numpy() for v in mirrored.experimental_local_results(weight.value))
        np.testing.assert_array_equal(first, second)


def test_a_worker_that_never_joins_stops_the_job_after_the_start_timeout(tmp_path):
    started = time.monotonic()
    result = run_job("lonely_job.py", tmp_path, timeout=120, launcher_args=("--start-timeout", "3"))
    assert result.returncode == 124, result.output[-3000:]
    assert ("worker(s) [0, 1] did not join the cluster within --start-timeout 3s; "
            "worker(s) [1] never reached tfdist.scope()/init()") in result.output
    assert time.monotonic() - started < 60


def test_a_worker_whose_port_is_taken_is_retried_on_fresh_ports(tmp_path):
    """Worker 1's TF_CONFIG port is held (SO_REUSEPORT set) when TensorFlow binds it: TensorFlow raises
    "UnknownError: Could not start gRPC server", tfdist marks the worker "port-clash", and the launcher starts both
    workers again on fresh ports (not counted against --max-restarts 0)."""
    started = time.monotonic()
    result = run_job("port_clash_job.py", tmp_path, "take", timeout=120)
    assert result.returncode == 0, result.output[-3000:]
    assert "UnknownError: Could not start gRPC server" in result.output
    assert re.search(r"worker 1 exited with code 1: port 127\.0\.0\.1:\d+ was taken by another process before tfdist's "
                     r"worker could listen there; retrying on fresh ports \(1/3\)", result.output), result.output
    assert "[0] worker 0 joined 2 replicas" in result.output and "[1] worker 1 joined 2 replicas" in result.output
    assert sorted((tmp_path / "starts").read_text().split()) == ["0", "0", "1", "1"]
    assert time.monotonic() - started < 90


def test_a_taken_port_under_fixed_ports_ends_the_job_naming_it(tmp_path):
    port, holder = _two_ports_the_second_held()
    try:
        result = run_job("port_clash_job.py", tmp_path, timeout=120, launcher_args=("--port", str(port)))
    finally:
        holder.close()
    assert result.returncode == 1, result.output[-3000:]
    assert (f"worker 1 exited with code 1: port 127.0.0.1:{port + 1} was taken by another process before tfdist's "
            "worker could listen there (free it, or give another --port); stopped all workers (2 worker(s)") \
        in result.output, result.output[-3000:]
    assert sorted((tmp_path / "starts").read_text().split()) == ["0", "1"]


def _two_ports_the_second_held() -> tuple[int, socket.socket]:
    """A free port P, and a listening socket on P+1 (127.0.0.1, no SO_REUSEADDR)."""
    while True:
        port = local.free_ports(1)[0]
        holder = socket.socket()
        try:
            holder.bind(("127.0.0.1", port + 1))
        except (OSError, OverflowError):  # taken, or past 65535
            holder.close()
            continue
        holder.listen()
        return port, holder
