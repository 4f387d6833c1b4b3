"""Worker 0 builds the multi-worker strategy; worker 1 never does: worker 0 waits for it forever."""

import os
import sys
import time

if os.environ["TFDIST_WORKER_INDEX"] == "1":
    time.sleep(600)
import tfdist  # noqa: E402

with tfdist.scope():
    pass
sys.exit("unreachable: the strategy cannot form without worker 1")
