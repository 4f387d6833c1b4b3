"""What does sharding the optimizer state (``shard_optimizer_state=True``, ZeRO-1) save, and what does it cost?

A model whose Adam state dominates (an MLP of about 25M float32 parameters: 100 MB of weights, 200 MB
of Adam moments) at a small batch. Each round runs two ``tfdist run -n N`` jobs, sharded and whole, in
alternating order, and prints per worker:

* the optimizer state one replica holds (``tfdist.optimizer_state_bytes``),
* the peak resident memory of the worker process (``ru_maxrss`` when ``fit`` returns) and the most
  bytes TensorFlow's allocator held at once (its BFC allocator's peak: tensors and variables), and
* ms/step over the last half of the steps, and the seconds a ``save_weights`` takes (a sharded save
  gathers the slots: what a preemption's grace period must hold);

then the peak memory saved as a fraction of the whole optimizer state (the goal: >= 40% at 2 workers)
and the sharded/whole step-time ratio. ``--devices N`` does the same in one process over N logical CPUs.

    python benchmarks/sharded_state.py --workers 2 --rounds 3
    python benchmarks/sharded_state.py --devices 4 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
BATCH = 16


def worker(out: str, shard: bool, steps: int, devices: int, width: int, depth: int) -> None:
    """One worker (or, with ``devices``, one process of that many replicas): fit, then its figures."""
    import tensorflow as tf

    if devices:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * devices)
    import keras
    import numpy as np

    import tfdist

    scope = {"devices": f"CPU:[0-{devices - 1}]", "strategy": "mirrored"} if devices else {}
    with tfdist.scope(shard_optimizer_state=shard, **scope) as strategy:
        model = keras.Sequential([keras.Input((width,))] + [keras.layers.Dense(width) for _ in range(depth)])
        model.compile(keras.optimizers.Adam(1e-4), "mse")
    x = np.random.default_rng(0).normal(size=(BATCH * steps, width)).astype("float32")
    times = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter())

    model.fit(x, x, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[Clock()])
    half = times[len(times) // 2:]
    rank = int(os.environ.get("TFDIST_WORKER_INDEX", "0"))
    peak_rss, peak_tensors = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, _peak_tensor_bytes(tf)
    start = time.perf_counter()  # every worker saves (a sharded save gathers the slots), each to its own file
    model.save_weights(f"{out}.{rank}.weights.h5")
    save_seconds = time.perf_counter() - start
    os.remove(f"{out}.{rank}.weights.h5")
    pathlib.Path(f"{out}.{rank}").write_text(json.dumps({
        "state_bytes": tfdist.optimizer_state_bytes(model.optimizer),
        "peak_rss_bytes": peak_rss,  # training's peak; the save's own is below
        "peak_tensor_bytes": peak_tensors,
        "peak_rss_after_save_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "ms_per_step": 1000 * (half[-1] - half[0]) / (len(half) - 1),
        "save_seconds": save_seconds,
        "replicas": strategy.num_replicas_in_sync}))


def _peak_tensor_bytes(tf) -> int | None:
    """The most bytes TensorFlow's CPU allocator held at once (its BFC allocator, which tfdist turns on in workers)."""
    try:
        return tf.config.experimental.get_memory_info("CPU:0")["peak"]
    except ValueError:  # the default CPU allocator keeps no statistics
        return None


def run(shard: bool, args) -> list[dict]:
    workers, devices, steps = args.workers, args.devices, args.steps
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        job = [sys.executable, __file__, "--worker", out, "--shard", str(int(shard)), "--steps", str(steps),
               "--devices", str(devices), "--width", str(args.width), "--depth", str(args.depth)]
        command = job if devices else [sys.executable, "-m", "tfdist.run", "-n", str(workers), "--timeout", "1200",
                                       "--", *job]
        subprocess.run(command, env=env, check=True, capture_output=True)
        return [json.loads(path.read_text()) for path in sorted(pathlib.Path(tmp).glob("result.[0-9]"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="worker processes of a tfdist run job")
    parser.add_argument("--devices", type=int, default=0, help="instead: one process of this many logical CPUs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=2048, help="units of each Dense layer (and of the input)")
    parser.add_argument("--depth", type=int, default=6, help="Dense layers (6 x 2048: 25.2M parameters)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, bool(args.shard), args.steps, args.devices, args.width, args.depth)
        return
    what = f"{args.devices} logical CPUs in one process" if args.devices else f"{args.workers} workers"
    print(f"sharded vs whole Adam state, {what}, {args.steps} steps of batch {BATCH}, {args.depth} x Dense({args.width})")
    saved, tensors_saved, ratios = [], [], []
    for index in range(args.rounds):
        order = (True, False) if index % 2 == 0 else (False, True)
        figures = {shard: run(shard, args) for shard in order}
        whole_state = figures[False][0]["state_bytes"]
        for rank, (on, off) in enumerate(zip(figures[True], figures[False])):
            saved.append((off["peak_rss_bytes"] - on["peak_rss_bytes"]) / whole_state)
            if on["peak_tensor_bytes"] is not None:
                tensors_saved.append((off["peak_tensor_bytes"] - on["peak_tensor_bytes"]) / whole_state)
            ratios.append(on["ms_per_step"] / off["ms_per_step"])
            print(f"round {index + 1} ({'sharded' if order[0] else 'whole'} first) process {rank}: state "
                  f"{on['state_bytes'] / 2**20:.1f} MB sharded / {off['state_bytes'] / 2**20:.1f} MB whole "
                  f"({on['state_bytes'] / off['state_bytes']:.3f}); peak RSS {on['peak_rss_bytes'] / 2**20:.0f} MB / "
                  f"{off['peak_rss_bytes'] / 2**20:.0f} MB: saved {saved[-1]:.2f} of the whole state"
                  + (f" (TensorFlow's peak tensor bytes: saved {tensors_saved[-1]:.2f})" if tensors_saved else "")
                  + "; "
                  f"{on['ms_per_step']:.1f} / {off['ms_per_step']:.1f} ms/step ({ratios[-1]:.3f})"
                  + f"; save_weights {on['save_seconds']:.2f} s / {off['save_seconds']:.2f} s, peak RSS after it "
                  f"{on['peak_rss_after_save_bytes'] / 2**20:.0f} MB / {off['peak_rss_after_save_bytes'] / 2**20:.0f} MB",
                  flush=True)
    if tensors_saved:
        print(f"peak tensor bytes saved, as a fraction of the whole optimizer state: median "
              f"{statistics.median(tensors_saved):.2f} (min {min(tensors_saved):.2f}, max {max(tensors_saved):.2f})")
    print(f"peak RSS saved, as a fraction of the whole optimizer state: median {statistics.median(saved):.2f} "
          f"(min {min(saved):.2f}, max {max(saved):.2f}); step time sharded/whole: median "
          f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
