"""A worker without TensorFlow, for launcher tests: `toy_worker.py OUT_DIR MODE`."""

import json
import os
import pathlib
import signal
import sys
import time

out_dir, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["TFDIST_WORKER_INDEX"])
attempt = int(os.environ["TFDIST_RESTART"])
if mode == "ignore_term":  # before the pid file appears: a test signals as soon as it sees it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as TensorFlow's preemption handler can
(out_dir / f".pid{rank}.{attempt}.tmp").write_text(str(os.getpid()))  # appears whole: tests read pid* any time
os.replace(out_dir / f".pid{rank}.{attempt}.tmp", out_dir / f"pid{rank}.{attempt}")
with open(out_dir / "starts", "a") as starts:  # one line per start (pid files of an attempt overwrite each other)
    starts.write(f"{rank}\n")
names = ("TF_CONFIG", "TFDIST_WORKER_INDEX", "TFDIST_NUM_WORKERS", "TFDIST_LOCAL_RANK",
         "TFDIST_LOCAL_SIZE", "TFDIST_CPU_DEVICES", "TFDIST_RESTART", "TFDIST_GRACE_PERIOD")
(out_dir / f"worker{rank}.json").write_text(json.dumps({name: os.environ.get(name) for name in names}))
print(f"hello from {rank}", flush=True)

if mode == "echo":
    sys.exit(0)
if mode == "fail1" and rank == 1:
    time.sleep(0.5)
    sys.exit(3)
if mode == "fail_first_attempt" and rank == 1 and attempt == 0:
    deadline = time.monotonic() + 30
    while not (out_dir / "pid0.0").exists() and time.monotonic() < deadline:  # worker 0 started too
        time.sleep(0.05)
    sys.exit(5)
if mode == "fail_first_attempt":
    sys.exit(0)
if mode == "join_alone" and rank == 0:  # as tfdist does before the strategy waits for its peers
    from tfdist import cluster

    cluster.mark_stage("joining")
if mode == "metrics_port":  # the script's own server on one fixed port: the second worker cannot bind it
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", int(os.environ["TOY_METRICS_PORT"])))  # OSError: [Errno 98] in the second worker
    server.listen()
if mode == "port_clash" and attempt == 0 and rank == 1:  # as tfdist does when TensorFlow cannot bind its port
    from tfdist import cluster

    cluster.mark_stage("port-clash")
    sys.exit(1)
if mode == "port_clash" and attempt > 0:
    sys.exit(0)
time.sleep(120)
