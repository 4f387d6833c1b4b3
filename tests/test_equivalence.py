"""The equivalence matrix (tests/equivalence/): its covering subset, its rules, and the all-pairs run.

Every pair of values of the matrix's dimensions (ways to train, optimizers and Keras'
optimizer options, precision, bucket size, fp16 wire, uneven batches, sample weights,
Embedding) trains on 2 replicas or 2 workers and must give one device's weights, step count
and skipped steps. The whole matrix: ``python -m tests.equivalence.run --all``.
"""

import re

import pytest

from tests.equivalence import matrix, run
from tests.equivalence.matrix import Cell


def test_the_pairwise_subset_is_deterministic_small_and_covers_every_pair():
    cells = matrix.covering(2)
    assert cells == matrix.covering(2)
    assert matrix.covers(cells, 2)
    assert not matrix.covers(cells[:-1], 2)  # no cell is redundant at the end: the check can fail
    assert len(cells) <= 60 < len(matrix.full_product())
    assert all(matrix.exclusion(cell) is None for cell in cells)


def test_rules_exclude_nonsense_with_a_reason():
    cell = Cell.parse("fit/adam/float32/0/none/uneven_worker/dense/whole")
    assert "no worker that runs out alone" in matrix.exclusion(cell)
    assert cell not in matrix.full_product()
    assert matrix.exclusion(Cell.parse("hvd_fit/adam/float32/0/none/uneven_worker/dense/whole")) is None


@pytest.mark.parametrize("name, message", [
    ("fit/adam", r"A cell name has 8 parts \(mode/optimizer/precision/buckets/wire/batches/inputs/state\); "
                 r"received 'fit/adam'"),
    ("fit/adamw/float32/0/none/even/dense/whole", r"Unknown optimizer 'adamw' in cell .*; choose one of \['sgd_momentum'"),
])
def test_a_bad_cell_name_is_named(name, message):
    with pytest.raises(ValueError, match=message):
        Cell.parse(name)


@pytest.mark.timeout(900)  # about 20-30 cells at a few seconds each; a hung cell costs run.CELL_TIMEOUT
@pytest.mark.parametrize("multi_worker", [False, True], ids=["one_process", "two_workers"])
def test_the_pairwise_cells_train_like_one_device(tmp_path, multi_worker):
    cells = [cell for cell in matrix.covering(2) + matrix.PINNED if cell.multi_worker == multi_worker]
    verdicts = run.run_group(cells, tmp_path)
    failed = [v for v in verdicts.values() if v.outcome == "fail"]
    assert not failed, run.table(verdicts)


def _record(**changes):
    record = {"status": "ok", "weights": [1.0, 2.0], "finite": True, "iterations": 4, "loss_scale": 8.0,
              "difference": 1e-7, "reference_iterations": 4, "reference_loss_scale": 8.0}
    return {**record, **changes}


CELL = Cell.parse("hvd_fit/loss_scale/float32/0/none/even/dense/whole")


@pytest.mark.parametrize("rank1, rank0, detail", [
    ({}, {}, r"^difference 1e-07$"),
    ({"weights": [1.0, 2.5]}, {}, r"weights differ across ranks by 0\.5"),
    ({}, {"iterations": 3}, r"optimizer\.iterations 3 vs 4 on one device"),
    ({}, {"loss_scale": 4.0}, r"loss scale 4\.0 vs 8\.0 on one device \(different skipped steps\)"),
    ({}, {"difference": 0.2}, r"update differs from one device's by 0\.2 \(relative; tolerance 0\.0001\)"),
    ({"status": "hang", "error": "no result after 90 s"}, {}, r"rank 1: hang: no result after 90 s"),
])
def test_judge_names_what_differs(rank1, rank0, detail):
    verdict = matrix.judge(CELL, {0: _record(**rank0), 1: _record(**rank1)})
    assert verdict.outcome == ("pass" if detail.startswith("^") else "fail")
    assert re.search(detail, verdict.detail), verdict.detail


def test_an_error_by_design_must_be_raised_on_every_rank(monkeypatch):
    monkeypatch.setattr(matrix, "ERRORS_BY_DESIGN", [(lambda c: c.optimizer == "loss_scale", r"cannot be exact", "")])
    error = {"status": "error", "error": "ValueError: loss_scale cannot be exact here"}
    assert matrix.judge(CELL, {0: error, 1: error}).outcome == "error by design"
    verdict = matrix.judge(CELL, {0: error, 1: _record()})
    assert verdict.outcome == "fail" and "expected an error matching" in verdict.detail


def test_a_cell_keras_cannot_train_on_one_device_is_listed_apart():
    mine = {"status": "error", "error": "FailsOnOneDeviceToo: TypeError on one device too: IndexedSlices / float"}
    other = {"status": "error", "error": "TypeError: IndexedSlices / float"}
    assert matrix.judge(CELL, {0: mine, 1: other}).outcome == "one device fails too"
    assert matrix.judge(CELL, {0: mine, 1: _record()}).outcome == "fail"  # rank 1 trained: not the same failure
    # tfdist trained it on every rank, and only the one-device reference failed: nothing to compare with
    trained = {"status": "error", "error": f"FailsOnOneDeviceToo: TypeError on one device "
                                           f"{matrix.DISTRIBUTED_TRAINED}: IndexedSlices / float"}
    assert matrix.judge(CELL, {0: trained, 1: _record()}).outcome == "one device fails too"
    assert matrix.judge(CELL, {0: trained, 1: other}).outcome == "fail"


def test_no_cell_is_a_known_failure_any_more():
    """Issue 43: fit's partial splits weigh as one device; the list stays empty (docs/equivalence.md)."""
    assert matrix.KNOWN_FAILURES == []
    verdict = matrix.judge(Cell.parse("fit/adam/float32/0/none/partial_split/dense/whole"), {0: _record(difference=0.1)})
    assert verdict.outcome == "fail"


def test_a_known_failure_is_listed_apart_with_its_cause(monkeypatch):
    monkeypatch.setattr(matrix, "KNOWN_FAILURES", [(lambda c: c.batches == "partial_split", "a cause not fixed yet")])
    cell = Cell.parse("fit/adam/float32/0/none/partial_split/dense/whole")
    verdict = matrix.judge(cell, {0: _record(difference=0.1)})
    assert verdict.outcome == "known failure" and "a cause not fixed yet" in verdict.detail
    assert matrix.judge(cell, {0: _record()}).outcome == "pass"
    assert matrix.known_failure(Cell.parse("fit/adam/float32/0/none/even/dense/whole")) is None
