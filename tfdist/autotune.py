"""Autotune: the gradient bucket setting picked from step times measured in the first training steps.

No fixed bucket setting is best on every link, model and machine (benchmarks/RESULTS.md,
issue 34). So while a multi-worker ``fit`` runs its first steps (real training steps), tfdist
tries a few settings that are all exact (one pack, and buckets of a few sizes: with 2
workers the weights do not depend on the choice, bit for bit; with more, the choice changes
only float rounding, identically on every worker), times whole steady-state calls of each,
in alternating rounds, and keeps the fastest. Horovod's ``HOROVOD_AUTOTUNE`` does the same
for its fusion threshold; PyTorch DDP rebuilds its buckets after the first iteration.

* Each candidate is its own traced train function (traced once, on its first call, which is
  not timed), so switching costs no retrace after the first; once settled, the chosen
  function is called directly and tuning costs nothing.
* Every worker runs the same schedule (it depends only on the gradients' sizes), and the
  chief's step times are broadcast before the choice, so every worker picks the same setting
  at the same step.
* The chief prints the choice and its step times once, and writes them to ``file_path()``,
  keyed by the workers' hosts and the gradients' sizes: a later run with the same key
  applies the recorded choice without measuring.
* Off by default (issue 52): on the links measured it chose within 0.98-1.03 of the best fixed setting,
  and its ~150 steps of trials (a trace per candidate) cost a new job more than that won back
  (benchmarks/RESULTS.md). On with ``TFDIST_AUTOTUNE=1`` or ``set_autotune(True)``; a bucket size you
  set (``TFDIST_BUCKET_BYTES``, ``tfdist.set_bucket_bytes``) is never tuned.

The Keras wiring (which train function, when) is ``tfdist.keras_fixes.autotune_fit``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Callable, Mapping, Sequence

from tfdist import atomic_files, buckets, cluster, events

ENV = cluster.ENV_AUTOTUNE
ENV_FILE = cluster.ENV_AUTOTUNE_FILE
KIB, MIB = 1 << 10, 1 << 20
# (bucket_bytes, first_bucket_bytes) tried, in order of preference (first: tfdist.buckets' defaults, spelled
# out: buckets may still be importing when this module is); only those giving distinct plans for the model's
# gradients count, at most MAX_CANDIDATES of them.
GRID = ((4 * MIB, 1 * MIB), (0, 0), (4 * MIB, 4 * KIB),
        (256 * KIB, 4 * KIB), (16 * MIB, 4 * MIB), (1 * MIB, 256 * KIB))
MAX_CANDIDATES = 3
TURN_STEPS = 16  # steps timed per candidate and round (whole calls: at least this many)
ROUNDS = 2       # rounds over the candidates, every other one in reverse order

_switch: bool | None = None  # set_autotune's value; None: the environment decides
_chosen: dict[str, "Choice"] = {}  # key -> the choice this process made or reused


def set_autotune(enabled: bool) -> None:
    """Turns autotuning of the gradient buckets on or off for this process (default: ``TFDIST_AUTOTUNE``, else off).

    Call it before ``fit``, with the same value on every worker.

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"set_autotune takes True or False; received enabled={enabled!r}.")
    global _switch
    _switch = enabled


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether autotune is on: ``set_autotune``, else ``TFDIST_AUTOTUNE`` (``1`` turns it on), else off.

    Raises:
        ValueError: ``TFDIST_AUTOTUNE`` is neither 0 nor 1.
    """
    if _switch is not None:
        return _switch
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{ENV}={raw!r}: set it to 1 (tune the gradient buckets while training) or 0 (keep the "
                         "default buckets, as when it is unset), or unset it.")
    return raw == "1"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One exact bucket setting (``tfdist.set_bucket_bytes``'s arguments)."""

    bucket_bytes: int
    first_bucket_bytes: int

    def __str__(self) -> str:
        if self.bucket_bytes == 0:
            return "one pack"
        return f"buckets {_size(self.bucket_bytes)}, first {_size(self.first_bucket_bytes)}"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The setting picked, and the chief's ms per step of every candidate in every round."""

    setting: Setting
    step_ms: dict[str, list[float]]  # str(candidate) -> ms per step, one per round
    steps: int                       # training steps it took to decide (0: reused from the file)
    key: str

    def describe(self) -> str:
        """One line: the choice, then each candidate's ms per step in each round."""
        if not self.step_ms:
            return f"tfdist autotune: {self.setting} (recorded in {file_path()})"
        times = "; ".join(f"{name} {', '.join(f'{ms:.1f}' for ms in rounds)}" for name, rounds in self.step_ms.items())
        return f"tfdist autotune: {self.setting} after {self.steps} steps (ms per step, each round: {times})"

    def to_dict(self) -> dict:
        return {"setting": dataclasses.asdict(self.setting), "label": str(self.setting),
                "step_ms": self.step_ms, "steps": self.steps}


def candidates(sizes: Sequence[int], kinds: Sequence) -> list[Setting]:
    """The settings of ``GRID`` that give distinct bucket plans for gradients of ``sizes`` bytes (at most 3)."""
    found: dict[str, Setting] = {}
    for bucket_bytes, first in GRID:
        plan = repr(buckets.plan(sizes, bucket_bytes, first, kinds))
        found.setdefault(plan, Setting(bucket_bytes, first))
    return list(found.values())[:MAX_CANDIDATES]


def key(hosts: Sequence[str], sizes: Sequence[int], kinds: Sequence) -> str:
    """What a recorded choice is valid for: the workers' hosts (in rank order) and the gradients."""
    gradients = hashlib.sha256(repr((list(sizes), [str(k) for k in kinds])).encode()).hexdigest()[:16]
    return f"{len(hosts)} workers on {','.join(hosts)}; gradients {sum(sizes)} bytes in {len(sizes)}, {gradients}"


def chosen(key_: str) -> Choice | None:
    """The choice this process made (or reused) for ``key_``."""
    return _chosen.get(key_)


def last_choice() -> Choice | None:
    """The latest choice this process made or reused (for ``tfdist bench``)."""
    return list(_chosen.values())[-1] if _chosen else None


def status(train_function) -> str | None:
    """One line for a report (``tfdist bench``): the choice, or how far a tuner still measuring got; None when
    autotune did not run (off, a bucket size of yours, one worker)."""
    if isinstance(train_function, Tuner):
        return (f"tfdist autotune: still measuring after {train_function.steps_run} steps "
                f"({', '.join(map(str, train_function.settings))}); the default buckets apply until it settles")
    choice = last_choice()
    return choice.describe() if choice else None


def file_path(environ: Mapping[str, str] | None = None) -> str:
    """Where the chief records its choices: ``TFDIST_AUTOTUNE_FILE``, else ``~/.cache/tfdist/autotune.json``."""
    environ = os.environ if environ is None else environ
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return environ.get(ENV_FILE) or os.path.join(cache, "tfdist", "autotune.json")


def recorded(key_: str) -> Setting | None:
    """The setting recorded in ``file_path()`` for ``key_`` (None: none, or an unreadable file)."""
    try:
        with open(file_path()) as f:
            entry = json.load(f).get(key_)
        return Setting(**entry["setting"]) if entry else None
    except (OSError, ValueError, TypeError, KeyError):
        return None


def apply(choice: Choice, chief: bool, record: bool) -> None:
    """Makes ``choice`` this process's bucket setting; the chief prints it and (``record``) writes it down."""
    _chosen[choice.key] = choice
    buckets.use_tuned(choice.setting.bucket_bytes, choice.setting.first_bucket_bytes)
    if not chief:
        return
    print(choice.describe(), file=sys.stderr, flush=True)
    if record:
        _record(choice)


def _record(choice: Choice) -> None:
    path = file_path()
    try:
        with open(path) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        entries = {}
    entries[choice.key] = choice.to_dict()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        atomic_files.write_text(path, json.dumps(entries, indent=1))
    except OSError as error:
        print(f"tfdist autotune: could not record the choice in {path} ({error}); set {ENV_FILE} to a writable "
              "file to keep it for later runs.", file=sys.stderr, flush=True)


class Tuner:
    """Stands in for a train function: calls each candidate's function in turn, times it, then settles.

    Args:
        settings: the candidates (``candidates()``), the same on every worker.
        make_function: builds a new train function (traced on its first call, with the
            bucket setting current then).
        steps_of: the training steps a call with these arguments runs (None: unknown, not timed).
        agree: the chief's ms per step (one per candidate) for every worker (a broadcast).
        settle: called once with the choice and the chosen function.
    """

    def __init__(self, settings: Sequence[Setting], make_function: Callable[[], Callable],
                 steps_of: Callable[..., int | None], agree: Callable[[list[float]], list[float]],
                 settle: Callable[[Setting, dict, int, Callable], None]):
        self.settings = list(settings)
        self._make, self._steps_of, self._agree, self._settle = make_function, steps_of, agree, settle
        order = list(range(len(self.settings)))
        self._turns = [c for r in range(ROUNDS) for c in (order if r % 2 == 0 else order[::-1])]
        self._functions: dict[int, Callable] = {}
        self._seconds = [[0.0] * ROUNDS for _ in self.settings]
        self._steps = [[0] * ROUNDS for _ in self.settings]
        self._turn = self._timed_this_turn = self.steps_run = self._most = 0
        self._chosen: Callable | None = None

    def __call__(self, *args, **kwargs):
        if self._chosen is not None:  # settled: whoever still holds the tuner gets the chosen function
            return self._chosen(*args, **kwargs)
        candidate = self._turns[self._turn]
        setting = self.settings[candidate]
        buckets.use_tuned(setting.bucket_bytes, setting.first_bucket_bytes)  # read when the function traces
        first_call = candidate not in self._functions
        if first_call:
            self._functions[candidate] = self._make()
        steps = self._steps_of(*args, **kwargs)
        start, began = time.perf_counter(), time.time()
        result = self._functions[candidate](*args, **kwargs)
        seconds = time.perf_counter() - start
        events.span("autotune", f"autotune trial: {setting}", began, began + seconds, steps=steps or 0)
        self.steps_run += steps or 0
        self._most = max(self._most, steps or 0)
        # Timed: whole calls (the most steps a call ran: not an epoch's shorter last call, whose per-call cost
        # weighs more per step), after the first call of a candidate (it traces).
        if steps and steps == self._most and not first_call:
            rounds = self._turn // len(self.settings)
            self._seconds[candidate][rounds] += seconds
            self._steps[candidate][rounds] += steps
            self._timed_this_turn += steps
        if self._timed_this_turn >= TURN_STEPS:
            self._turn, self._timed_this_turn = self._turn + 1, 0
            if self._turn == len(self._turns):
                self._decide()
        return result

    def _decide(self) -> None:
        local = [sum(s) / sum(n) * 1000 for s, n in zip(self._seconds, self._steps)]
        chief = self._agree(local)  # every worker decides on the chief's numbers
        best = min(range(len(self.settings)), key=lambda c: (chief[c], c))
        step_ms = {str(s): [1000 * t / n for t, n in zip(self._seconds[c], self._steps[c])]
                   for c, s in enumerate(self.settings)}
        self._chosen = self._functions[best]
        self._functions.clear()
        events.instant("autotune", f"autotune chose {self.settings[best]}")
        self._settle(self.settings[best], step_ms, self.steps_run, self._chosen)


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes % MIB == 0 else f"{nbytes // KIB} KiB" if nbytes % KIB == 0 else \
        f"{nbytes} B"
