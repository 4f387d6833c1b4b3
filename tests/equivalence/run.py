"""Runs equivalence cells and prints the table: ``python -m tests.equivalence.run [--all | --strength T]``.

Single-process cells run in one process (2 logical CPUs); tfdist.horovod cells in one
2-worker ``tfdist run`` job. A cell that fails with an error, hangs or kills its process is
recorded, and a new process (job) goes on with the cells after it; after an error by design
(refused on every rank before any collective) the same one goes on. Exit status 0 when no cell failed.

    python -m tests.equivalence.run                  # all pairs and matrix.PINNED (what CI runs)
    python -m tests.equivalence.run --strength 3     # every 3 values of 3 dimensions
    python -m tests.equivalence.run --all            # the full product
    python -m tests.equivalence.run --cell fit/adam/mixed_float16/0/none/even/embedding
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

from tests import jobs
from tests.equivalence import matrix
from tests.equivalence.matrix import Cell, Verdict

SCRIPT = "equivalence_job.py"
CELL_TIMEOUT = 120.0  # seconds one cell may take on a loaded 2-core machine before it counts as hung


def _records(out_dir: pathlib.Path) -> dict[int, dict[str, dict]]:
    """rank -> cell name -> that rank's record."""
    found = {}
    for path in out_dir.glob("worker*.jsonl"):
        rank = int(path.stem.removeprefix("worker"))
        found[rank] = {}
        for line in path.read_text().splitlines():
            record = json.loads(line)
            found[rank][record["cell"]] = record
    return found


def _launch(cells: list[Cell], out_dir: pathlib.Path, cell_timeout: float) -> str:
    """Runs ``cells`` in one process or one 2-worker job; returns its output."""
    cells_file = out_dir / f"cells-{time.monotonic_ns()}.txt"
    cells_file.write_text("\n".join(cell.name for cell in cells))
    budget = cell_timeout * len(cells) + 120
    if cells[0].multi_worker:
        result = jobs.run_job(SCRIPT, out_dir, str(cells_file), str(cell_timeout), timeout=budget)
        return result.output
    command = [sys.executable, str(jobs.WORKERS / SCRIPT), str(out_dir), str(cells_file), str(cell_timeout)]
    proc = subprocess.run(command, env=jobs.job_env({"TFDIST_CPU_DEVICES": "2"}), capture_output=True, text=True,
                          timeout=budget)
    return proc.stdout + proc.stderr


def run_group(cells: list[Cell], out_dir: pathlib.Path, cell_timeout: float = CELL_TIMEOUT) -> dict[Cell, Verdict]:
    """Verdicts on ``cells`` (all single-process or all multi-worker), restarting after an error, hang or crash."""
    ranks = 2 if cells and cells[0].multi_worker else 1
    out_dir.mkdir(parents=True, exist_ok=True)
    verdicts: dict[Cell, Verdict] = {}
    remaining = list(cells)
    while remaining:
        output = _launch(remaining, out_dir, cell_timeout)
        records = _records(out_dir)
        progressed = False
        for cell in list(remaining):
            per_rank = {r: records[r][cell.name] for r in records if cell.name in records[r]}
            if len(per_rank) == ranks or (not progressed and any(rec["status"] != "ok" for rec in per_rank.values())):
                verdicts[cell] = matrix.judge(cell, per_rank)
                remaining.remove(cell)
                progressed = True
            elif progressed:
                break  # a rank left after failing a cell before this one: run this one again in a new process
            else:
                # the process died in this cell (or before any): record it, go on after it
                verdicts[cell] = Verdict(cell, "fail", "the process ended in this cell: " +
                                         " | ".join(output.strip().splitlines()[-3:])[-400:])
                remaining.remove(cell)
                break
    return verdicts


def run_cells(cells: list[Cell], out_dir: pathlib.Path, cell_timeout: float = CELL_TIMEOUT) -> dict[Cell, Verdict]:
    """Verdicts on every cell: single-process cells in one process, multi-worker ones in one job."""
    verdicts = {}
    for multi_worker in (False, True):
        group = [cell for cell in cells if cell.multi_worker == multi_worker]
        if group:
            verdicts.update(run_group(group, out_dir / ("workers" if multi_worker else "process"), cell_timeout))
    return {cell: verdicts[cell] for cell in cells}


def judge_records(out_dir: pathlib.Path) -> dict[Cell, Verdict]:
    """Verdicts on every cell recorded under ``out_dir`` (a past run's ``--out``), without running anything."""
    verdicts = {}
    for group in sorted(path for path in out_dir.iterdir() if path.is_dir()):
        records = _records(group)
        for name in dict.fromkeys(name for rank in sorted(records) for name in records[rank]):
            cell = Cell.parse(name)
            verdicts[cell] = matrix.judge(cell, {r: records[r][name] for r in records if name in records[r]})
    return verdicts


def table(verdicts: dict[Cell, Verdict]) -> str:
    """One line per cell, then the counts."""
    width = max(len(cell.name) for cell in verdicts)
    lines = [f"{'cell (' + '/'.join(matrix.NAMES) + ')':<{width}}  {'result':<20}  detail"]
    lines += [f"{cell.name:<{width}}  {v.outcome:<20}  {v.detail}" for cell, v in verdicts.items()]
    counts = {outcome: sum(v.outcome == outcome for v in verdicts.values()) for outcome in matrix.OUTCOMES}
    lines.append(f"{len(verdicts)} cells: " + ", ".join(f"{n} {outcome}" for outcome, n in counts.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.equivalence.run", description=__doc__.splitlines()[0])
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--all", action="store_true", help="the full product of the dimensions")
    choice.add_argument("--strength", type=int, default=2, help="cover every T values of T dimensions (default 2)")
    choice.add_argument("--cell", action="append", help="run these cells (a name as the table prints it)")
    parser.add_argument("--list", action="store_true", help="print the cells and the exclusions, run nothing")
    parser.add_argument("--judge", type=pathlib.Path, metavar="OUT",
                        help="print the table of a past run's records (its --out), run nothing")
    parser.add_argument("--cell-timeout", type=float, default=CELL_TIMEOUT, help="seconds before a cell is a hang")
    parser.add_argument("--out", type=pathlib.Path, help="keep the workers' records here (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.cell:
        cells = [Cell.parse(name) for name in args.cell]
    else:
        cells = matrix.full_product() if args.all else matrix.covering(args.strength)
        cells += [cell for cell in matrix.PINNED if cell not in cells]
    if args.list:
        print("\n".join(cell.name for cell in cells))
        excluded = matrix.excluded_cells()
        reasons = sorted({reason for _, reason in excluded})
        print(f"{len(cells)} cells; {len(excluded)} cells of the full product excluded by rule: " + "; ".join(reasons))
        return 0
    if args.judge:
        print(table(judge_records(args.judge)))
        return 0
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="tfdist-equivalence-"))
    started = time.monotonic()
    verdicts = run_cells(cells, out, args.cell_timeout)
    print(table(verdicts))
    print(f"{time.monotonic() - started:.0f} s; records in {out}")
    return 1 if any(v.outcome == "fail" for v in verdicts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
