"""Weak scaling of Keras ``fit`` under ``tfdist run``: 2 workers vs 1, with and without tfdist's levers.

A small CNN (32x32x3 images, 300k parameters: 1.2 MB of float32 gradients a step), batch 64
per worker, synthetic data, one intra-op thread per worker. Each round starts one job per
setup through ``tfdist run`` (alternating, so drift on the shared cores hits all alike):

* ``1 worker``: ``tfdist run -n 1``, the model in ``tfdist.scope()``, tfdist's defaults;
* ``2w keras``: ``-n 2``, Keras' own step loop (``steps_per_execution=1``): the "before";
* ``2w defaults``: ``-n 2``, tfdist's defaults (``steps_per_execution`` picked by tfdist);
* ``2w fp16``: defaults + ``DistributedOptimizer(compression=Compression.fp16)``;
* ``2w accum4``: defaults + ``DistributedOptimizer(backward_passes_per_step=4)``, one
  all-reduce per 4 micro-batches (4x the global batch per update: a training change);
* ``2w accum4+fp16``: both.

Prints the whole job's images/s for every round and setup, the ratio of each 2-worker setup
to the 1-worker job of the same round (goals: defaults >= 1.5x, levers >= 1.8x in every
round), and, from round 1, each setup's step time beside its floor: the 1-worker step plus
the engine's all-reduce of the gradients (of the float16 gradients for fp16; a quarter of it
for accum4), timed alone in the same workers.

    python benchmarks/scaling.py [--rounds 5] [--steps 256] [--pin | --no-pin]

``--pin`` (the default) binds worker i to core i, the issue's setup; ``--no-pin`` lets both
share both cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BATCH = 64
SETUPS = {  # name: (workers, steps_per_execution (None: tfdist's pick), backward passes, fp16)
    "1 worker": (1, None, 1, False),
    "2w keras": (2, 1, 1, False),
    "2w defaults": (2, None, 1, False),
    "2w fp16": (2, None, 1, True),
    "2w accum4": (2, None, 4, False),
    "2w accum4+fp16": (2, None, 4, True),
}
GOALS = {"2w defaults": 1.5, "2w fp16": 1.8, "2w accum4": 1.8, "2w accum4+fp16": 1.8}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=256, help="timed steps per job (a multiple of 16)")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="bind worker i to core i (default) or let the workers share all cores")
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated subset of: " + ", ".join(SETUPS))
    parser.add_argument("--job", help=argparse.SUPPRESS)  # set in the workers
    parser.add_argument("--breakdown", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def run_job(setup: str, args: argparse.Namespace, breakdown: bool) -> dict:
    """Starts one ``tfdist run`` job for ``setup``; returns the chief's JSON result."""
    workers = SETUPS[setup][0]
    command = [sys.executable, "-m", "tfdist.run", "-n", str(workers), "--timeout", "300", "--",
               sys.executable, os.path.abspath(__file__), "--job", setup, "--steps", str(args.steps),
               "--pin" if args.pin else "--no-pin", *(["--breakdown"] if breakdown else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("[0] RESULT "):
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"job {setup!r} gave no result (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
                       f"{done.stderr[-3000:]}")


def worker(args: argparse.Namespace) -> None:
    """In each worker: train the setup's model, time ``args.steps`` steps, print the result (chief)."""
    rank = int(os.environ["TFDIST_WORKER_INDEX"])
    if args.pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    import keras
    import tensorflow as tf

    import tfdist

    tf.config.threading.set_intra_op_parallelism_threads(1)  # before the runtime starts
    strategy = tfdist.get_strategy()
    workers, steps_per_execution, passes, fp16 = SETUPS[args.job]

    def build_model():
        return keras.Sequential([
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(),
            keras.layers.Flatten(), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10),
        ])

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    global_batch = BATCH * workers
    images = tf.random.stateless_uniform((global_batch, 32, 32, 3), seed=(1, 2))
    labels = tf.random.stateless_uniform((global_batch,), seed=(3, 4), maxval=10, dtype=tf.int32)
    options = tf.data.Options()
    options.autotune.enabled = False  # one core each: see RESULTS.md (autotune's own thread costs a pinned worker)
    data = tf.data.Dataset.from_tensors((images, labels)).repeat().with_options(options)
    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        if passes > 1 or fp16:
            optimizer = tfdist.DistributedOptimizer(
                optimizer, backward_passes_per_step=passes,
                compression=tfdist.Compression.fp16 if fp16 else tfdist.Compression.none)
        compile_kwargs = {} if steps_per_execution is None else {"steps_per_execution": steps_per_execution}
        model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"], **compile_kwargs)
    model.fit(data, epochs=1, steps_per_epoch=32, verbose=0)  # tracing and warm-up
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0)
    seconds = time.perf_counter() - start
    from tfdist.keras_fixes.steps_per_execution import auto_steps

    result = {"images_per_sec": global_batch * args.steps / seconds, "step_ms": 1000 * seconds / args.steps,
              "steps_per_execution": steps_per_execution or auto_steps(None, args.steps)}
    if args.breakdown and workers > 1:
        from tfdist.bench import profile

        result["compute_ms"] = profile.compute_ms(build_model, {"optimizer": "sgd", "loss": loss},
                                                  (images[:BATCH], labels[:BATCH]), args.steps)
        result["allreduce_ms"] = profile.allreduce_ms(strategy, model.trainable_variables, num_logged=0)
        halves = [tf.TensorSpec(v.shape, tf.float16) for v in model.trainable_variables]
        result["allreduce_fp16_ms"] = profile.allreduce_ms(strategy, halves, num_logged=0)
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def main(args: argparse.Namespace) -> None:
    setups = args.setups.split(",")
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown or "1 worker" not in setups:
        sys.exit(f"--setups must name '1 worker' and only these: {', '.join(SETUPS)}; received {unknown or setups}.")
    rounds = []
    for number in range(1, args.rounds + 1):
        rounds.append({setup: run_job(setup, args, breakdown=number == 1) for setup in setups})
        print(f"round {number}: " + ", ".join(f"{s} {r['images_per_sec']:.0f}" for s, r in rounds[-1].items()),
              flush=True)
    report(rounds, setups, args)


def report(rounds: list[dict], setups: list[str], args: argparse.Namespace) -> None:
    pinned = "each worker pinned to its own core" if args.pin else "workers unpinned (sharing both cores)"
    print(f"\nimages/s of the whole job, batch {BATCH} per worker, {args.steps} timed steps, {pinned}; "
          "ratio = setup / '1 worker' of the same round")
    print(f"{'setup':<16}{'K':>4}{'median':>9}{'ratio median':>14}{'goal':>6}   every round (images/s, ratio)")
    for setup in setups:
        runs = [r[setup] for r in rounds]
        ratios = [r[setup]["images_per_sec"] / r["1 worker"]["images_per_sec"] for r in rounds]
        cells = ", ".join(f"{r['images_per_sec']:.0f} ({q:.2f})" for r, q in zip(runs, ratios))
        goal = GOALS.get(setup)
        verdict = "" if goal is None else ("met" if min(ratios) >= goal else "missed")
        print(f"{setup:<16}{runs[0]['steps_per_execution']:>4}{statistics.median(r['images_per_sec'] for r in runs):>9.0f}"
              f"{statistics.median(ratios):>14.2f}{goal or '':>6}   {cells} {verdict}")
    first = rounds[0]
    reduce_ms = next((r["allreduce_ms"] for r in first.values() if "allreduce_ms" in r), None)
    if reduce_ms is None:
        return
    fp16_ms = next(r["allreduce_fp16_ms"] for r in first.values() if "allreduce_fp16_ms" in r)
    print(f"\nround 1 breakdown, ms per step: 1-worker job {first['1 worker']['step_ms']:.1f}; engine all-reduce "
          f"of the gradients alone {reduce_ms:.1f} float32, {fp16_ms:.1f} float16; compute = one worker's "
          "training step with no strategy, timed in the same 2-worker job (both cores busy)")
    print(f"{'setup':<16}{'step':>7}{'compute':>9}{'reduce':>8}{'floor':>7}{'other':>7}{'floor/step':>12}")
    for setup in setups[1:]:
        _, _, passes, fp16 = SETUPS[setup]
        compute, step = first[setup]["compute_ms"], first[setup]["step_ms"]
        reduce = (fp16_ms if fp16 else reduce_ms) / passes
        floor = compute + reduce
        print(f"{setup:<16}{step:>7.1f}{compute:>9.1f}{reduce:>8.1f}{floor:>7.1f}{step - floor:>7.1f}"
              f"{floor / step:>12.2f}")


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.job:
        worker(arguments)
    else:
        main(arguments)
