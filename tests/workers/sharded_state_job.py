"""Optimizer state sharded over the workers: `sharded_state_job.py OUT_DIR PHASE [PEER]`.

train: ``common.resumable_model(use_ema=True)`` (Adam on a decaying learning rate, moving averages) under
``tfdist.scope(shard_optimizer_state=True)``, ``SHARDED_EPOCHS`` epochs of ``SHARDED_STEPS`` global
batches, with a ModelCheckpoint to OUT_DIR/model.keras at each epoch's end (every worker saves; the
chief's file is kept). resume: the same scope loads OUT_DIR/model.keras and trains one epoch more.
chief_saves PEER: trains one epoch, then worker 0 saves OUT_DIR/model.keras and writes the error it got (or None)
and the seconds its save took, while worker 1, per PEER: ``exits`` at once (``vanishes``: with os._exit, no atexit
hook); ``sleeps`` until worker 0 has written its result; ``saves`` too (every worker saves twice, model.save then
save_weights, each to a path of its own); ``freezes``: sleeps 3 s, then holds Python's lock 20 s (no thread of it
runs), then saves; ``late``: saves 13 s after fit (worker 0 gave up on it after 10 s, and stays until worker 1 is
done); ``late_alone``: saves once worker 0 (which exits once its save failed) is gone, with the job's store;
``trains`` a second epoch, which worker 0 joins once its save failed, and then every worker saves (each to a path of
its own).
chief_checkpoints: trains ``SHARDED_EPOCHS`` epochs with a ModelCheckpoint on worker 0 only (Horovod's idiom);
worker 0 writes the error its fit raised and the seconds the fit took.
Each worker writes its weights, iterations, whether the optimizer is sharded, its state's bytes and
the replicas to worker<rank>.json. (Run by tests/test_sharded_state_multi_worker.py.)
"""

import ctypes
import json
import os
import pathlib
import sys
import time

import keras
import tensorflow as tf

import tfdist
from tests.workers import common
from tfdist import save_rounds
from tfdist.keras_fixes import sharded_state

out_dir, phase = sys.argv[1], sys.argv[2]
checkpoint = os.path.join(out_dir, "model.keras")
x, y = common.regression_data(common.GLOBAL_BATCH * common.SHARDED_STEPS)
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH)
with tfdist.scope(shard_optimizer_state=True) as strategy:
    model = keras.models.load_model(checkpoint) if phase == "resume" else common.resumable_model(use_ema=True)
chief_checkpoints = phase == "chief_checkpoints" and tfdist.rank() == 0
callbacks = [keras.callbacks.ModelCheckpoint(checkpoint)] if phase == "train" or chief_checkpoints else []
began = time.monotonic()
try:
    model.fit(data, epochs=1 if phase in ("resume", "chief_saves") else common.SHARDED_EPOCHS, verbose=0,
              callbacks=callbacks)
except tfdist.ShardingError as error:
    common.write_result(out_dir, {"error": str(error), "seconds": time.monotonic() - began})
    sys.exit(0)


def timed_save(path: str) -> dict:
    """Saves to ``path`` (``.weights.h5``: save_weights): the ShardingError's message (None without one), and the
    seconds the save took."""
    began = time.monotonic()
    try:
        (model.save_weights if path.endswith(".weights.h5") else model.save)(path)
        error = None
    except tfdist.ShardingError as raised:
        error = str(raised)
    return {"error": error, "seconds": time.monotonic() - began}


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for_result(rank: int) -> None:
    """Returns once worker ``rank`` wrote its result (at most 200 s)."""
    deadline = time.monotonic() + 200
    while not pathlib.Path(out_dir, f"worker{rank}.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)


if phase == "chief_saves":
    peer, own_path = sys.argv[3], os.path.join(out_dir, f"model-{tfdist.rank()}.keras")

    def weights() -> dict:
        return {"weights": [w.tolist() for w in model.get_weights()]}

    if tfdist.rank() == 0:
        result = timed_save(checkpoint)
        if peer == "late":  # stays (with the store) until worker 1 is done
            wait_for_result(1)
        if peer in ("saves", "freezes"):
            result["second"] = timed_save(os.path.join(out_dir, "model.weights.h5"))
        if peer == "trains":
            model.fit(data, epochs=1, verbose=0)
            result["second"] = timed_save(checkpoint)
        common.write_result(out_dir, {**result, **weights(), "pid": os.getpid()})
    elif peer in ("exits", "vanishes"):
        common.write_result(out_dir, {"error": None})
        if peer == "vanishes":
            os._exit(0)  # no atexit hook runs
    elif peer == "sleeps":
        wait_for_result(0)
        common.write_result(out_dir, {"error": None})
    elif peer in ("saves", "freezes", "late", "late_alone"):
        if peer == "freezes":  # beats for 3 s (alive, outside fit), then freezes
            time.sleep(3)
            ctypes.PyDLL(None).sleep(20)  # a PyDLL call keeps Python's lock: no thread of this process runs Python
        if peer == "late":
            time.sleep(save_rounds.SKEW_S + 3)
        if peer == "late_alone":  # once worker 0's process is gone
            wait_for_result(0)
            left = time.monotonic()
            while process_exists(json.loads(pathlib.Path(out_dir, "worker0.json").read_text())["pid"]):
                time.sleep(0.1)
            exit_took = time.monotonic() - left
        result = timed_save(own_path)
        if not peer.startswith("late"):
            result["second"] = timed_save(own_path.replace(".keras", ".weights.h5"))
        if peer == "late_alone":
            result["worker_0_exit_took"] = exit_took
        common.write_result(out_dir, {**result, **weights()})
    elif peer == "trains":
        model.fit(data, epochs=1, verbose=0)
        common.write_result(out_dir, {**timed_save(own_path), **weights()})
    sys.exit(0)
common.write_result(out_dir, {"weights": [w.tolist() for w in model.get_weights()],
                              "iterations": int(model.optimizer.iterations.numpy()),
                              "sharded": sharded_state.is_sharded(model.optimizer),
                              "state_bytes": tfdist.optimizer_state_bytes(model.optimizer),
                              "replicas": strategy.num_replicas_in_sync})
