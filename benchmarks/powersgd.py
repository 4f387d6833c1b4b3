"""PowerSGD against exact and fp16 all-reduce: 2 one-core workers vs 1 on a shaped link, and convergence.

    sudo python benchmarks/powersgd.py --rate 1gbit --jobs 2 --rounds 5
    sudo python benchmarks/powersgd.py --rate 500mbit --jobs 2 --rounds 5
    python benchmarks/powersgd.py --convergence --steps 600

Throughput (issue 52): the network, CNN, batch (64 per worker), synthetic data and timing of
benchmarks/side_by_side.py, whose helpers this imports (``overlap.launch``, ``overlap.shape``:
two network namespaces joined by a veth pair shaped with ``tc ... tbf`` on both ends; one
worker per namespace pinned to its own core, one intra-op thread). One 2-worker job builds a
model per setup:

* ``exact``: tfdist's defaults in float32 (bucket autotune off, ``TFDIST_AUTOTUNE=0``: its trial
  steps would land in the timed windows of the other models);
* ``fp16``: ``DistributedOptimizer(compression=Compression.fp16)``;
* ``powersgd rR`` for each ``--ranks`` R: ``DistributedOptimizer(compression=Compression.powersgd(
  rank=R, start_step=--start-step))`` (default ``min_compression_rate`` 2), warmed up past its
  start step, so every timed step is compressed.

After ``--warmup`` steps each, every round times ``--window`` steps of every model in turn, in
alternating order (one ``fit`` of 2 epochs of ``--window`` steps, timed over the second: not
``fit``'s setup nor the epoch that makes the dataset iterator). Before each 2-worker job a
1-worker job (first namespace) times one float32 model the same way: the baseline. Prints every
round of every job (images/s and the ratio to the 1-worker job's median), then per setup the
median images/s, the median ratio, worker 0's CPU ms per step, and the bytes each worker
all-reduces per step, from the model's weight shapes (``bytes_per_step``): for a compressed
kernel viewed as ``[n, m]`` (all dimensions but the last, by the last) ``r * (2n + m)`` numbers
(P's two halves with the rest and the example count, then Q), every other weight ``n * m`` (its
size), 4 bytes a number (2 for fp16); and that payload's wire time at ``--rate``.

Convergence (``--convergence``, one process, 2 logical CPU devices, no network): the same CNN on a
generated, learnable 10-class image task (each class a smooth random template, shifted and under
noise), ``--steps`` steps at global batch 64 with SGD + momentum, exact vs PowerSGD rank
``--rank``, the same data order; prints the mean training loss of every ``--every`` steps side by
side, then each run's final held-out loss and accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import overlap  # noqa: E402

PORT = 29950
LR, MOMENTUM = 0.01, 0.9


def setup_names(ranks: list[int]) -> list[str]:
    return ["exact", "fp16", *(f"powersgd r{rank}" for rank in ranks)]


def rank_of(setup: str) -> int | None:
    return int(setup.removeprefix("powersgd r")) if setup.startswith("powersgd r") else None


def bytes_per_step(shapes: list[tuple[int, ...]], setup: str) -> int:
    """Bytes one worker all-reduces per step under ``setup`` for weights of these ``shapes``.

    PowerSGD: a kernel it compresses (``PowerSGD.matrix_shape``, the optimizer's own rule) sends
    P ``[n, r]`` twice (``fit``'s gradients are sums over each worker's examples: their product
    with Q and the error feedback's travel apart, ``PowerSGD.reduce_with``) and Q ``[m, r]``, r
    capped at min(n, m); every other weight its size; and the step's example count (one number).
    4 bytes a number, 2 under fp16.
    """
    from tfdist.compression import Compression

    rank = rank_of(setup)
    compression = Compression.powersgd(rank=rank, start_step=0) if rank else None
    numbers = 0
    for shape in shapes:
        size = 1
        for dim in shape:
            size *= dim
        matrix = compression.matrix_shape(shape, "float32") if compression else None
        if matrix:
            n, m = matrix
            numbers += min(rank, n, m) * (2 * n + m)
        else:
            numbers += size
    return (numbers + (1 if rank else 0)) * (2 if setup == "fp16" else 4)


def compressed_count(shapes: list[tuple[int, ...]], rank: int) -> int:
    from tfdist.compression import Compression

    compression = Compression.powersgd(rank=rank, start_step=0)
    return sum(compression.matrix_shape(shape, "float32") is not None for shape in shapes)


def weight_shapes() -> list[tuple[int, ...]]:
    return [tuple(v.shape) for v in overlap.build_model().trainable_variables]


# Throughput ------------------------------------------------------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    """One worker: a model per setup (1 worker: the float32 baseline only), warm-up, rounds of timed windows; the
    chief writes result.json."""
    rank = int(os.environ["TFDIST_WORKER_INDEX"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    os.environ["TFDIST_AUTOTUNE"] = "0"
    import keras
    import tensorflow as tf

    import tfdist

    class StepClock(keras.callbacks.Callback):
        """Wall and CPU seconds of a fit call's last epoch."""

        def on_epoch_begin(self, epoch, logs=None):
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds, self.cpu = time.perf_counter() - self.start, time.process_time() - self.cpu_start

    tf.config.threading.set_intra_op_parallelism_threads(1)
    strategy = tfdist.get_strategy()
    workers = strategy.num_replicas_in_sync  # one replica a worker
    data = overlap.synthetic_data(workers)

    def model(setup: str):
        with strategy.scope():
            built = overlap.build_model()
            optimizer = keras.optimizers.SGD(LR, momentum=MOMENTUM)
            if setup == "fp16":
                optimizer = tfdist.DistributedOptimizer(optimizer, compression=tfdist.Compression.fp16)
            elif rank_of(setup):
                optimizer = tfdist.DistributedOptimizer(optimizer, compression=tfdist.Compression.powersgd(
                    rank=rank_of(setup), start_step=args.start_step))
            built.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return built

    names = ["1 worker"] if workers == 1 else setup_names(args.ranks)
    models, compressed = {}, {}
    for name in names:
        models[name] = model("exact" if name == "1 worker" else name)
        models[name].fit(data, epochs=1, steps_per_epoch=args.warmup, verbose=0)
        compressed[name] = len(getattr(models[name].optimizer, "_tfdist_powersgd", {}))
    clock = StepClock()
    rounds, cpu = [], []
    for number in range(args.rounds):
        times, cpu_times = {}, {}
        for name in (names if number % 2 == 0 else names[::-1]):
            models[name].fit(data, epochs=2, steps_per_epoch=args.window, verbose=0, callbacks=[clock])
            times[name], cpu_times[name] = 1000 * clock.seconds / args.window, 1000 * clock.cpu / args.window
        rounds.append(times)
        cpu.append(cpu_times)
    if rank == 0:
        pathlib.Path(args.out, "result.json").write_text(json.dumps(
            {"rounds": rounds, "cpu": cpu, "compressed": compressed}))


def report(title: str, results: list[dict], one_worker_ms: list[float], args: argparse.Namespace) -> None:
    """Per setup: median images/s and ratio to 1 worker (each job's rounds against its own 1-worker median), CPU,
    bytes per step and their wire time."""
    names = setup_names(args.ranks)
    shapes = weight_shapes()
    bits = overlap.rate_bits(args.rate) if args.link == "veth" else None
    one_ips = [overlap.BATCH * 1000 / ms for ms in one_worker_ms]
    print(f"\n{title}: images/s (median over {sum(len(r['rounds']) for r in results)} rounds), 1 worker "
          f"{statistics.median(one_ips):.0f} images/s")
    header = f"{'setup':<14}{'images/s':>9}{'x 1 worker':>11}{'cpu ms':>8}{'bytes/step':>12}"
    print(header + (f"{'wire ms':>9}" if bits else "") + "   x 1 worker, every round")
    exact_bytes = bytes_per_step(shapes, "exact")
    for name in names:
        ips = [2 * overlap.BATCH * 1000 / r[name] for result in results for r in result["rounds"]]
        ratios = [2 * one / r[name] for result, one in zip(results, one_worker_ms) for r in result["rounds"]]
        cpu = statistics.median(c[name] for result in results for c in result["cpu"])
        nbytes = bytes_per_step(shapes, name)
        line = (f"{name:<14}{statistics.median(ips):>9.0f}{statistics.median(ratios):>10.2f}x{cpu:>8.1f}"
                f"{nbytes:>12,}")
        if bits:
            line += f"{nbytes * 8 / bits * 1000:>9.2f}"
        print(line + "   " + ", ".join(f"{r:.2f}" for r in ratios))
    print("bytes/step: what each worker all-reduces per step (payload); exact "
          f"{exact_bytes:,}: " + ", ".join(f"{name} {exact_bytes / bytes_per_step(shapes, name):.1f}x fewer"
                                         for name in names[1:]))


def throughput(args: argparse.Namespace) -> None:
    from tests import netns

    reason = netns.unavailable()
    if reason:
        sys.exit(f"powersgd.py needs network namespaces (or run --convergence): {reason}")
    shapes = weight_shapes()
    job = [str(pathlib.Path(__file__).resolve()), "--job", "--rounds", str(args.rounds), "--window",
           str(args.window), "--warmup", str(args.warmup), "--start-step", str(args.start_step),
           "--ranks", ",".join(map(str, args.ranks))]
    print(f"{overlap.link_label(args.link, args.rate)}; CNN of benchmarks/overlap.py, batch {overlap.BATCH} a worker; "
          f"{args.window} steps a window after {args.warmup} warm-up steps; PowerSGD start_step {args.start_step}; "
          f"2 workers, one core each", flush=True)
    for rank in args.ranks:
        print(f"  powersgd r{rank} compresses {compressed_count(shapes, rank)} of the "
              f"{sum(len(s) >= 2 for s in shapes)} kernels")
    results, one_worker = [], []
    names = setup_names(args.ranks)
    with netns.hosts(prefix="tfps") as hosts:
        if args.link == "veth":
            overlap.shape(hosts, args.rate)
        for number in range(args.jobs):
            one = overlap.launch(job, 1, hosts, args.link, PORT, timeout=args.timeout)
            one_worker.append(statistics.median(r["1 worker"] for r in one["rounds"]))
            one_ips = overlap.BATCH * 1000 / one_worker[-1]
            print(f"\njob {number + 1}, 1 worker: {one_ips:.0f} images/s ({one_worker[-1]:.1f} ms a step; rounds: "
                  + ", ".join(f"{overlap.BATCH * 1000 / r['1 worker']:.0f}" for r in one["rounds"]) + ")", flush=True)
            two = overlap.launch(job, 2, hosts, args.link, PORT + 1 + number, timeout=args.timeout)
            results.append(two)
            for name in names:
                if rank_of(name) and two["compressed"][name] != compressed_count(shapes, rank_of(name)):
                    print(f"  WARNING: {name} compressed {two['compressed'][name]} kernels, bytes_per_step assumes "
                          f"{compressed_count(shapes, rank_of(name))}")
            for index, r in enumerate(two["rounds"]):
                order = names if index % 2 == 0 else names[::-1]
                cells = [f"{name} {2 * overlap.BATCH * 1000 / r[name]:.0f} ({2 * one_worker[-1] / r[name]:.2f}x)"
                         for name in order]
                print(f"job {number + 1}, round {index + 1} ({'forward' if index % 2 == 0 else 'reverse'} order): "
                      + ", ".join(cells), flush=True)
            report(f"job {number + 1}", [two], [one_worker[-1]], args)
    if args.jobs > 1:
        report(f"every job's rounds together ({args.jobs} jobs)", results, one_worker, args)


# Convergence ------------------------------------------------------------------------------------------------------

def image_task(examples: int, seed: int, classes: int = 10):
    """Generated 32x32x3 images: class c is a fixed smooth random template (the same for every seed), shifted by
    up to 4 pixels, scaled, under Gaussian noise. Learnable, not trivially: returns (images, labels)."""
    import numpy as np

    templates_rng = np.random.default_rng(1234)
    coarse = templates_rng.normal(size=(classes, 8, 8, 3))
    templates = coarse.repeat(4, axis=1).repeat(4, axis=2)  # 32x32, smooth at 4-pixel scale
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, size=examples)
    shifts = rng.integers(-4, 5, size=(examples, 2))
    scale = rng.uniform(0.5, 1.5, size=(examples, 1, 1, 1))
    images = np.stack([np.roll(templates[label], tuple(shift), axis=(0, 1)) for label, shift in zip(labels, shifts)])
    images = scale * images + rng.normal(scale=2.0, size=images.shape)
    return images.astype("float32"), labels.astype("int32")


def convergence(args: argparse.Namespace) -> None:
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    os.environ.setdefault("TFDIST_AUTOTUNE", "0")
    import keras

    import tfdist

    strategy = tfdist.get_strategy("mirrored", devices="CPU:[0-1]")
    global_batch = 2 * args.batch
    x, y = image_task(args.examples, seed=0)
    x_test, y_test = image_task(2000, seed=1)
    chunks = max(1, args.steps // args.every)
    runs = {"exact": tfdist.Compression.none,
            f"powersgd r{args.rank}": tfdist.Compression.powersgd(rank=args.rank, start_step=args.start_step)}
    print(f"convergence: CNN of benchmarks/overlap.py, {args.examples} generated training images (10 classes), "
          f"2000 held out; {chunks * args.every} steps at global batch {global_batch} on 2 logical CPU devices, "
          f"SGD({LR}, momentum={MOMENTUM}); PowerSGD start_step {args.start_step}", flush=True)
    curves, finals = {}, {}
    for name, compression in runs.items():
        data = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=7).repeat().batch(global_batch))
        with strategy.scope():
            keras.utils.set_random_seed(11)
            model = overlap.build_model()
            model.compile(tfdist.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=MOMENTUM),
                                                      compression=compression),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        start = time.perf_counter()
        history = model.fit(data, epochs=chunks, steps_per_epoch=args.every, verbose=0)
        seconds = time.perf_counter() - start
        curves[name] = history.history["loss"]
        loss, accuracy = model.evaluate(x_test, y_test, batch_size=500, verbose=0)
        finals[name] = {"loss": loss, "accuracy": accuracy, "train_accuracy": history.history["accuracy"][-1],
                        "seconds": seconds}
        print(f"  {name}: {seconds:.0f} s", flush=True)
    names = list(runs)
    print(f"\nmean training loss of each {args.every} steps:")
    print(f"{'steps':>7}" + "".join(f"{name:>16}" for name in names))
    for index in range(chunks):
        print(f"{(index + 1) * args.every:>7}" + "".join(f"{curves[name][index]:>16.4f}" for name in names))
    print(f"\n{'final':<16}{'held-out loss':>14}{'accuracy':>10}{'train acc':>10}")
    for name in names:
        print(f"{name:<16}{finals[name]['loss']:>14.4f}{finals[name]['accuracy']:>10.4f}"
              f"{finals[name]['train_accuracy']:>10.4f}")
    gap = 100 * (finals[names[1]]["accuracy"] - finals["exact"]["accuracy"])
    print(f"{names[1]} - exact: {gap:+.2f} accuracy points")


def ranks_arg(raw: str) -> list[int]:
    ranks = [int(part) for part in raw.split(",") if part.strip()]
    if not ranks or any(rank < 1 for rank in ranks):
        raise argparse.ArgumentTypeError(f"--ranks takes ints >= 1 separated by commas; received {raw!r}")
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link", choices=("veth", "loopback"), default="veth")
    parser.add_argument("--rate", default="1gbit", help="tbf rate on both veth ends (e.g. 1gbit, 500mbit) or none")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=int, default=64, help="steps timed per setup and round")
    parser.add_argument("--warmup", type=int, default=32, help="steps of each model before the rounds")
    parser.add_argument("--start-step", type=int, default=10, help="PowerSGD's exact warm-up steps")
    parser.add_argument("--ranks", type=ranks_arg, default=[1, 2, 4, 8])
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a job may take")
    parser.add_argument("--convergence", action="store_true", help="exact vs PowerSGD on a learnable task instead")
    parser.add_argument("--steps", type=int, default=600, help="--convergence: training steps")
    parser.add_argument("--every", type=int, default=25, help="--convergence: steps per point of the loss curve")
    parser.add_argument("--rank", type=int, default=4, help="--convergence: PowerSGD's rank")
    parser.add_argument("--batch", type=int, default=32, help="--convergence: batch per device (2 devices)")
    parser.add_argument("--examples", type=int, default=8192, help="--convergence: training images")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for flag in ("jobs", "rounds", "window", "warmup", "steps", "every", "rank", "batch", "examples"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1; received {getattr(args, flag)}.")
    if args.start_step < 0:
        parser.error(f"--start-step must be >= 0; received {args.start_step}.")
    if not args.convergence and args.warmup <= args.start_step:
        parser.error(f"--warmup ({args.warmup}) must pass --start-step ({args.start_step}): the timed steps must "
                     "be compressed.")
    if args.job:
        worker(args)
    elif args.convergence:
        convergence(args)
    else:
        throughput(args)


if __name__ == "__main__":
    main()
