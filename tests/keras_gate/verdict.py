"""The gate's verdict: the tests that pass plain and do not pass with tfdist, and whether the allow-list excuses them.

The plain pass collects every test but needs to run only those that did not pass with tfdist (``plain_runs``): a
test that passed with tfdist is no regression, whatever it does plain.
"""

from __future__ import annotations

import dataclasses

from tests.keras_gate.allowed import ALLOWED, Allowed
from tests.keras_gate.passes import Pass


@dataclasses.dataclass(frozen=True)
class Verdict:
    regressions: dict[str, str]     # test -> its outcome with tfdist ('missing': never reported)
    allowed: dict[str, Allowed]     # tests that regress, each on the allow-list
    stale: list[str]                # allow-listed tests that passed with tfdist: drop them from the list
    problems: list[str]             # a pass that did not run as it should (nothing collected, fixes not applied, ...)

    @property
    def passed(self) -> bool:
        return not (self.regressions or self.stale or self.problems)


def plain_runs(plain: Pass, changed: Pass) -> list[str]:
    """The tests ``plain`` collected that must run plain for the verdict: those that did not pass in ``changed``
    (failed, skipped, or missing from it)."""
    return [test for test in plain.collected if changed.outcomes.get(test) != "passed"]


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
                   if any(_key(test) == key and changed.outcomes.get(test) == "passed" for test in plain.collected))
    return Verdict(regressions, excused, stale, problems(plain, changed))


def problems(plain: Pass, changed: Pass) -> list[str]:
    """Why the comparison would prove nothing: the plain pass collected no test, did not run one that did not pass
    with tfdist, or saw tfdist; no test passed in either pass; the other pass did not apply every fix of tfdist's."""
    found = [] if plain.collected else [f"the {plain.name} pass collected no test (exit {plain.returncode}):\n"
                                        f"{plain.output[-3000:]}"]
    not_run = [test for test in plain_runs(plain, changed) if test not in plain.outcomes]
    if not_run:
        found.append(f"the {plain.name} pass did not run {len(not_run)} test(s) that did not pass with tfdist, "
                     f"{not_run[0]} first (exit {plain.returncode}):\n{plain.output[-3000:]}")
    if plain.collected and not (plain.count("passed") or changed.count("passed")):
        found.append(f"no test passed, {plain.name} or {changed.name}")
    if not plain.checks or any(checks.get("tfdist_imported", True) for checks in plain.checks.values()):
        found.append(f"the {plain.name} pass imported tfdist, or did not report whether it did")
    for where, checks in (changed.checks or {changed.name: {}}).items():
        if not checks.get("patches") or checks.get("not_applied", ["unreported"]):
            found.append(f"{where}: tfdist's Keras fixes not all applied: "
                         f"{checks.get('not_applied', 'unreported')} of {checks.get('patches')}")
    return found


def _key(test: str) -> str:
    """'trainers/trainer_test.py::TestTrainer::test_x', the allow-list's key, from a pytest node id."""
    return test.replace("\\", "/")


def report(plain: Pass, changed: Pass, verdict: Verdict) -> str:
    """The counts of both passes, then every regression (with tfdist's output for it), excuse and stale entry."""
    lines = [f"Keras' own tests, {plain.name} (run: the {len(plain_runs(plain, changed))} that did not pass with "
             f"tfdist): {plain.counts()}", f"Keras' own tests, {changed.name}: {changed.counts()}"]
    lines += [f"  check ({changed.name}), {where}: {checks}" for where, checks in changed.checks.items()]
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
