"""The equivalence matrix's dimensions, its rules, and covering subsets of it (no TensorFlow here).

A cell is one value of every dimension in ``DIMENSIONS``. ``full_product()`` is every valid
cell; ``covering(t)`` a deterministic greedy subset in which every t values of t dimensions
that some valid cell combines appear together at least once (t=2: all pairs, what CI runs).
A cell is *excluded* (``exclusion``) when it makes no sense, with the reason; it *expects an
error* (``expected_error``) when tfdist cannot make it exact and says so at build time.
``judge`` turns what the workers measured into pass / fail / error by design.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Callable, Iterable

# The ways a user trains: Keras fit under tfdist's strategy, a custom loop (strategy.run with
# tfdist.DistributedOptimizer), Keras fit under keras.distribution's DataParallel (Keras' own API,
# which tfdist runs on the same devices), and tfdist.horovod (DistributedOptimizer in fit,
# DistributedGradientTape in a tf.function step and in an eager loop).
SINGLE_PROCESS_MODES = ("fit", "custom_loop", "data_parallel")  # one process, 2 logical CPUs
MULTI_WORKER_MODES = ("hvd_fit", "hvd_tape_function", "hvd_tape_eager")  # 2 worker processes

DIMENSIONS: dict[str, tuple[str, ...]] = {
    "mode": SINGLE_PROCESS_MODES + MULTI_WORKER_MODES,
    # SGD with momentum carries every Keras base-optimizer option, so each is tested on its own.
    "optimizer": ("sgd_momentum", "adam", "multi_optimizer", "loss_scale", "clipnorm", "clipvalue",
                  "global_clipnorm", "use_ema", "accumulation", "loss_scale_factor"),
    "precision": ("float32", "mixed_float16", "mixed_bfloat16", "float64_layer"),
    "buckets": ("default", "tiny", "0"),
    "wire": ("none", "fp16"),
    # even: 4 full global batches; partial_split: the last global batch (5) split 3/2 over the
    # replicas or workers; uneven_worker: split 4/1, one worker's batch is partial.
    "batches": ("even", "partial_split", "uneven_worker"),
    # dense: float features; sample_weights: and per-example weights; embedding: integer ids into
    # an Embedding (sparse gradients).
    "inputs": ("dense", "sample_weights", "embedding"),
    # whole: every replica holds the whole optimizer state; sharded: shard_optimizer_state=True (ZeRO-1).
    "state": ("whole", "sharded"),
}
NAMES = tuple(DIMENSIONS)
FIT_MODES = ("fit", "data_parallel")  # Keras fit on one process's replicas


@dataclasses.dataclass(frozen=True)
class Cell:
    mode: str
    optimizer: str
    precision: str
    buckets: str
    wire: str
    batches: str
    inputs: str
    state: str

    @property
    def name(self) -> str:
        return "/".join(getattr(self, dim) for dim in NAMES)

    @classmethod
    def parse(cls, name: str) -> "Cell":
        values = name.split("/")
        if len(values) != len(NAMES):
            raise ValueError(f"A cell name has {len(NAMES)} parts ({'/'.join(NAMES)}); received {name!r}.")
        for dim, value in zip(NAMES, values):
            if value not in DIMENSIONS[dim]:
                raise ValueError(f"Unknown {dim} {value!r} in cell {name!r}; choose one of {list(DIMENSIONS[dim])}.")
        return cls(*values)

    @property
    def multi_worker(self) -> bool:
        return self.mode in MULTI_WORKER_MODES


# Rules: (predicate, reason). The first that matches a cell decides.
EXCLUSIONS: list[tuple[Callable[[Cell], bool], str]] = [
    (lambda c: c.mode in SINGLE_PROCESS_MODES and c.batches == "uneven_worker",
     "one process with 2 replicas has no worker that runs out alone (partial_split covers a partial batch "
     "split over its replicas)"),
    (lambda c: c.mode.startswith("hvd_tape") and c.state == "sharded",
     "a DistributedGradientTape applies through a plain optimizer in each one-replica process: nothing to shard "
     "over (hvd_fit's sharded cells pin the refusal)"),
]

# Combinations tfdist refuses at build time because it cannot make them exact: (predicate, the
# error's pattern, why).
ERRORS_BY_DESIGN: list[tuple[Callable[[Cell], bool], str, str]] = [
    (lambda c: c.optimizer == "multi_optimizer" and (c.mode in ("custom_loop", "hvd_fit")
                                                     or (c.mode in FIT_MODES and c.wire == "fp16")),
     r"DistributedOptimizer wraps one optimizer; received a MultiOptimizer",
     "a DistributedOptimizer rebuilds its optimizer from the config, which a MultiOptimizer's is not; the error "
     "says to wrap the inner optimizers (a MultiOptimizer under tfdist.scope() alone is exact)"),
    (lambda c: c.state == "sharded" and c.mode == "hvd_fit",
     r"tfdist.horovod does not shard optimizer state: Horovod scripts save on rank 0 alone",
     "a Horovod script saves on rank 0 alone, which cannot gather the other ranks' shards"),
    (lambda c: c.state == "sharded" and c.optimizer == "multi_optimizer",
     r"cannot shard the state of MultiOptimizer", "its inner optimizers' updates are not checked element by element"),
    (lambda c: c.state == "sharded" and c.optimizer == "accumulation",
     r"does not shard gradient accumulation \(", "the accumulators hold each replica's unreduced gradients: "
     "splitting them would cost a collective on every micro-batch"),
]

# Cells known to differ from one device today, each with its cause (issue 28 stays open for them). Such a
# cell that fails is a "known failure", not a "fail"; one that passes is a pass, and the rule should go.
# Empty since issue 43: fit's partial splits weigh as one device; loss_scale_factor with an Embedding, which Keras
# cannot train on one device (it divides an IndexedSlices by a float), is "one device fails too".
KNOWN_FAILURES: list[tuple[Callable[[Cell], bool], str]] = []


# Cells that once failed for a cause the pairs alone need not meet again; CI runs them with the pairs.
PINNED = [Cell.parse(name) for name in (
    "hvd_tape_function/loss_scale/float32/default/fp16/even/dense/whole",  # scaled gradients on a float16 wire
    # sharded state under DataParallel: a densified Embedding gradient has no static size (the weight's is used)
    "data_parallel/adam/mixed_float16/0/fp16/partial_split/embedding/sharded",
)]


def exclusion(cell: Cell) -> str | None:
    """Why ``cell`` makes no sense (it is left out of the matrix), or None."""
    return next((reason for rule, reason in EXCLUSIONS if rule(cell)), None)


def known_failure(cell: Cell) -> str | None:
    """Why ``cell`` is known to differ from one device today, or None."""
    return next((reason for rule, reason in KNOWN_FAILURES if rule(cell)), None)


def expected_error(cell: Cell) -> str | None:
    """The pattern of the build-time error tfdist raises for ``cell`` by design, or None."""
    return next((pattern for rule, pattern, _ in ERRORS_BY_DESIGN if rule(cell)), None)


def full_product() -> list[Cell]:
    """Every valid cell, in product order."""
    return [cell for cell in (Cell(*values) for values in itertools.product(*DIMENSIONS.values()))
            if exclusion(cell) is None]


def excluded_cells() -> list[tuple[Cell, str]]:
    cells = (Cell(*values) for values in itertools.product(*DIMENSIONS.values()))
    return [(cell, reason) for cell in cells if (reason := exclusion(cell)) is not None]


def _tuples(cell, strength: int) -> Iterable[tuple]:
    values = dataclasses.astuple(cell)
    for dims in itertools.combinations(range(len(values)), strength):
        yield tuple((d, values[d]) for d in dims)


def covering(strength: int = 2, cells: list | None = None) -> list:
    """A greedy, deterministic subset of ``cells`` (default: the full product; any frozen dataclasses) covering
    every t-tuple.

    Every combination of ``strength`` values (of as many dimensions) that some cell of ``cells``
    holds is held by at least one chosen cell. Each round takes the cell covering the most
    tuples not yet covered (ties: the first in product order).
    """
    cells = full_product() if cells is None else cells
    width = len(dataclasses.fields(cells[0])) if cells else len(NAMES)
    if not 1 <= strength <= width:
        raise ValueError(f"strength must be between 1 and {width}; received strength={strength!r}.")
    holders: dict[tuple, list[int]] = {}
    for index, cell in enumerate(cells):
        for key in _tuples(cell, strength):
            holders.setdefault(key, []).append(index)
    counts = [0] * len(cells)
    for indices in holders.values():
        for index in indices:
            counts[index] += 1
    chosen = []
    while holders:
        best = max(range(len(cells)), key=lambda i: (counts[i], -i))
        chosen.append(cells[best])
        for key in _tuples(cells[best], strength):
            for index in holders.pop(key, ()):
                counts[index] -= 1
    return chosen


def covers(chosen: list, strength: int = 2, cells: list | None = None) -> bool:
    """Whether ``chosen`` holds every t-tuple some cell of ``cells`` (default: every valid cell) holds."""
    needed = {key for cell in (full_product() if cells is None else cells) for key in _tuples(cell, strength)}
    return needed <= {key for cell in chosen for key in _tuples(cell, strength)}


# Weight updates (final minus initial weights) may differ from one device's by this much,
# relative to the update's norm: float rounding of the compute dtype (a sum split over
# replicas rounds differently), and float16 on the wire (about 3 decimal digits).
# bfloat16 keeps 8 significant bits, and where the CPU has native bfloat16 kernels
# (avx512_bf16, as GPUs) every op rounds to it: Adam's update of an element whose gradient
# nearly cancels then flips sign. Measured on one cell (hvd_fit/adam/mixed_bfloat16/0/none/
# uneven_worker/dense): 0.0013 on a CPU without avx512_bf16, 0.047 on an EPYC with it. So the
# bfloat16 cells check the wiring (casts, one step, no loss scale) coarsely; how uneven and
# partial batches are weighed is checked to 1e-4 by the float32 cells of the same dimensions.
TOLERANCE = {"float32": 1e-4, "float64_layer": 1e-4, "mixed_float16": 5e-3, "mixed_bfloat16": 1e-1}
FP16_WIRE_TOLERANCE = 5e-3


def tolerance(cell: Cell) -> float:
    return max(TOLERANCE[cell.precision], FP16_WIRE_TOLERANCE if cell.wire == "fp16" else 0.0)


# "one device fails too": Keras itself cannot train the cell on one device (whether or not the distributed run
# fails as well), so there is nothing to be equivalent to; listed apart from tfdist's failures.
OUTCOMES = ("pass", "fail", "known failure", "error by design", "one device fails too")
ONE_DEVICE_FAILS = "FailsOnOneDeviceToo"  # the error cells.run raises then
DISTRIBUTED_TRAINED = "(the distributed run trained)"  # in it when only the one-device reference failed


@dataclasses.dataclass(frozen=True)
class Verdict:
    cell: Cell
    outcome: str  # one of OUTCOMES
    detail: str


def _last_line(error: str) -> str:
    """An error in one line: the last line that names an exception (TensorFlow's "in user code:" ends with
    the cause) and the line after it."""
    lines = [re.sub(r"\x1b\[[0-9;]*m|\[[0-9;]*m", "", line).strip() for line in error.splitlines()]
    lines = [line for line in lines if line]
    named = [i for i, line in enumerate(lines) if re.match(r"[A-Z]\w*(Error|Exception|Exit)\b.*:", line)]
    if not named:
        return " ".join(lines)[:240]
    return " ".join(lines[named[-1]:named[-1] + 2])[:240]


def judge(cell: Cell, per_rank: dict[int, dict]) -> Verdict:
    """The verdict on ``cell`` from each rank's record (``equivalence_job`` writes them)."""
    verdict = _judge(cell, per_rank)
    known = known_failure(cell)
    if verdict.outcome == "fail" and known is not None:
        return Verdict(cell, "known failure", f"{verdict.detail} [{known}]")
    return verdict


def _judge(cell: Cell, per_rank: dict[int, dict]) -> Verdict:
    expected = expected_error(cell)
    records = [per_rank[r] for r in sorted(per_rank)]
    problems = [f"rank {r}: {rec['status']}: {_last_line(rec.get('error', ''))}" for r, rec in sorted(per_rank.items())
                if rec["status"] != "ok"]
    if expected is not None:
        if records and all(rec["status"] == "error" and re.search(expected, rec["error"]) for rec in records):
            return Verdict(cell, "error by design", _last_line(records[0]["error"]))
        return Verdict(cell, "fail", f"expected an error matching {expected!r}; got " +
                       ("; ".join(problems) or "a finished training"))
    if 0 not in per_rank:
        return Verdict(cell, "fail", "rank 0 recorded nothing; " + ("; ".join(problems) or "the others trained"))
    if per_rank[0]["status"] == "error" and per_rank[0]["error"].startswith(ONE_DEVICE_FAILS) and all(
            rec["status"] == ("ok" if DISTRIBUTED_TRAINED in per_rank[0]["error"] else "error") for rec in records[1:]):
        return Verdict(cell, "one device fails too", _last_line(per_rank[0]["error"]))
    if problems:
        return Verdict(cell, "fail", "; ".join(problems))
    first = per_rank[0]  # rank 0 trained the one-device reference too
    across = max(abs(a - b) for rec in records[1:] for a, b in zip(rec["weights"], first["weights"])) \
        if len(records) > 1 else 0.0
    failures = []
    if across > 0:
        failures.append(f"weights differ across ranks by {across:.3g}")
    if first["iterations"] != first["reference_iterations"]:
        failures.append(f"optimizer.iterations {first['iterations']} vs {first['reference_iterations']} on one device")
    if first["loss_scale"] != first["reference_loss_scale"]:
        failures.append(f"loss scale {first['loss_scale']} vs {first['reference_loss_scale']} on one device "
                        "(different skipped steps)")
    if not first["finite"]:
        failures.append("non-finite weights")
    limit = tolerance(cell)
    if not first["difference"] <= limit:
        failures.append(f"update differs from one device's by {first['difference']:.3g} (relative; "
                        f"tolerance {limit:g})")
    if failures:
        return Verdict(cell, "fail", "; ".join(failures))
    return Verdict(cell, "pass", f"difference {first['difference']:.2g}")
