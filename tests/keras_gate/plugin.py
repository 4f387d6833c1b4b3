"""The pytest plugin of a gate pass (``pytest -p tests.keras_gate.plugin``), loaded before any test module.

With ``TFDIST_KERAS_GATE_PASS=tfdist`` it imports tfdist first, as a user's script does, so tfdist's fixes apply
when the tests import Keras; once the tests are collected it checks that every fix is applied. In the plain
pass it checks that nothing imported tfdist. It stands in for Keras' own conftest.py (not in the sdist: its
markers, and the helper some test files import from it), and writes the tests it collected, every test's outcome,
the collection errors and what it checked to ``TFDIST_KERAS_GATE_RESULT`` (JSON). With
``TFDIST_KERAS_GATE_SHARD=i/n`` it runs only every n-th test collected, from the i-th (0-based): n such processes side
by side run every test once.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

PASS_ENV, RESULT_ENV = "TFDIST_KERAS_GATE_PASS", "TFDIST_KERAS_GATE_RESULT"
SHARD_ENV = "TFDIST_KERAS_GATE_SHARD"
WITH_TFDIST = os.environ.get(PASS_ENV) == "tfdist"

if WITH_TFDIST:
    import tfdist  # noqa: F401  (arms its start-up hook: the Keras fixes apply when Keras is imported)


def skip_if_backend(given_backend, reason):
    """Keras' conftest.py helper (``from conftest import skip_if_backend`` in some of its test files)."""
    from keras.src.backend import backend

    return pytest.mark.skipif(backend() == given_backend, reason=reason)


sys.modules.setdefault("conftest", sys.modules[__name__])

_collected: list[str] = []  # node ids, -k's and the shard's deselection applied
_outcomes: dict[str, str] = {}
_failures: dict[str, str] = {}  # a failed test's report, its end
_collection_errors: dict[str, str] = {}
_checks: dict[str, object] = {"pass": "tfdist" if WITH_TFDIST else "plain"}


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_trainable_backend: mark test for trainable backend only")
    config.addinivalue_line("markers", "multi_device: mark test for running with multiple devices only")


@pytest.hookimpl(trylast=True)  # after -k's deselection: the shards share the tests that run
def pytest_collection_modifyitems(config, items):
    """As Keras' conftest.py on the TensorFlow backend: tests marked ``multi_device`` need several devices there.
    Then, given a shard, the other shards' tests are deselected."""
    skip = pytest.mark.skip(reason="Requires multiple devices")
    for item in items:
        if "multi_device" in item.keywords:
            item.add_marker(skip)
    if os.environ.get(SHARD_ENV):
        index, count = map(int, os.environ[SHARD_ENV].split("/"))
        config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % count != index])
        items[:] = items[index::count]


def pytest_collection_finish(session):
    """The tests imported Keras by now: check that tfdist's fixes are applied (or, plain, that tfdist is absent)."""
    _collected.extend(item.nodeid for item in session.items)
    if not WITH_TFDIST:
        _checks["tfdist_imported"] = "tfdist" in sys.modules
        return
    from tfdist import keras_fixes

    patches = keras_fixes.patches()
    _checks["patches"] = len(patches)
    _checks["not_applied"] = [f"{patch.name}: {patch.problem or 'not applied'}" for patch in patches if not patch.applied]


def pytest_collectreport(report):
    if report.failed:
        _collection_errors[report.nodeid] = str(report.longrepr).strip().splitlines()[-1][:300]


def pytest_runtest_logreport(report):
    """A test's outcome: 'failed' if any phase failed, 'skipped' if its setup or call skipped, else 'passed'."""
    if report.failed:
        _outcomes[report.nodeid] = "failed"
        _failures[report.nodeid] = report.longreprtext[-4000:]
    elif report.skipped and _outcomes.get(report.nodeid) != "failed":
        _outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.nodeid not in _outcomes:
        _outcomes[report.nodeid] = "passed"


def pytest_sessionfinish(session, exitstatus):
    if not WITH_TFDIST:
        _checks["tfdist_imported"] = _checks.get("tfdist_imported") or "tfdist" in sys.modules
    path = os.environ.get(RESULT_ENV)
    if path:
        with open(path, "w") as file:
            json.dump({"collected": _collected, "outcomes": _outcomes, "failures": _failures,
                       "collection_errors": _collection_errors, "checks": _checks}, file)
