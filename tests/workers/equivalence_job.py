"""Runs many equivalence cells in one process (or one 2-worker job), so start-up is paid once.

    equivalence_job.py OUT_DIR CELLS_FILE CELL_TIMEOUT

CELLS_FILE lists cell names (tests/equivalence/matrix.py), one a line. For each cell this
worker appends ``{"cell", "status", ...}`` to OUT_DIR/worker<rank>.jsonl: ``ok`` with the
measurements of ``tests.equivalence.cells.run``, or ``error`` with the exception. A cell
still running after CELL_TIMEOUT seconds is recorded as ``hang`` and the process exits 3; after
an error it exits 4 (TensorFlow aborts every later collective of a process in which one failed),
once every rank has recorded that cell (or ERROR_WAIT seconds passed). ``tfdist run`` then
stops the other worker, and the driver starts a new job after that cell. An error by design
(``matrix.ERRORS_BY_DESIGN``: tfdist refuses the cell while the model and optimizer are built,
before any collective) that every rank recorded does not end the job: it goes on. Before each cell
every rank waits for the others (one all-reduce), so no rank runs ahead into the next one.
Multi-worker cells (tfdist.horovod modes) need the 2-worker job; the others run in one
process over TFDIST_CPU_DEVICES=2 logical CPUs.
"""

import faulthandler
import json
import os
import pathlib
import sys
import threading
import time
import traceback

import tfdist
from tests.equivalence import cells as cells_lib
from tests.equivalence import matrix
from tests.equivalence.matrix import Cell

out_dir, cells_file, cell_timeout = pathlib.Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
cells = [Cell.parse(line) for line in pathlib.Path(cells_file).read_text().split()]
if any(cell.multi_worker for cell in cells):
    import tensorflow as tf

    import tfdist.horovod as hvd

    hvd.init()
    rank, ranks, strategy = hvd.rank(), hvd.size(), None
else:
    rank, ranks, strategy = 0, 1, tfdist.get_strategy()
log = open(out_dir / f"worker{rank}.jsonl", "a")
ERROR_WAIT = 30.0  # seconds a rank that failed a cell waits for the others' records of it


def write(record: dict) -> None:
    log.write(json.dumps(record) + "\n")
    log.flush()


def wait_for_every_rank() -> None:
    """Every rank has recorded the cell before: a rank that fails the next cell at once (an error by design)
    must not end the job while rank 0 still trains the last one's reference."""
    if ranks > 1:
        hvd.allreduce(tf.constant(0.0), name="equivalence_barrier")


def lines_of(cell: Cell) -> list[list[str]]:
    """Each rank's lines recording ``cell`` (a cell run again appends another; the last may be cut, still being
    written)."""
    mark = f'{{"cell": {json.dumps(cell.name)},'  # as ``write`` starts a record
    found = []
    for other in range(ranks):
        path = out_dir / f"worker{other}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        found.append([line for line in lines if line.startswith(mark)])
    return found


def records_of(cell: Cell) -> list[int]:
    """How many records of ``cell`` each rank's file holds."""
    return [len(lines) for lines in lines_of(cell)]


def refused_by_design(cell: Cell, before: list[int]) -> bool:
    """Every rank recorded this run of ``cell`` as an error by design: refused before any collective ran, so no
    collective failed and the job can go on with the next cell."""
    lines = lines_of(cell)
    if any(len(now) <= then for now, then in zip(lines, before)):
        return False  # a rank has not recorded it (it may be waiting in a collective)
    try:
        per_rank = {rank: json.loads(mine[-1]) for rank, mine in enumerate(lines)}
    except json.JSONDecodeError:  # a line still being written
        return False
    return matrix.judge(cell, per_rank).outcome == "error by design"


def wait_for_records(cell: Cell, before: list[int]) -> None:
    """After an error, before this process ends the job: every rank records ``cell`` (rank 0 may still be
    training the one-device reference), or ERROR_WAIT seconds pass (a rank waiting in a collective never will)."""
    deadline = time.monotonic() + min(cell_timeout, ERROR_WAIT)
    while time.monotonic() < deadline and any(now <= then for now, then in zip(records_of(cell), before)):
        time.sleep(0.2)


def give_up(cell: Cell) -> None:
    write({"cell": cell.name, "status": "hang", "error": f"no result after {cell_timeout:g} s"})
    faulthandler.dump_traceback(all_threads=True)
    os._exit(3)


for index, cell in enumerate(cells):
    if index:
        wait_for_every_rank()
    before = records_of(cell)
    watchdog = threading.Timer(cell_timeout, give_up, args=(cell,))
    watchdog.daemon = True
    watchdog.start()
    started = time.monotonic()
    try:
        record = cells_lib.run(cell, strategy, reference=rank == 0)
    except Exception as error:  # noqa: BLE001  (every failure is the cell's result)
        record = {"status": "error", "error": f"{type(error).__name__}: {error}".strip(),
                  "traceback": traceback.format_exc()[-3000:]}
    watchdog.cancel()
    write({"cell": cell.name, "seconds": round(time.monotonic() - started, 2), **record})
    if record["status"] == "error":
        wait_for_records(cell, before)
        if not refused_by_design(cell, before):
            os._exit(4)  # a failed collective aborts every later one in this process: the driver starts a new one
