"""Autotune's choice against every fixed exact bucket setting, side by side in the same 2-worker job.

    sudo python benchmarks/side_by_side.py --link veth --rate 1gbit --jobs 2 --rounds 10
    sudo python benchmarks/side_by_side.py --link loopback --jobs 2 --rounds 10

Why this and not only overlap.py: overlap.py times each setting in a job of its own, and two
jobs of the same setting differ by up to +-15% on this machine (RESULTS.md, issue 34), more
than the 3% that "defaults >= 0.97 of the best fixed setting" asks to resolve. Here one job
(same network, CNN, batch and synthetic data as overlap.py) builds one model per setup:

* ``defaults`` (and ``defaults fp16``): autotune on (tfdist's default until issue 52, now
  ``TFDIST_AUTOTUNE=1``); autotune measures and settles in
  that model's own first ``fit`` (a fresh record file, so it measures);
* ``fixed B/F``: one exact setting of ``tfdist.autotune.GRID``, set before that model's train
  function traces (so autotune keeps off it); every entry that buckets this CNN's gradients
  differently, in float32 and with ``Compression.fp16``.

Then it times ``--window`` steps of each model in turn, in alternating order every round, on the
same processes and connections: one ``fit`` call of 2 epochs of ``--window`` steps each, timed
from the second epoch's start to its end. Not ``fit``'s setup, nor the first epoch, whose start
makes the dataset iterator: under MultiWorkerMirroredStrategy a ``MultiDeviceIterator``, about
60 ms a call on this machine, which a 1-worker job does not pay; over a 64-step window that is
about 1 ms of each 2-worker step. The steady step is what the goals compare. Before each 2-worker
job, a 1-worker job (first namespace) times one model the same way: the baseline.

Prints, per job and precision: every round's ms per step of every setup; defaults / best
fixed, as the ratio of the medians and the median of each round's ratio (images/s, so best
ms / defaults ms); defaults against one worker (2 x its step / the defaults' step) and the CPU
ceiling (2 x the 1-worker step / worker 0's CPU per step), as overlap.py does; and where that
CPU goes: the defaults' (and the 1-worker job's) CPU ms per step by thread name, from
/proc/self/task (``tf_Compute``: TensorFlow's inter-op threads, which run the kernels;
``event_engine``, ``collective_ops``: gRPC and the collectives; ``python``: unnamed native
threads, such as gRPC's callback pool; ``main``: Python). Then the same
for every job's rounds together: the figures to quote (more rounds, so less noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import threading
import time

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import overlap  # noqa: E402

PORT = 29900
WARMUP_DEFAULTS = 160  # autotune's candidates settle within these (overlap.WARMUP_STEPS)
WARMUP_FIXED = 32      # tracing, then steady steps


def thread_ticks() -> dict[int, tuple[str, int]]:
    """Each thread of this process: its name (``main`` for the main thread) and the CPU clock ticks it used."""
    main, ticks = threading.main_thread().native_id, {}
    for task in pathlib.Path("/proc/self/task").iterdir():
        try:
            name = "main" if int(task.name) == main else (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        ticks[int(task.name)] = (name, int(fields[11]) + int(fields[12]))  # utime + stime
    return ticks


def cpu_by_thread(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]], steps: int) -> dict:
    """CPU ms per step between two ``thread_ticks``, summed by thread name."""
    per_tick, by_name = 1000 / os.sysconf("SC_CLK_TCK"), {}
    for tid, (name, ticks) in after.items():
        by_name[name] = by_name.get(name, 0) + (ticks - before.get(tid, (name, 0))[1]) * per_tick / steps
    return by_name


def worker(args: argparse.Namespace) -> None:
    """One worker: build every setup's model, warm each up, time windows in turn; the chief writes result.json."""
    rank = int(os.environ["TFDIST_WORKER_INDEX"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    os.environ.update(TFDIST_AUTOTUNE="1", TFDIST_AUTOTUNE_FILE=os.path.join(args.out, f"autotune{rank}.json"))
    import keras
    import tensorflow as tf

    import tfdist
    from tfdist import autotune

    class StepClock(keras.callbacks.Callback):
        """ms per step of a ``fit`` call's last epoch (not its setup, nor the first epoch, which makes the
        dataset iterator). No batch hooks: fit keeps tfdist's 16 steps per call."""

        def on_epoch_begin(self, epoch, logs=None):
            self.threads = thread_ticks()
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds, self.cpu = time.perf_counter() - self.start, time.process_time() - self.cpu_start
            self.by_thread = cpu_by_thread(self.threads, thread_ticks(), args.window)

    tf.config.threading.set_intra_op_parallelism_threads(1)
    strategy = tfdist.get_strategy()
    workers = strategy.num_replicas_in_sync  # one replica a worker
    data = overlap.synthetic_data(workers)

    def model(fp16: bool):
        with strategy.scope():
            built = overlap.build_model()
            optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
            if fp16:
                optimizer = tfdist.DistributedOptimizer(optimizer, compression=tfdist.Compression.fp16)
            built.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return built

    models, chosen = {}, {}
    if workers == 1:  # the baseline: one worker, the same model and timing
        models["1 worker"] = model(False)
        models["1 worker"].fit(data, epochs=1, steps_per_epoch=WARMUP_FIXED, verbose=0)
    # The defaults first: a fixed setting, once set, keeps autotune off in this process.
    for fp16 in (False, True) if workers > 1 else ():
        name = "defaults fp16" if fp16 else "defaults"
        models[name] = model(fp16)
        models[name].fit(data, epochs=1, steps_per_epoch=WARMUP_DEFAULTS, verbose=0)
        choice = autotune.last_choice()
        chosen[name] = {"setting": str(choice.setting), "step_ms": choice.step_ms} if choice else None
    for fp16 in (False, True) if workers > 1 else ():
        for name, setting in overlap.distinct_fixed(fp16).items():
            tfdist.set_bucket_bytes(*setting)
            models[name] = model(fp16)
            models[name].fit(data, epochs=1, steps_per_epoch=WARMUP_FIXED, verbose=0)
    names = list(models)
    clock = StepClock()
    rounds, cpu, threads = [], [], []
    for number in range(args.rounds):
        times, cpu_times, thread_times = {}, {}, {}
        for name in (names if number % 2 == 0 else names[::-1]):
            models[name].fit(data, epochs=2, steps_per_epoch=args.window, verbose=0, callbacks=[clock])
            times[name], cpu_times[name] = 1000 * clock.seconds / args.window, 1000 * clock.cpu / args.window
            thread_times[name] = clock.by_thread
        rounds.append(times)
        cpu.append(cpu_times)
        threads.append(thread_times)
    if rank == 0:
        pathlib.Path(args.out, "result.json").write_text(
            json.dumps({"rounds": rounds, "cpu": cpu, "threads": threads, "autotune": chosen}))


def by_thread(result: dict, setup: str) -> str:
    """``setup``'s CPU ms per step by thread name, the median over the rounds, largest first."""
    rounds = [r[setup] for r in result["threads"]]
    medians = {name: statistics.median(r.get(name, 0.0) for r in rounds) for name in set().union(*rounds)}
    return ", ".join(f"{name} {ms:.2f}" for name, ms in sorted(medians.items(), key=lambda kv: -kv[1]) if ms >= 0.05)


def report(title: str, result: dict, one_worker_ms: float) -> None:
    """Prints a job's table (or every job's rounds together) and, per precision, the defaults against the best
    fixed setting and against one worker."""
    rounds, cpu = result["rounds"], result["cpu"]
    names = list(rounds[0])
    print(f"\n{title}: ms per step, {len(rounds)} rounds (median, CPU ms per step of worker 0; every round); "
          f"1 worker (its own job just before): {one_worker_ms:.2f} ms per step")
    for name in names:
        values = [r[name] for r in rounds]
        print(f"  {name:<22}{statistics.median(values):>7.2f}{statistics.median(c[name] for c in cpu):>7.1f}   "
              + ", ".join(f"{v:.1f}" for v in values))
    for suffix, label in (("", "float32"), (" fp16", "fp16")):
        defaults = f"defaults{suffix}"
        fixed = [n for n in names if n.startswith("fixed") and n.endswith(" fp16") == bool(suffix)]
        best = min(fixed, key=lambda n: statistics.median(r[n] for r in rounds))
        paired = [r[best] / r[defaults] for r in rounds]
        of_medians = statistics.median(r[best] for r in rounds) / statistics.median(r[defaults] for r in rounds)
        speedup = 2 * one_worker_ms / statistics.median(r[defaults] for r in rounds)
        ceiling = 2 * one_worker_ms / statistics.median(c[defaults] for c in cpu)
        choice = result["autotune"][defaults]
        print(f"  {label}: defaults / best fixed ({best}): {of_medians:.3f} (medians), "
              f"{statistics.median(paired):.3f} (median of the rounds' ratios); each round: "
              + ", ".join(f"{v:.2f}" for v in paired))
        print(f"  {label}: defaults {speedup:.2f}x one worker; CPU ceiling 2 x (1-worker step) / (CPU per step) "
              f"{ceiling:.2f}x, defaults at {speedup / ceiling:.2f} of it")
        print(f"  {label}: defaults' CPU ms per step by thread, worker 0: {by_thread(result, defaults)}")
        if isinstance(choice, str):  # every job's choice
            print(f"  {label}: autotune chose, job by job: {choice}")
        else:
            print(f"  {label}: autotune chose {choice['setting'] if choice else None}"
                  + (f" (its ms per step: {json.dumps(choice['step_ms'])})" if choice else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link", choices=("veth", "loopback"), default="veth")
    parser.add_argument("--rate", default="1gbit", help="tbf rate on both veth ends (e.g. 2gbit, 500mbit) or none")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--window", type=int, default=64, help="steps timed per setup and round")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for flag in ("jobs", "rounds", "window"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1; received {getattr(args, flag)}.")
    if args.job:
        worker(args)
        return
    from tests import netns

    reason = netns.unavailable()
    if reason:
        sys.exit(f"side_by_side.py needs network namespaces: {reason}")
    job = [str(pathlib.Path(__file__).resolve()), "--job", "--rounds", str(args.rounds), "--window", str(args.window)]
    link = overlap.link_label(args.link, args.rate)
    print(f"{link}; {args.window} steps a window; 2 workers, one core each", flush=True)
    results, one_worker = [], []
    with netns.hosts(prefix="tfsb") as hosts:
        if args.link == "veth":
            overlap.shape(hosts, args.rate)
        for number in range(args.jobs):
            one = overlap.launch(job, 1, hosts, args.link, PORT, timeout=1200)
            one_worker.append(statistics.median(r["1 worker"] for r in one["rounds"]))
            print(f"\n1 worker, job {number + 1}: {one_worker[-1]:.2f} ms per step; CPU ms per step by thread: "
                  f"{by_thread(one, '1 worker')}")
            results.append(overlap.launch(job, 2, hosts, args.link, PORT + 1 + number, timeout=1200))
            report(f"job {number + 1}", results[-1], one_worker[-1])
            sys.stdout.flush()
    pooled = {"rounds": [r for result in results for r in result["rounds"]],
              "cpu": [c for result in results for c in result["cpu"]],
              "threads": [t for result in results for t in result["threads"]],
              "autotune": {name: "; ".join(str(result["autotune"][name] and result["autotune"][name]["setting"])
                                           for result in results) for name in ("defaults", "defaults fp16")}}
    report(f"every job's rounds together ({args.jobs} jobs)", pooled, statistics.median(one_worker))

if __name__ == "__main__":
    main()
