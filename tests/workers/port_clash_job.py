"""Builds the multi-worker strategy and exits: `port_clash_job.py OUT_DIR [take]`.

With ``take``, worker 1's first start holds its own TF_CONFIG port first (SO_REUSEPORT set, as a server that shares
ports would), as another process can between the launcher picking a free port and TensorFlow binding it. Every
start of worker R appends R to OUT_DIR/starts.
"""

import json
import os
import pathlib
import socket
import sys

out_dir = pathlib.Path(sys.argv[1])
rank = int(os.environ["TFDIST_WORKER_INDEX"])
with open(out_dir / "starts", "a") as starts:
    starts.write(f"{rank}\n")
if sys.argv[2:] == ["take"] and rank == 1 and not (out_dir / "taken").exists():
    (out_dir / "taken").touch()
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", int(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][1].rsplit(":", 1)[1])))
    holder.listen()

import tensorflow as tf  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()
print(f"worker {rank} joined {strategy.num_replicas_in_sync} replicas", flush=True)
