"""The equivalence matrix's loss and metric dimensions (tests/equivalence/losses.py), taken from Keras' own
registries: every loss class x every reduction x no weights / sample_weight / class_weight x even / partial
splits trains in fit on 2 logical CPUs as on one device, with one device's logged loss and evaluation; every
metric class reports one device's figures. CI runs ``losses.ci_cells()``; every cell:
``python -m tests.equivalence.losses --all``."""

import keras
import pytest

import tfdist
from tests.equivalence import losses, matrix

pytestmark = pytest.mark.usefixtures("fresh_tfdist_strategy")


def test_the_dimensions_are_keras_own():
    assert {"MeanSquaredError", "CTC", "Dice", "Circle"} <= set(losses.keras_losses())
    assert set(losses.keras_reductions()) == {"sum", "sum_over_batch_size", "mean", "mean_with_sample_weight", None,
                                              "none"}
    assert "Loss" not in losses.keras_losses() and "Metric" not in losses.keras_metrics()
    names = {cell.loss for cell in losses.loss_cells()}
    assert names == set(losses.keras_losses()) - set(losses.BATCH_COUPLED)
    assert {cell.reduction for cell in losses.loss_cells()} == {str(r) for r in losses.keras_reductions()}


def test_a_loss_or_metric_keras_adds_joins_the_matrix_by_itself(monkeypatch):
    class NewLoss(keras.losses.MeanSquaredError):
        pass

    class NewMetric(keras.metrics.MeanSquaredError):
        pass

    monkeypatch.setattr(keras.losses, "NewLoss", NewLoss, raising=False)
    monkeypatch.setattr(keras.metrics, "NewMetric", NewMetric, raising=False)
    cells = [cell for cell in losses.loss_cells() if cell.loss == "NewLoss"]
    assert len(cells) == len(losses.keras_reductions()) * 2 * 2  # no class_weight: regression labels
    assert "NewMetric" in losses.metrics_of("regression")
    assert {cell.loss for cell in losses.ci_cells() if isinstance(cell, losses.LossCell)} >= {"NewLoss"}


def test_batch_coupled_losses_are_left_out_with_the_reason():
    cell = losses.LossCell("Circle", "sum", "none", "even")
    assert "compares every pair of examples in a batch" in losses.loss_exclusion(cell)
    assert "these labels name no class" in losses.loss_exclusion(losses.LossCell("Huber", "sum", "class_weight", "even"))


def test_ci_covers_every_loss_and_every_pair_of_the_other_dimensions():
    cells = [cell for cell in losses.ci_cells() if isinstance(cell, losses.LossCell)]
    assert {cell.loss for cell in cells} == {cell.loss for cell in losses.loss_cells()}
    chosen = [cell for cell in cells if cell.loss in losses.CI_LOSSES]
    assert matrix.covers(chosen, 2, [cell for cell in losses.loss_cells() if cell.loss in losses.CI_LOSSES])


@pytest.mark.timeout(900)  # about 60 cells at 1-3 s each on a loaded 2-core machine
def test_every_loss_reduction_weighting_and_metric_is_one_devices():
    with tfdist.scope("mirrored", devices="CPU:[0-1]") as strategy:
        pass
    verdicts = losses.run_cells(losses.ci_cells(), strategy)
    print(losses.table(verdicts))
    assert not [v for v in verdicts if v.outcome == "fail"], losses.table(verdicts)
