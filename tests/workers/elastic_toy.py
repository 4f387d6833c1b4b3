"""A worker without TensorFlow for elastic-membership tests: `elastic_toy.py OUT_DIR STEPS`.

Counts steps (0.2 s each) from where the job stopped last: worker 0 appends each step, with
the world size, to OUT_DIR/steps and keeps the last in OUT_DIR/step. On SIGTERM each worker
finishes its step, then exits 85 (as tfdist.cluster.EXIT_PREEMPTED: saved, stopped for a
restart). Every worker appends its round (attempt, rank, world size, node rank and count) to
OUT_DIR/rounds (with its launcher's pid) and its own pid to OUT_DIR/pids. Exits 0 after STEPS.
"""

import json
import os
import pathlib
import signal
import sys
import time

EXIT_PREEMPTED = 85
out_dir, steps = pathlib.Path(sys.argv[1]), int(sys.argv[2])
rank, size = int(os.environ["TFDIST_WORKER_INDEX"]), int(os.environ["TFDIST_NUM_WORKERS"])
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))


def append(name: str, line: str) -> None:
    with open(out_dir / name, "a") as f:
        f.write(line + "\n")


append("pids", str(os.getpid()))
step = int((out_dir / "step").read_text()) if (out_dir / "step").exists() else 0
append("rounds", json.dumps({"attempt": int(os.environ["TFDIST_RESTART"]), "rank": rank, "size": size,
                             "node": int(os.environ["TFDIST_NODE_RANK"]), "nodes": int(os.environ["TFDIST_NUM_NODES"]),
                             "workers": len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]), "from": step,
                             "launcher": os.getppid(), "job_dir": os.environ.get("TFDIST_JOB_DIR")}))
while step < steps:
    if stopping:
        sys.exit(EXIT_PREEMPTED)
    time.sleep(0.2)
    step += 1
    if rank == 0:
        append("steps", f"{step} {size}")
        (out_dir / "step.tmp").write_text(str(step))
        os.replace(out_dir / "step.tmp", out_dir / "step")
