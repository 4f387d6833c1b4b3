"""The gate's verdict: the tests that pass plain and do not pass with tfdist, and whether the allow-list excuses them."""

from __future__ import annotations

import dataclasses

from tests.keras_gate.allowed import ALLOWED, Allowed
from tests.keras_gate.passes import Pass


@dataclasses.dataclass(frozen=True)
class Verdict:
    regressions: dict[str, str]     # test -> its outcome with tfdist ('missing': never reported)
    allowed: dict[str, Allowed]     # tests that regress, each on the allow-list
    stale: list[str]                # allow-listed tests that ran and did not regress: drop them from the list
    problems: list[str]             # a pass that did not run as it should (no test passed, fixes not applied)

    @property
    def passed(self) -> bool:
        return not (self.regressions or self.stale or self.problems)


def compare(plain: Pass, changed: Pass, allowed: dict[str, Allowed] = ALLOWED) -> Verdict:
    """Every test that passed in ``plain`` must pass in ``changed``, unless ``allowed`` names it."""
    regressions, excused = {}, {}
    for test, outcome in plain.outcomes.items():
        after = changed.outcomes.get(test, "missing")
        if outcome != "passed" or after == "passed":
            continue
        if _key(test) in allowed:
            excused[test] = allowed[_key(test)]
        else:
            regressions[test] = after
    stale = sorted(key for key in allowed
                   if any(_key(test) == key and changed.outcomes.get(test) == "passed" for test in plain.outcomes))
    return Verdict(regressions, excused, stale, problems(plain, changed))


def problems(plain: Pass, changed: Pass) -> list[str]:
    """Why the comparison would prove nothing: the plain pass passed no test or saw tfdist; the other pass did
    not apply every fix of tfdist's."""
    found = [] if plain.count("passed") else [f"the {plain.name} pass passed no test (exit {plain.returncode}):\n"
                                              f"{plain.output[-3000:]}"]
    if plain.checks.get("tfdist_imported", True):
        found.append(f"the {plain.name} pass imported tfdist, or did not report whether it did")
    for where, checks in _per_worker(changed.checks).items():
        if not checks.get("patches") or checks.get("not_applied", ["unreported"]):
            found.append(f"{where}: tfdist's Keras fixes not all applied: "
                         f"{checks.get('not_applied', 'unreported')} of {checks.get('patches')}")
    return found


def _per_worker(checks: dict) -> dict[str, dict]:
    """A pass's checks by process: {'tfdist': checks} for one process, {'FILE: worker 0': ..., ...} under tfdist run."""
    return checks if checks and all("worker " in key for key in checks) else {"tfdist": checks}


def _key(test: str) -> str:
    """'trainers/trainer_test.py::TestTrainer::test_x', the allow-list's key, from a pytest node id."""
    return test.replace("\\", "/")


def report(plain: Pass, changed: Pass, verdict: Verdict) -> str:
    """The counts of both passes, then every regression (with tfdist's output for it), excuse and stale entry."""
    lines = [f"Keras' own tests, {plain.name}: {plain.counts()}",
             f"Keras' own tests, {changed.name}: {changed.counts()}"]
    lines += [f"  check ({changed.name}): {key} = {value}" for key, value in changed.checks.items()]
    lines += [f"  not collected in both passes: {name}: {error}" for name, error in sorted(plain.collection_errors.items())
              if name in changed.collection_errors]
    lines += [f"ALLOWED (fails with tfdist, Keras is wrong on one device: {entry.issue}): {test}"
              for test, entry in sorted(verdict.allowed.items())]
    lines += [f"STALE allow-list entry (passes with tfdist now: remove it): {test}" for test in verdict.stale]
    lines += [f"REGRESSION: {test} passed plain, {outcome} with tfdist" for test, outcome in
              sorted(verdict.regressions.items())]
    lines += [f"PROBLEM: {problem}" for problem in verdict.problems]
    for test in sorted(verdict.regressions):
        lines += ["", f"{test}, {changed.name}:", changed.failures.get(test) or changed.output[-4000:]]
    lines.append("gate: " + ("passed" if verdict.passed else f"FAILED: {len(verdict.regressions)} regression(s), "
                                                           f"{len(verdict.stale)} stale allow-list entries, "
                                                           f"{len(verdict.problems)} problem(s)"))
    return "\n".join(lines)
