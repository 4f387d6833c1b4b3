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


def _pass(name, outcomes, checks=None):
    checks = {"tfdist_imported": False} if checks is None else checks
    return passes.Pass(name, outcomes, {}, {}, checks, 1.0, 0, f"output of {name}")


APPLIED = {"patches": 24, "not_applied": []}


def test_a_test_that_passes_plain_and_not_with_tfdist_fails_the_gate():
    plain = _pass("plain", {"a": "passed", "b": "passed", "c": "failed", "d": "passed", "e": "skipped"})
    changed = _pass("tfdist", {"a": "passed", "b": "failed", "c": "failed", "e": "passed"}, APPLIED)
    result = verdict.compare(plain, changed, allowed={})
    assert result.regressions == {"b": "failed", "d": "missing"} and not result.passed
    assert "REGRESSION: b passed plain, failed with tfdist" in verdict.report(plain, changed, result)


def test_the_allow_list_excuses_its_tests_and_an_entry_that_passes_again_fails_the_gate():
    entry = allowed.Allowed("keras#1", "why", "case", "tests/x.py::test_y")
    plain = _pass("plain", {"a": "passed", "b": "passed"})
    result = verdict.compare(plain, _pass("tfdist", {"a": "passed", "b": "failed"}, APPLIED), allowed={"b": entry})
    assert result.passed and result.allowed == {"b": entry}
    result = verdict.compare(plain, _pass("tfdist", {"a": "passed", "b": "passed"}, APPLIED), allowed={"b": entry})
    assert result.stale == ["b"] and not result.passed


@pytest.mark.parametrize("plain_checks, changed_checks, problem", [
    ({"tfdist_imported": True}, APPLIED, "the plain pass imported tfdist"),
    ({"tfdist_imported": False}, {"patches": 24, "not_applied": ["loss_scale: gone"]}, r"not all applied: \['loss"),
    ({"tfdist_imported": False}, {}, "not all applied: unreported"),
    ({"tfdist_imported": False}, {"worker 0": APPLIED, "worker 1": {}}, "worker 1: tfdist's Keras fixes not all"),
])
def test_a_pass_that_did_not_run_as_it_should_fails_the_gate(plain_checks, changed_checks, problem):
    result = verdict.compare(_pass("plain", {"a": "passed"}, plain_checks),
                             _pass("tfdist", {"a": "passed"}, changed_checks), allowed={})
    assert not result.passed and re.search(problem, "\n".join(result.problems))


def test_a_plain_pass_that_passed_nothing_proves_nothing():
    result = verdict.compare(_pass("plain", {"a": "failed"}), _pass("tfdist", {"a": "failed"}, APPLIED), allowed={})
    assert not result.passed and "passed no test" in result.problems[0]


def test_a_worker_that_failed_or_never_ran_a_test_fails_it():
    assert passes._every_worker([{"a": "passed", "b": "passed", "c": "skipped"},
                                 {"a": "failed", "b": "passed"}]) == {"a": "failed", "b": "passed", "c": "failed"}
