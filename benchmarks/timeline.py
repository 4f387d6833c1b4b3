"""What do the step clock (always on: the straggler report) and the timeline cost a step? Keras fit on 2 workers.

Each round starts 2-worker jobs through ``tfdist run`` in alternating order, the job of
``benchmarks/fit_timing.py`` (a small CNN, ``--steps`` steps timed after a warm-up fit). ``--arm
clock`` compares tfdist as it ships (``tfdist.step_clock`` reading the clock in every step, the
straggler report at each fit's end) with the step clock taken out (its hooks made no-ops, the
input clock's patch restored): goal <= 1.005. ``--arm timeline`` compares ``TFDIST_TIMELINE`` set
(each worker's timeline thread publishing its part, worker 0 writing the file) with the step clock
taken out: goal <= 1.03. Every round prints its ratio.

    python benchmarks/timeline.py --arm clock --rounds 4
    python benchmarks/timeline.py --arm timeline --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import fit_timing as same_job  # noqa: E402  (benchmarks/fit_timing.py: the job and its StepTime)

REPO = pathlib.Path(__file__).resolve().parents[1]


def worker(out: str, steps: int, batch: int, clock: bool) -> None:
    if not clock:
        import tfdist
        from tfdist import step_clock, tf_fixes

        tfdist.get_strategy()  # first, as same_job.worker does: TensorFlow must not start before it
        tf_fixes.input_clock.restore()
        step_clock.step_starts = lambda data: None
        step_clock.buckets_timed = lambda gradients, reduce_buckets: reduce_buckets(
            lambda b, tensors, nbytes=0: tensors, lambda b, tensors: tensors)
    same_job.worker(out, steps, batch)


def run_job(on: bool, arm: str, steps: int, batch: int) -> same_job.StepTime:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        if on and arm == "timeline":
            env["TFDIST_TIMELINE"] = os.path.join(tmp, "timeline.json")
        command = [sys.executable, "-m", "tfdist.run", "-n", "2", "--timeout", "900", "--",
                   sys.executable, __file__, "--worker", out, "--steps", str(steps), "--batch", str(batch),
                   "--clock" if on else "--no-clock"]
        subprocess.run(command, env=env, check=True, capture_output=True)
        return same_job.StepTime(arm if on else "off", steps, json.loads(pathlib.Path(out).read_text())["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", choices=("clock", "timeline"), default="clock")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=320)
    parser.add_argument("--batch", type=int, default=64, help="per-worker batch")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--clock", dest="clock", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-clock", dest="clock", action="store_false", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.batch, args.clock)
        return
    same_job.alternate(args.rounds, lambda on: run_job(on, args.arm, args.steps, args.batch), f"{args.arm} ")


if __name__ == "__main__":
    main()
