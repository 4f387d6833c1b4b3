"""Overlapped, bucketed gradient all-reduce vs one pack, 2 workers vs 1, on a shaped network link.

    sudo python benchmarks/overlap.py --link veth --rate 1gbit --rounds 5
    sudo python benchmarks/overlap.py --link loopback --rounds 5

The network: two Linux network namespaces joined by a veth pair (tests/netns.py), one
worker in each; ``--rate`` shapes both veth ends with ``tc ... tbf`` (this kernel has no
netem). Shaped veth is an emulation: a token bucket on a virtual link, with the kernel's
per-packet CPU cost on the same cores as the workers, not a real NIC. ``--link loopback``
runs both workers in one namespace over 127.0.0.1 instead, as benchmarks/scaling.py does.

The job: the small CNN of benchmarks/scaling.py (1.27 MB of float32 gradients), batch 64
per worker, synthetic data (tf.data autotune off), Keras ``fit`` under ``tfdist.scope()``,
every worker pinned to its own core with one intra-op thread. Setups, one ``tfdist run``
job each, in alternating order every round (``--setups`` picks; ``--list`` prints them all):

* ``1 worker``: the baseline, in the first namespace;
* ``defaults``: 2 workers with autotune on (tfdist's default until issue 52; ``TFDIST_AUTOTUNE=1``
  now; tfdist's defaults today are ``fixed 4M/1M``): autotune picks the bucket setting in the
  warm-up steps (``tfdist.autotune``; a fresh record file per job, so every job measures);
* ``as shipped``: 2 workers, tfdist as a user runs it (no ``TFDIST_AUTOTUNE`` set, no record file
  chosen); ``autotune off``: the same with ``TFDIST_AUTOTUNE=0`` (issue 52's measure compares these
  two, with ``--warmup 10 --steps 100``);
* ``fixed one-pack``, ``fixed 4M/1M`` (the buckets before autotune), ``fixed 4M/4K``, ...:
  2 workers, autotune off, one fixed exact setting each (every entry of
  ``tfdist.autotune.GRID``, bucket/first bucket), 2 inter-op threads as tfdist sets them;
* ``one-pack 1 thread``: one all-reduce after the backward pass and TensorFlow's single
  inter-op thread on a one-core worker (the fastest fp16 setup in RESULTS.md);
* ``before``: tfdist as it was before issue 22 (one pack, 1 inter-op thread,
  ``TF_CPU_ALLOCATOR_USE_BFC=false``, a 600 s collective timeout);
* a `` fp16`` suffix: ``DistributedOptimizer(compression=Compression.fp16)``; `` accum4``:
  ``DistributedOptimizer(backward_passes_per_step=4)``.

Every setup trains ``--warmup`` steps (default ``WARMUP_STEPS``: tracing, and autotune settling) before the timed
steps. Prints images/s of the whole job and the ratio to the 1-worker job of the same round for
every round; the medians; ``defaults`` against the best fixed setting of the same run (the
issue's goal: >= 0.97; the ratio of the two medians, and the median of each round's ratio, the
less noisy one: both jobs ran minutes apart) and what autotune chose in each round; each worker's CPU per step (process time) and the ceiling it
sets, 2 x (1-worker step) / (2-worker CPU per step): no schedule can beat it with both
cores fully busy; and, from a profiler trace of 16 steps on worker 0 in round 1, the
collective time per step that ran under compute (hidden) and alone (exposed).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
BATCH = 64
PORT = 29700
KIB, MIB = 1 << 10, 1 << 20
WARMUP_STEPS = 160  # tracing, then autotune's 3 candidates x (a first call + 2 timed rounds) of 16 steps


@dataclasses.dataclass(frozen=True)
class Setup:
    workers: int = 2
    buckets: tuple[int, int] | None = None  # (bucket_bytes, first): fixed, autotune off; None: tfdist's defaults
    autotune: str | None = "1"              # with buckets None: TFDIST_AUTOTUNE's value (None: left unset)
    one_thread: bool = False                # 1 inter-op thread (TensorFlow's default on one core)
    fp16: bool = False
    passes: int = 1                         # backward passes per step
    before: bool = False                    # tfdist before issue 22


def _short(nbytes: int) -> str:
    return f"{nbytes // MIB}M" if nbytes >= MIB else f"{nbytes // KIB}K"


@functools.cache
def setups() -> dict[str, Setup]:
    """Every setup by name (imports tfdist, so TensorFlow: call it after pinning the process)."""
    from tfdist import autotune

    fixed = {("fixed one-pack" if b == 0 else f"fixed {_short(b)}/{_short(f)}"): Setup(buckets=(b, f))
             for b, f in autotune.GRID}
    base = {"defaults": Setup(), **fixed, "one-pack 1 thread": Setup(buckets=(0, 0), one_thread=True)}
    setups = {"1 worker": Setup(workers=1), "before": Setup(buckets=(0, 0), one_thread=True, before=True),
              "as shipped": Setup(autotune=None), "autotune off": Setup(autotune="0"), **base}
    setups.update({f"{name} fp16": dataclasses.replace(setup, fp16=True) for name, setup in base.items()})
    setups.update({f"{name} accum4": dataclasses.replace(setup, passes=4) for name, setup in base.items()})
    return setups


def build_model():
    """The small CNN of benchmarks/scaling.py (1.27 MB of float32 gradients)."""
    import keras

    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Flatten(), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])


def synthetic_data(workers: int):
    """One global batch (``BATCH`` a worker) of random 32x32 images and labels, repeated, tf.data autotune off."""
    import tensorflow as tf

    images = tf.random.stateless_uniform((BATCH * workers, 32, 32, 3), seed=(1, 2))
    labels = tf.random.stateless_uniform((BATCH * workers,), seed=(3, 4), maxval=10, dtype=tf.int32)
    options = tf.data.Options()
    options.autotune.enabled = False  # one core each (RESULTS.md: autotune's thread costs a pinned worker)
    return tf.data.Dataset.from_tensors((images, labels)).repeat().with_options(options)


def default_setups() -> list[str]:
    """1 worker, the defaults, the fixed float32 settings that bucket this CNN's gradients differently, one pack
    with 1 inter-op thread."""
    return ["1 worker", "defaults", *distinct_fixed(fp16=False), "one-pack 1 thread"]


def distinct_fixed(fp16: bool) -> dict[str, tuple[int, int]]:
    """The fixed setups (name -> (bucket_bytes, first)) that bucket this CNN's gradients differently, float32 or
    float16 on the wire; the first name of each plan."""
    from tfdist import buckets

    sizes = [int(v.shape.num_elements()) * (2 if fp16 else 4) for v in build_model().trainable_variables]
    plans = {}
    for name, setup in setups().items():
        if name.startswith("fixed") and setup.fp16 == fp16 and setup.passes == 1:
            plans.setdefault(repr(buckets.plan(sizes, *setup.buckets)), (name, setup.buckets))
    return dict(plans.values())


TRACE_STEPS = 16


def worker(args: argparse.Namespace) -> None:
    """One worker: train the setup's model, time ``args.steps`` steps; the chief writes result.json."""
    rank = int(os.environ["TFDIST_WORKER_INDEX"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    setup = setups()[args.job]
    strategy_options = {}
    if setup.before:
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "false"
        strategy_options["collective_timeout"] = 600
    if setup.buckets is None and setup.autotune is not None:  # "1": measuring afresh in every job
        os.environ.update(TFDIST_AUTOTUNE=setup.autotune,
                          TFDIST_AUTOTUNE_FILE=os.path.join(args.out, f"autotune{rank}.json"))
    import keras
    import tensorflow as tf

    import tfdist

    tf.config.threading.set_intra_op_parallelism_threads(1)
    if setup.one_thread:
        tf.config.threading.set_inter_op_parallelism_threads(1)  # TensorFlow's default on one core
    if setup.buckets is not None:
        tfdist.set_bucket_bytes(*setup.buckets)
    strategy = tfdist.get_strategy(**strategy_options)
    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        if setup.fp16 or setup.passes > 1:
            optimizer = tfdist.DistributedOptimizer(
                optimizer, backward_passes_per_step=setup.passes,
                compression=tfdist.Compression.fp16 if setup.fp16 else tfdist.Compression.none)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = synthetic_data(setup.workers)
    model.fit(data, epochs=1, steps_per_epoch=args.warmup, verbose=0)  # tracing, autotune, warm-up
    from tfdist import autotune

    choice = autotune.last_choice()
    result = {"autotune": str(choice.setting) if choice else None}
    if args.trace and setup.workers > 1:
        from tfdist.bench import trace

        logdir = tempfile.mkdtemp(prefix="tfdist-trace-")
        if rank == 0:
            tf.profiler.experimental.start(logdir)
        model.fit(data, epochs=1, steps_per_epoch=TRACE_STEPS, verbose=0)
        if rank == 0:
            tf.profiler.experimental.stop()
            result["trace"] = dataclasses.asdict(trace.collective_overlap(logdir).per_step(TRACE_STEPS))
    cpu, start = time.process_time(), time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    if rank == 0:
        result.update(images_per_sec=BATCH * setup.workers * args.steps / seconds, step_ms=1000 * seconds / args.steps,
                      cpu_ms=1000 * cpu / args.steps,
                      gradient_bytes=sum(int(v.shape.num_elements()) * 4 for v in model.trainable_variables))
        pathlib.Path(args.out, "result.json").write_text(json.dumps(result))


def run_job(setup: str, hosts, args: argparse.Namespace, trace: bool, port: int) -> dict:
    """One ``tfdist run`` job of ``setup``; returns the chief's result."""
    job = [str(pathlib.Path(__file__).resolve()), "--job", setup, "--steps", str(args.steps),
           "--warmup", str(args.warmup), *(["--trace"] if trace else [])]
    return launch(job, setups()[setup].workers, hosts, args.link, port)


def launch(job: list[str], workers: int, hosts, link: str, port: int, timeout: int = 300) -> dict:
    """Runs ``python <job> --out DIR`` as one ``tfdist run`` job of ``workers`` (see ``launch_in``); returns the
    result.json its chief wrote in DIR."""
    with tempfile.TemporaryDirectory() as out:
        outputs = launch_in(out, job, workers, hosts, link, port, timeout)
        result = pathlib.Path(out, "result.json")
        if not result.exists():
            raise RuntimeError(f"job {job} gave no result:\n" + "\n".join(o[-3000:] for o in outputs))
        return json.loads(result.read_text())


def launch_in(out: str, job: list[str], workers: int, hosts, link: str, port: int, timeout: int = 300) -> list[str]:
    """Runs ``python <job> --out <out>`` as one ``tfdist run`` job of ``workers`` (one per namespace over veth, or
    all in the first over loopback), stopped after ``timeout`` s; returns each launcher's output (what the job
    writes in ``out`` is the caller's to read)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2", "TFDIST_TOKEN": "benchmark"}
    job = [sys.executable, *job, "--out", out]
    if workers == 1 or link == "loopback":
        commands = [hosts[0].command([sys.executable, "-m", "tfdist.run", "-n", str(workers),
                                      "--timeout", str(timeout), "--", *job])]
    else:
        master = f"{hosts[0].address}:{port}"
        commands = [host.command([sys.executable, "-m", "tfdist.run", "--nnodes", "2", "--node-rank", str(rank),
                                  "--master", master, "-n", "1", "--timeout", str(timeout), "--", *job])
                    for rank, host in enumerate(hosts)]
    launchers = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for c in commands]
    try:
        return [launcher.communicate(timeout=timeout + 100)[0] for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill()


def shape(hosts, rate: str) -> None:
    """Shapes both veth ends to ``rate`` (egress only, hence both), or removes the shaping ("none")."""
    for host in hosts:
        subprocess.run(host.command(["tc", "qdisc", "del", "dev", host.device, "root"]), capture_output=True)
        if rate != "none":
            subprocess.run(host.command(["tc", "qdisc", "add", "dev", host.device, "root", "tbf", "rate", rate,
                                         "burst", "256kb", "latency", "20ms"]), check=True)


def link_label(link: str, rate: str) -> str:
    """The network in words, for a report's first line."""
    if link == "loopback":
        return "loopback (127.0.0.1, one namespace)"
    return f"veth between 2 namespaces, {'unshaped' if rate == 'none' else 'tbf ' + rate + ' both ends'}"


def rate_bits(rate: str) -> float | None:
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    return None


def report(rounds: list[dict], setups: list[str], args: argparse.Namespace) -> None:
    link = link_label(args.link, args.rate)
    print(f"\n{link}; {args.steps} timed steps; images/s of the whole job (ratio to '1 worker' of the same round)")
    print(f"{'setup':<24}{'ratio median':>13}{'cpu/step':>10}{'ceiling':>9}{'of ceiling':>11}   every round")
    for setup in setups:
        runs = [r[setup] for r in rounds]
        ratios = [r[setup]["images_per_sec"] / r["1 worker"]["images_per_sec"] for r in rounds]
        ceilings = [2 * r["1 worker"]["step_ms"] / r[setup]["cpu_ms"] for r in rounds]
        cells = ", ".join(f"{run['images_per_sec']:.0f} ({ratio:.2f})" for run, ratio in zip(runs, ratios))
        ratio, ceiling = statistics.median(ratios), statistics.median(ceilings)
        cpu = statistics.median(run["cpu_ms"] for run in runs)
        tail = "" if setup == "1 worker" else f"{ceiling:>9.2f}{ratio / ceiling:>11.2f}"
        print(f"{setup:<24}{ratio:>13.2f}{cpu:>10.1f}{tail or '':>20}   {cells}")
    for suffix in ("", " fp16", " accum4"):
        against_best(rounds, setups, suffix)
    if {"as shipped", "autotune off"} <= set(setups):  # issue 52's measure: >= 0.97
        paired = [r["as shipped"]["images_per_sec"] / r["autotune off"]["images_per_sec"] for r in rounds]
        print(f"as shipped / autotune off: {statistics.median(paired):.3f} (median of the rounds' ratios); each round: "
              + ", ".join(f"{value:.2f}" for value in paired))
    bits = rate_bits(args.rate) if args.link == "veth" else None
    first = rounds[0]
    gradient_bytes = first[setups[-1]]["gradient_bytes"]
    if bits:
        print(f"wire time of one step's all-reduce at {args.rate} (2 workers send the whole gradient each way): "
              f"{gradient_bytes * 8 / bits * 1000:.1f} ms float32, {gradient_bytes * 4 / bits * 1000:.1f} ms float16")
    print(f"1-worker step {statistics.median(r['1 worker']['step_ms'] for r in rounds):.1f} ms (median)")
    traced = [s for s in setups if "trace" in first[s]]
    if traced:
        print(f"round 1, profiler trace of {TRACE_STEPS} steps on worker 0, ms per step:")
        for setup in traced:
            t = first[setup]["trace"]
            print(f"  {setup:<24} step {first[setup]['step_ms']:.1f}: all-reduce {t['collective_ms']:.1f} = "
                  f"{t['hidden_ms']:.1f} hidden under compute + {t['exposed_ms']:.1f} exposed")


def against_best(rounds: list[dict], setups: list[str], suffix: str) -> None:
    """``defaults<suffix>`` against the best fixed setting of the same precision (median ratios), and its choices."""
    defaults = f"defaults{suffix}"
    fixed = [s for s in setups if s.endswith(suffix) and (s.startswith("fixed") or s.startswith("one-pack 1 thread"))
             and s.count(" fp16") == suffix.count(" fp16") and s.count(" accum4") == suffix.count(" accum4")]
    if defaults not in setups or not fixed:
        return
    ratio = lambda setup: statistics.median(r[setup]["images_per_sec"] / r["1 worker"]["images_per_sec"]  # noqa: E731
                                            for r in rounds)
    for label, pool in (("fixed, 2 inter-op threads", [s for s in fixed if "1 thread" not in s]), ("any fixed", fixed)):
        if pool:
            best = max(pool, key=ratio)
            paired = [r[defaults]["images_per_sec"] / r[best]["images_per_sec"] for r in rounds]
            print(f"{defaults} / best {label} ({best}): {ratio(defaults) / ratio(best):.3f} (medians), "
                  f"{statistics.median(paired):.3f} (median of the rounds' ratios); each round: "
                  + ", ".join(f"{value:.2f}" for value in paired))
    print(f"{defaults}: autotune chose " + "; ".join(f"round {i + 1} {r[defaults].get('autotune')}"
                                                      for i, r in enumerate(rounds)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link", choices=("veth", "loopback"), default="veth")
    parser.add_argument("--rate", default="1gbit", help="tbf rate on both veth ends (e.g. 2gbit, 500mbit) or none")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=192)
    parser.add_argument("--warmup", type=int, default=WARMUP_STEPS, help="untimed steps first (default: %(default)s, "
                                                                        "autotune's trials settle within them)")
    parser.add_argument("--setups", help="comma-separated setups (default: 1 worker, defaults, every fixed float32 "
                                         "setting, one-pack 1 thread); --list names them all")
    parser.add_argument("--list", action="store_true", help="print every setup's name and exit")
    parser.add_argument("--no-trace", dest="trace_round", action="store_false", help="skip the round-1 trace")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        worker(args)
        return
    sys.path.insert(0, str(REPO))
    if args.list:
        print("\n".join(setups()))
        return
    chosen = args.setups.split(",") if args.setups else default_setups()
    if "1 worker" not in chosen or set(chosen) - set(setups()):
        sys.exit(f"--setups must name '1 worker' and only these: {', '.join(setups())}; received {chosen}.")
    from tests import netns

    reason = netns.unavailable()
    if reason:
        sys.exit(f"overlap.py needs network namespaces: {reason}")
    rounds = []
    with netns.hosts(prefix="tfdb") as hosts:
        if args.link == "veth":
            shape(hosts, args.rate)
        port = PORT
        for number in range(args.rounds):
            order = chosen if number % 2 == 0 else chosen[::-1]
            results = {}
            for setup in order:
                port += 1
                results[setup] = run_job(setup, hosts, args, trace=args.trace_round and number == 0, port=port)
            rounds.append(results)
            print(f"round {number + 1}: " + ", ".join(
                f"{s} {results[s]['images_per_sec']:.0f}" for s in chosen), flush=True)
    report(rounds, chosen, args)


if __name__ == "__main__":
    main()
