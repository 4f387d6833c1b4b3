"""Keras' own tests as a gate (tests/keras_gate, docs/keras-tests.md): the subset tfdist's patches touch, plain and
with tfdist imported, and Keras' tf.distribute tests under ``tfdist run -n 2``; then the gate's own logic."""

import pathlib
import re

import pytest

from tests.keras_gate import allowed, passes, run, selection, verdict
from tfdist import keras_fixes

REPO = pathlib.Path(__file__).resolve().parents[1]


def _gate(capsys, **kwargs):
    result, text = run.gate(**kwargs)
    with capsys.disabled():  # the counts show in the test output, passed or not
        print("\n" + text)
    assert result.passed, text


@pytest.mark.timeout(3600)
def test_keras_own_tests_pass_with_tfdist_imported(capsys):
    """Every test of the subset that passes in plain Keras passes with ``import tfdist`` first (allow-list aside)."""
    _gate(capsys)


@pytest.mark.timeout(1800)
def test_keras_own_distribute_tests_pass_under_tfdist_run(capsys):
    """Keras' MirroredStrategy tests, each worker of a 2-worker ``tfdist run`` job running them, pass as plain."""
    _gate(capsys, workers=2)


def test_every_patch_names_the_keras_tests_of_what_it_replaces():
    assert sorted(selection.TESTS_OF_PATCH) == sorted(patch.name for patch in keras_fixes.patches())


@pytest.mark.parametrize("test", sorted(allowed.ALLOWED))
def test_every_allow_list_entry_names_its_issue_and_a_tfdist_test_of_the_one_device_case(test):
    entry = allowed.ALLOWED[test]
    assert re.search(r"keras#\d+", entry.issue) and entry.why and entry.one_device_case, test
    path, name = re.match(r"(tests/[\w/]+\.py)::(\w+)", entry.tfdist_test).groups()
    assert f"def {name}(" in (REPO / path).read_text(), entry.tfdist_test


def _pass(name, outcomes, checks=None, collected=None):
    """A pass that collected ``collected`` (default: the tests of ``outcomes``); ``checks`` by process."""
    checks = {name: {"tfdist_imported": False}} if checks is None else checks
    collected = list(outcomes) if collected is None else collected
    return passes.Pass(name, collected, outcomes, {}, {}, checks, 1.0, 0, f"output of {name}")


FIXES = {"patches": 24, "not_applied": []}
APPLIED = {"tfdist": FIXES}


def test_a_test_that_passes_plain_and_not_with_tfdist_fails_the_gate():
    plain = _pass("plain", {"a": "passed", "b": "passed", "c": "failed", "d": "passed", "e": "skipped"})
    changed = _pass("tfdist", {"a": "passed", "b": "failed", "c": "failed", "e": "passed"}, APPLIED)
    result = verdict.compare(plain, changed, allowed={})
    assert result.regressions == {"b": "failed", "d": "missing"} and not result.passed
    assert "REGRESSION: b passed plain, failed with tfdist" in verdict.report(plain, changed, result)


def test_plain_runs_the_tests_that_did_not_pass_with_tfdist_and_only_those():
    """A test that failed, skipped or is missing from the tfdist pass runs plain; one that passed with tfdist not."""
    collection = _pass("plain", {}, collected=["a", "b", "c", "d", "e"])
    changed = _pass("tfdist", {"a": "passed", "b": "failed", "c": "skipped", "e": "passed"}, APPLIED)
    assert verdict.plain_runs(collection, changed) == ["b", "c", "d"]


def test_a_regression_found_by_the_plain_run_of_only_what_did_not_pass_with_tfdist_fails_the_gate():
    plain = _pass("plain", {"b": "passed", "c": "failed", "d": "passed"}, collected=["a", "b", "c", "d"])
    changed = _pass("tfdist", {"a": "passed", "b": "failed", "c": "failed"}, APPLIED)
    result = verdict.compare(plain, changed, allowed={})
    assert result.regressions == {"b": "failed", "d": "missing"} and not result.problems and not result.passed


def test_when_every_test_passed_with_tfdist_plain_runs_none_and_the_gate_passes():
    plain = _pass("plain", {}, collected=["a", "b"])
    changed = _pass("tfdist", {"a": "passed", "b": "passed"}, APPLIED)
    assert verdict.plain_runs(plain, changed) == [] and verdict.compare(plain, changed, allowed={}).passed


def test_the_allow_list_excuses_its_tests_and_an_entry_that_passes_again_fails_the_gate():
    entry = allowed.Allowed("keras#1", "why", "case", "tests/x.py::test_y")
    plain = _pass("plain", {"b": "passed"}, collected=["a", "b"])
    result = verdict.compare(plain, _pass("tfdist", {"a": "passed", "b": "failed"}, APPLIED), allowed={"b": entry})
    assert result.passed and result.allowed == {"b": entry}
    plain = _pass("plain", {}, collected=["a", "b"])  # passed with tfdist: not run plain, and stale all the same
    result = verdict.compare(plain, _pass("tfdist", {"a": "passed", "b": "passed"}, APPLIED), allowed={"b": entry})
    assert result.stale == ["b"] and not result.passed


@pytest.mark.parametrize("plain_checks, changed_checks, problem", [
    ({"plain": {"tfdist_imported": True}}, APPLIED, "the plain pass imported tfdist"),
    ({"collection: plain": {"tfdist_imported": False}, "run: shard 1/2: plain": {"tfdist_imported": True}}, APPLIED,
     "the plain pass imported tfdist"),
    ({"plain": {}}, APPLIED, "the plain pass imported tfdist, or did not report whether it did"),
    ({"plain": {"tfdist_imported": False}}, {"tfdist": {"patches": 24, "not_applied": ["loss_scale: gone"]}},
     r"not all applied: \['loss"),
    ({"plain": {"tfdist_imported": False}}, {"tfdist": {}}, "not all applied: unreported"),
    ({"plain": {"tfdist_imported": False}}, {"worker 0": FIXES, "worker 1": {}},
     "worker 1: tfdist's Keras fixes not all"),
    ({"plain": {"tfdist_imported": False}}, {"shard 0/2: tfdist": FIXES, "shard 1/2: tfdist": {}},
     "shard 1/2: tfdist: tfdist's Keras fixes not all"),
])
def test_a_pass_that_did_not_run_as_it_should_fails_the_gate(plain_checks, changed_checks, problem):
    result = verdict.compare(_pass("plain", {"a": "passed"}, plain_checks),
                             _pass("tfdist", {"a": "passed"}, changed_checks), allowed={})
    assert not result.passed and re.search(problem, "\n".join(result.problems))


def test_a_plain_run_that_did_not_run_a_test_that_did_not_pass_with_tfdist_fails_the_gate():
    """E.g. pytest stopped at a node id it could not find: no regression seen, and the gate fails all the same."""
    plain = _pass("plain", {"b": "passed"}, collected=["a", "b", "c"])
    result = verdict.compare(plain, _pass("tfdist", {"a": "passed", "b": "passed", "c": "failed"}, APPLIED), allowed={})
    assert not result.regressions and not result.passed
    assert "the plain pass did not run 1 test(s) that did not pass with tfdist, c first" in result.problems[0]


def test_a_plain_pass_that_collected_nothing_proves_nothing():
    result = verdict.compare(_pass("plain", {}), _pass("tfdist", {"a": "passed"}, APPLIED), allowed={})
    assert not result.passed and "the plain pass collected no test" in result.problems[0]


def test_a_gate_where_no_test_passed_proves_nothing():
    result = verdict.compare(_pass("plain", {"a": "failed"}), _pass("tfdist", {"a": "failed"}, APPLIED), allowed={})
    assert not result.passed and result.problems == ["no test passed, plain or tfdist"]


def test_plain_runs_a_parametrized_test_by_its_node_id_brackets_spaces_and_all(tmp_path):
    """pytest's real collection and run (the gate's plugin, no Keras): the tests asked for run, and only those."""
    ids = ["a b", "c]d[", "e::f", "g/h", "\u00e9", " lead", "trail "]
    (tmp_path / "ids_test.py").write_text(f"import pytest\n\n@pytest.mark.parametrize('x', {ids!r})\n"
                                          "def test_p(x):\n    assert x != 'g/h'\n\n"
                                          "class TestC:\n    def test_m(self):\n        pass\n")
    collection = passes.collect(tmp_path, ["ids_test.py"])
    assert len(collection.collected) == 8 and collection.outcomes == {}, collection.output
    asked = collection.collected[:-1]
    plain = passes.rerun(tmp_path, collection, asked)
    assert plain.outcomes == {test: "failed" if "g/h" in test else "passed" for test in asked}, plain.output
    assert plain.collected == collection.collected
    assert list(plain.checks) == ["collection: plain", "run: shard 0/2: plain", "run: shard 1/2: plain"]


def test_a_pass_run_in_shards_side_by_side_is_one_pass_with_every_field():
    parts = {"shard 0/2": passes.Pass("tfdist", ["x::a", "y::c"], {"x::a": "passed", "y::c": "failed"},
                                      {"y::c": "report"}, {"z.py": "ImportError"}, {"tfdist": FIXES}, 5.0, 1, "one"),
             "shard 1/2": passes.Pass("tfdist", ["x::b"], {"x::b": "skipped"}, {}, {"z.py": "ImportError"},
                                      {"tfdist": {}}, 7.0, -1, "two")}  # timed out
    assert passes.merged("tfdist", parts, 7.5) == passes.Pass(
        "tfdist", ["x::a", "y::c", "x::b"], {"x::a": "passed", "y::c": "failed", "x::b": "skipped"},
        {"y::c": "report"}, {"z.py": "ImportError"}, {"shard 0/2: tfdist": FIXES, "shard 1/2: tfdist": {}}, 7.5, -1,
        "one\ntwo")


def test_the_shards_of_a_pass_run_every_test_once(tmp_path):
    """pytest's real run (the gate's plugin, no Keras): two shards side by side, every other test each, -k applied."""
    (tmp_path / "a_test.py").write_text("".join(f"def test_{i}():\n    pass\n" for i in range(5)))
    (tmp_path / "b_test.py").write_text("def test_5():\n    pass\n\ndef test_skipped_by_k():\n    pass\n")
    shared = passes.run(tmp_path, ["a_test.py", "b_test.py"], with_tfdist=False, extra=("-k", "not by_k"))
    tests = [f"a_test.py::test_{i}" for i in range(5)] + ["b_test.py::test_5"]
    assert shared.outcomes == dict.fromkeys(tests, "passed"), shared.output
    assert sorted(shared.collected) == tests and list(shared.checks) == ["shard 0/2: plain", "shard 1/2: plain"]
    assert shared.output.count("3 passed, 4 deselected") == 2, shared.output  # each shard ran half


def test_a_worker_that_failed_or_never_ran_a_test_fails_it():
    assert passes._every_worker([{"a": "passed", "b": "passed", "c": "skipped"},
                                 {"a": "failed", "b": "passed"}]) == {"a": "failed", "b": "passed", "c": "failed"}
