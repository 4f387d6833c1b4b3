"""Which worker makes a multi-worker job slow, and why: each worker's medians, and one verdict.

In synchronous training every worker's step takes as long as the slowest worker's, so step
times say nothing about who was slow. ``summarize`` reads this worker's step clock
(``tfdist.step_clock``) and splits its median step into its *own work* (waiting for its own
input pipeline, then forward and backward) and *waiting for the others* (for every worker's
batch, then for the all-reduce's end). ``verdict`` compares own work across workers: a
worker whose own work takes over ``SLOWER`` (15%) longer than the fastest worker's, and
``MIN_MS`` more a step, and whose steps are slower than most of the fastest worker's (its own
work's 25th percentile above the fastest one's 75th: noise on a shared machine is not), is
named, with the part that grew (input or compute).

Worker 0 says it after each multi-worker ``fit`` (``tfdist.keras_fixes.step_report``), and, in a
long fit, every ``TFDIST_REPORT_SECONDS`` (default 300; 0: never) when someone is slow: a thread
in each worker (``start``) answers worker 0's asks through the coordination service's store.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time

import numpy as np

from tfdist import events, kvstore, step_clock

SLOWER = 0.15
MIN_MS = 1.0
MIN_STEPS = 3


@dataclasses.dataclass(frozen=True)
class Summary:
    """One worker's medians over ``steps`` steps, in milliseconds a step."""

    rank: int
    host: str
    steps: int
    step_ms: float     # from one step's start to the next's
    input_ms: float    # waiting for its own input pipeline
    compute_ms: float  # forward and backward: its batch ready to every gradient ready
    wait_ms: float     # waiting for the others: every worker's batch, then the all-reduce's end
    own_low_ms: float = float("nan")   # own work (input + compute): its steps' 25th percentile
    own_high_ms: float = float("nan")  # and 75th

    @property
    def own_ms(self) -> float:
        return self.input_ms + self.compute_ms


def summarize(rows: np.ndarray, columns: dict[str, int], rank: int, host: str) -> Summary | None:
    """The medians of ``rows`` (``step_clock`` rows; ``columns``: name -> index), or None under MIN_STEPS steps."""
    def column(name: str) -> np.ndarray:
        return rows[:, columns[name]] if len(rows) else np.zeros(0)

    complete = ~np.isnan(column("input_start")) & ~np.isnan(column("data")) & ~np.isnan(column("reduced"))
    if complete.sum() < MIN_STEPS:
        return None
    rows = rows[complete]
    period = np.diff(column("input_start"))
    period = period[period > 0]

    def median_ms(values: np.ndarray) -> float:
        return float(np.median(values) * 1e3) if len(values) else float("nan")

    own = (column("input_end") - column("input_start")) + (column("grads") - column("data"))
    return Summary(rank, host, int(len(rows)), median_ms(period),
                   median_ms(column("input_end") - column("input_start")),
                   median_ms(column("grads") - column("data")),
                   median_ms((column("data") - column("input_end")) + (column("reduced") - column("grads"))),
                   float(np.percentile(own, 25) * 1e3), float(np.percentile(own, 75) * 1e3))


def own(rank: int, since: int = 0) -> Summary | None:
    """This worker's medians of its steps numbered ``since`` on (``step_clock``), or None under MIN_STEPS steps."""
    return summarize(step_clock.rows(since), step_clock.INDEX, rank, socket.gethostname())


def verdict(summaries: list[Summary]) -> list[tuple[Summary, str]]:
    """The workers slower than the fastest one, slowest first, each with why (a phrase)."""
    if len(summaries) < 2:
        return []
    best = min(summaries, key=lambda s: s.own_ms)
    named = []
    for summary in sorted(summaries, key=lambda s: s.own_ms, reverse=True):
        excess = summary.own_ms - best.own_ms
        if excess <= MIN_MS or excess <= SLOWER * best.own_ms or summary.own_low_ms <= best.own_high_ms:
            continue  # a small difference, or steps that overlap the fastest worker's: noise
        input_share = (summary.input_ms - best.input_ms) / excess
        cause = "waiting for its input" if input_share >= 0.5 else "computing"
        share = input_share if input_share >= 0.5 else 1 - input_share
        slower = excess / best.own_ms if best.own_ms > 0 else float("inf")
        named.append((summary, f"{slower:.0%} slower than the fastest worker (own work "
                               f"{summary.own_ms:.1f} ms a step against {best.own_ms:.1f}); {min(share, 1):.0%} "
                               f"of it {cause}"))
    return named


def report(summaries: list[Summary], size: int, what: str) -> list[str]:
    """The lines worker 0 prints about ``what`` ("fit", "the last 5 minutes"): a verdict line, and each
    worker's line when one is named."""
    summaries = sorted(summaries, key=lambda s: s.rank)
    missing = sorted(set(range(size)) - {s.rank for s in summaries})
    if not summaries:  # no worker timed its steps (a fit of under MIN_STEPS steps): nothing to say
        return []
    if len(summaries) < 2:
        return [f"tfdist: {what}: no straggler report: fewer than {MIN_STEPS} timed steps from worker(s) {missing}"]
    step = np.median([s.step_ms for s in summaries])
    head = (f"tfdist: {what}: {len(summaries)} workers, {step:.1f} ms a step (median of "
            f"{min(s.steps for s in summaries)} steps)" + (f"; no steps from worker(s) {missing}" if missing else ""))
    named = verdict(summaries)
    if not named:
        return [f"{head}; no straggler"]  # short: it ends most fits, on terminals of 80 columns
    lines = [f"{head}; straggler: " + "; ".join(f"worker {s.rank} on host {s.host}: {why}" for s, why in named)]
    lines += [f"  worker {s.rank} ({s.host}): input {s.input_ms:.1f} ms, compute {s.compute_ms:.1f} ms, waiting for "
              f"the others {s.wait_ms:.1f} ms" for s in summaries]
    return lines


# The periodic report of a long fit ------------------------------------------------------------------

ENV_PERIOD = "TFDIST_REPORT_SECONDS"
DEFAULT_PERIOD_S = 300.0
_REQUEST = "tfdist/report/periodic/request"


def period_from_env(environ: dict | None = None) -> float:
    """``TFDIST_REPORT_SECONDS``: how often worker 0 reports a straggler in a long fit (default 300; 0 never).

    Raises:
        ValueError: not a number of seconds >= 0.
    """
    raw = (os.environ if environ is None else environ).get(ENV_PERIOD, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_PERIOD_S
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(f"{ENV_PERIOD}={raw!r} is not a number of seconds: set it to how often worker 0 says which "
                         f"worker is slow during a fit, e.g. {DEFAULT_PERIOD_S:g} (the default), or 0 for never.")
    return value


def start(rank: int, size: int) -> None:
    """In a multi-worker process (once, as its strategy is built): the thread of the periodic report."""
    period = period_from_env()
    if size > 1 and period > 0:
        threading.Thread(target=_every_period, args=(rank, size, period), name="tfdist-stragglers",
                         daemon=True).start()


def _every_period(rank: int, size: int, period: float) -> None:
    """Worker 0 asks for every worker's medians of the steps since its last ask, and says who is slow (if anyone);
    the others answer each ask once. Off the training thread; nothing when no steps ran."""
    if rank == 0:
        kvstore.put(_REQUEST, "0")  # exists from the start: reading it never leaves a call pending
    tick, state = min(period, 10.0), {"asked": 0, "since": 0}
    while True:
        time.sleep(period if rank == 0 else tick)
        try:
            _one_period(rank, size, period, tick, state)
        except Exception as error:  # noqa: BLE001  (a report is not worth a job: say it, try again next period)
            print(f"tfdist: the periodic straggler report failed: {error!r}", file=sys.stderr, flush=True)


def _one_period(rank: int, size: int, period: float, tick: float, state: dict[str, int]) -> None:
    """One look of ``_every_period``; ``state``: the asks so far and the first step not reported yet."""
    if rank == 0:
        if step_clock.count() - state["since"] < MIN_STEPS:
            return
        state["asked"] += 1
        kvstore.put(_REQUEST, str(state["asked"]))
    else:
        value = kvstore.get(_REQUEST)
        if not value or int(value) <= state["asked"]:
            return
        state["asked"] = int(value)
    mine = own(rank, state["since"])
    state["since"] = step_clock.count()
    answers = f"{_REQUEST}/{state['asked']}/"
    kvstore.put(f"{answers}{rank}", json.dumps(None if mine is None else dataclasses.asdict(mine)))
    if rank != 0:
        return
    deadline, found = time.monotonic() + tick + 5, [mine] if mine is not None else []
    for peer in range(1, size):
        value = kvstore.wait_for(f"{answers}{peer}", deadline)
        kvstore.delete(f"{answers}{peer}")
        if value and value != "null":
            found.append(Summary(**json.loads(value)))
    kvstore.delete(f"{answers}0")
    lines = report(found, size, f"the last {period:g} s")
    if verdict(found):  # quiet unless someone is slow: the fit's end says the rest
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        events.instant("report", lines[0])
