"""What does sharding the optimizer state (``shard_optimizer_state=True``, ZeRO-1) save, and what does it cost?

A model whose Adam state dominates (an MLP of about 25M float32 parameters: 100 MB of weights, 200 MB
of Adam moments) at a small batch. Each round runs two ``tfdist run -n N`` jobs, sharded and whole, in
alternating order, and prints per worker:

* the optimizer state one replica holds (``tfdist.optimizer_state_bytes``),
* the peak resident memory of the worker process (``ru_maxrss`` when ``fit`` returns) and the most
  bytes TensorFlow's allocator held at once (its BFC allocator's peak: tensors and variables), and
* ms/step over the last half of the steps, then the seconds and the peak resident memory after a
  ``tfdist.CheckpointManager`` save (each worker writes its own part) and after a ``save_weights``
  (a sharded one gathers the slots);

then the peak memory saved as a fraction of the whole optimizer state (the goal: >= 40% at 2 workers)
and the sharded/whole step-time ratio. ``--devices N`` does the same in one process over N logical CPUs.

The workers talk over loopback (``tfdist run -n N`` on 127.0.0.1), unless ``--rate`` is given: then the 2
workers run in two Linux network namespaces joined by a veth pair (tests/netns.py), one each, with both veth
ends shaped to that rate by ``tc ... tbf`` (``none``: unshaped veth), as benchmarks/overlap.py does; that
needs root. A sharded step sends the all-reduce's bytes and an all-gather's (half of them at 2 workers).

    python benchmarks/sharded_state.py --workers 2 --rounds 3
    python benchmarks/sharded_state.py --devices 4 --rounds 2
    sudo python benchmarks/sharded_state.py --workers 2 --rounds 3 --rate 1gbit
"""

from __future__ import annotations

import argparse
import itertools
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
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

from benchmarks import overlap  # noqa: E402

BATCH = 16
PORT = 29960  # the master's port of a job over veth (inside the namespaces), one more each job


def worker(out: str, shard: bool, steps: int, devices: int, width: int, depth: int) -> None:
    """One worker (or, with ``devices``, one process of that many replicas): fit, then its figures in
    ``out``/result.<rank>."""
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
    start = time.perf_counter()  # every worker writes its own part: its shards and its share of the weights
    tfdist.CheckpointManager(os.path.join(out, "checkpoints"), async_save=False).save(model)
    manager_seconds = time.perf_counter() - start
    peak_after_manager = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()  # every worker saves (a sharded save gathers the slots), each to its own file
    model.save_weights(os.path.join(out, f"{rank}.weights.h5"))
    save_seconds = time.perf_counter() - start
    os.remove(os.path.join(out, f"{rank}.weights.h5"))
    pathlib.Path(out, f"result.{rank}").write_text(json.dumps({
        "state_bytes": tfdist.optimizer_state_bytes(model.optimizer),
        "peak_rss_bytes": peak_rss,  # training's peak; the save's own is below
        "peak_tensor_bytes": peak_tensors,
        "peak_rss_after_manager_bytes": peak_after_manager,  # CheckpointManager's save, before save_weights
        "manager_seconds": manager_seconds,
        "peak_rss_after_save_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "ms_per_step": 1000 * (half[-1] - half[0]) / (len(half) - 1),
        "save_seconds": save_seconds,
        "weight_bytes": sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.trainable_variables),
        "replicas": strategy.num_replicas_in_sync}))


def _peak_tensor_bytes(tf) -> int | None:
    """The most bytes TensorFlow's CPU allocator held at once (its BFC allocator, which tfdist turns on in workers)."""
    try:
        return tf.config.experimental.get_memory_info("CPU:0")["peak"]
    except ValueError:  # the default CPU allocator keeps no statistics
        return None


def run(shard: bool, args, hosts=None, port: int = PORT) -> list[dict]:
    """One job, sharded or whole: on loopback, or with ``hosts`` one worker in each namespace over the veth link;
    returns every process's figures, by rank."""
    workers, devices, steps = args.workers, args.devices, args.steps
    job = [__file__, "--worker", "--shard", str(int(shard)), "--steps", str(steps), "--devices", str(devices),
           "--width", str(args.width), "--depth", str(args.depth)]
    with tempfile.TemporaryDirectory() as tmp:
        if hosts:
            outputs = overlap.launch_in(tmp, job, workers, hosts, "veth", port, timeout=1200)
        else:
            env = {**os.environ,
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
            command = [sys.executable, *job, "--out", tmp]
            if not devices:
                command = [sys.executable, "-m", "tfdist.run", "-n", str(workers), "--timeout", "1200", "--", *command]
            ran = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            outputs = [ran.stdout]
        results = sorted(pathlib.Path(tmp).glob("result.[0-9]"))
        if len(results) != (1 if devices else workers):
            raise RuntimeError(f"the {'sharded' if shard else 'whole'} job wrote {len(results)} of "
                               f"{1 if devices else workers} results:\n" + "\n".join(o[-3000:] for o in outputs))
        return [json.loads(path.read_text()) for path in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="worker processes of a tfdist run job")
    parser.add_argument("--devices", type=int, default=0, help="instead: one process of this many logical CPUs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=2048, help="units of each Dense layer (and of the input)")
    parser.add_argument("--depth", type=int, default=6, help="Dense layers (6 x 2048: 25.2M parameters)")
    parser.add_argument("--rate", help="2 workers on a veth link between 2 network namespaces, both ends shaped "
                                       "to this tbf rate (e.g. 1gbit, 500mbit; none: unshaped); needs root "
                                       "(default: loopback)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.out, bool(args.shard), args.steps, args.devices, args.width, args.depth)
        return
    if args.rate is not None and (args.rate != "none" and overlap.rate_bits(args.rate) is None):
        parser.error(f"--rate takes a tbf rate such as 1gbit or 500mbit, or none (unshaped veth); received "
                     f"{args.rate!r}.")
    if args.rate is not None and (args.devices or args.workers != 2):
        parser.error(f"--rate runs 2 workers, one in each of 2 network namespaces: drop --devices and keep "
                     f"--workers 2; received --workers {args.workers}, --devices {args.devices}.")
    if args.rate is None:
        rounds(args)
        return
    from tests import netns

    reason = netns.unavailable()
    if reason:
        sys.exit(f"sharded_state.py --rate needs network namespaces: {reason}")
    with netns.hosts(prefix="tfzs") as hosts:
        overlap.shape(hosts, args.rate)
        rounds(args, hosts)


def rounds(args, hosts=None) -> None:
    """Runs and prints ``args.rounds`` rounds of a sharded and a whole job, in alternating order; then the medians."""
    what = f"{args.devices} logical CPUs in one process" if args.devices else f"{args.workers} workers"
    link = "" if args.devices else "; " + overlap.link_label("veth" if hosts else "loopback", args.rate or "none")
    print(f"sharded vs whole Adam state, {what}, {args.steps} steps of batch {BATCH}, {args.depth} x Dense({args.width})"
          + link, flush=True)
    saved, tensors_saved, ratios = [], [], []
    ports = itertools.count(PORT)
    for index in range(args.rounds):
        order = (True, False) if index % 2 == 0 else (False, True)
        figures = {shard: run(shard, args, hosts, next(ports)) for shard in order}
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
                  + f"; CheckpointManager save {on['manager_seconds']:.2f} s / {off['manager_seconds']:.2f} s, peak RSS "
                  f"after it {on['peak_rss_after_manager_bytes'] / 2**20:.0f} MB / "
                  f"{off['peak_rss_after_manager_bytes'] / 2**20:.0f} MB"
                  + f"; save_weights {on['save_seconds']:.2f} s / {off['save_seconds']:.2f} s, peak RSS after it "
                  f"{on['peak_rss_after_save_bytes'] / 2**20:.0f} MB / {off['peak_rss_after_save_bytes'] / 2**20:.0f} MB",
                  flush=True)
    if tensors_saved:
        print(f"peak tensor bytes saved, as a fraction of the whole optimizer state: median "
              f"{statistics.median(tensors_saved):.2f} (min {min(tensors_saved):.2f}, max {max(tensors_saved):.2f})")
    print(f"peak RSS saved, as a fraction of the whole optimizer state: median {statistics.median(saved):.2f} "
          f"(min {min(saved):.2f}, max {max(saved):.2f}); step time sharded/whole: median "
          f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    bits = hosts and overlap.rate_bits(args.rate)
    if bits:  # a ring all-reduce on 2 workers sends the whole gradient each way, the all-gather half of it
        wire_ms = figures[False][0]["weight_bytes"] * 8 / bits * 1000
        print(f"wire time of one step at {args.rate}: all-reduce {wire_ms:.0f} ms (whole), all-reduce + all-gather "
              f"{1.5 * wire_ms:.0f} ms (sharded)")


if __name__ == "__main__":
    main()
