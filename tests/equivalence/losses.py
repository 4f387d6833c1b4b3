"""The equivalence matrix's loss and metric dimensions, taken from Keras itself.

Every loss class ``keras.losses`` exports x every reduction Keras accepts x no weights,
``sample_weight`` or ``class_weight`` x an even or a partial split trains one epoch with Keras
``fit`` on 2 logical CPUs under tfdist's strategy and on one device, from the same weights:
the weights, the loss ``fit`` logs and ``evaluate``'s loss must be one device's. Every metric
class ``keras.metrics`` exports, plain and as a weighted metric, and every loss class used as a
metric must report one device's figure in ``fit``'s logs and in ``evaluate``. A loss or metric that a later Keras adds joins by itself,
with the labels of its kind in ``LOSS_KINDS`` / ``METRIC_KINDS`` (regression labels where
neither names it). The cells run in the calling process (``tests/test_loss_matrix.py`` runs ``ci_cells``);
``python -m tests.equivalence.losses [--all]`` prints the table (``--all``: every cell, about 40 minutes).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import time

import keras
import numpy as np

from tests.equivalence import matrix

BATCH = 8
EXAMPLES = {"even": 32, "partial_split": 29}  # 29: the last batch of 5 splits 3/2 over 2 replicas
TOLERANCE = 1e-4  # relative to the largest weight update, as matrix.TOLERANCE["float32"]
LOSS_RTOL = 1e-5  # the logged losses and metrics
CLASS_WEIGHT = {0: 0.5, 1: 2.0, 2: 1.0}


def keras_losses() -> tuple[str, ...]:
    """The loss classes Keras exports (``keras.losses``), by name."""
    return tuple(sorted(name for name, value in vars(keras.losses).items()
                        if inspect.isclass(value) and issubclass(value, keras.losses.Loss)
                        and value is not keras.losses.Loss))


def keras_metrics() -> tuple[str, ...]:
    """The metric classes Keras exports (``keras.metrics``), by name."""
    return tuple(sorted(name for name, value in vars(keras.metrics).items()
                        if inspect.isclass(value) and issubclass(value, keras.metrics.Metric)
                        and value is not keras.metrics.Metric))


def keras_reductions() -> tuple:
    """The reductions Keras' losses accept, from Keras' own check (its error lists them)."""
    from keras.src.losses import loss as loss_module

    try:
        loss_module.standardize_reduction("?")
    except ValueError as error:
        allowed = ast.literal_eval(re.search(r"Expected one of (\{.*?\})", str(error)).group(1))
        return tuple(sorted(allowed, key=lambda r: (r is None, str(r))))
    raise AssertionError("Keras accepted the reduction '?': its check changed")


# The labels each kind of loss or metric takes: (output units, output activation, labels for n examples).
def _one_hot(rng, n):
    return np.eye(3, dtype="float32")[rng.integers(0, 3, n)]


LABELS = {
    "regression": (3, None, lambda rng, n: rng.normal(size=(n, 3)).astype("float32")),
    "positive": (3, "softplus", lambda rng, n: rng.uniform(0.5, 2.0, size=(n, 3)).astype("float32")),
    "probabilities": (3, "softmax", lambda rng, n: rng.dirichlet(np.ones(3), size=n).astype("float32")),
    "signs": (3, "tanh", lambda rng, n: rng.choice([-1.0, 1.0], size=(n, 3)).astype("float32")),
    "binary": (1, "sigmoid", lambda rng, n: rng.integers(0, 2, size=(n, 1)).astype("float32")),
    "one_hot": (3, "softmax", _one_hot),
    "sparse": (3, "softmax", lambda rng, n: rng.integers(0, 3, size=(n,)).astype("int32")),
    "masks": (3, "sigmoid", lambda rng, n: rng.integers(0, 2, size=(n, 3)).astype("float32")),
    "sequences": (5, "softmax", lambda rng, n: rng.integers(1, 5, size=(n, 3)).astype("int32")),  # CTC: 6 steps
}
CLASSES = ("binary", "one_hot", "sparse")  # the kinds whose labels name a class (class_weight maps them)

LOSS_KINDS = {
    "BinaryCrossentropy": "binary", "BinaryFocalCrossentropy": "binary", "CTC": "sequences",
    "CategoricalCrossentropy": "one_hot", "CategoricalFocalCrossentropy": "one_hot",
    "CategoricalGeneralizedCrossEntropy": "sparse", "CategoricalHinge": "one_hot", "Circle": "sparse",
    "Dice": "masks", "Hinge": "signs", "KLDivergence": "probabilities", "MeanAbsolutePercentageError": "positive",
    "MeanSquaredLogarithmicError": "positive", "Poisson": "positive", "SparseCategoricalCrossentropy": "sparse",
    "SquaredHinge": "signs", "Tversky": "masks",
}
# Constructor arguments beyond the reduction: Dice and Tversky reduce over every axis by default, the batch's
# included (see BATCH_COUPLED); with axis=-1 each example has its own loss.
LOSS_ARGUMENTS = {"Dice": {"axis": -1}, "Tversky": {"axis": -1}}
# Losses whose value for an example depends on the other examples of its batch: a replica sees only its share,
# so no data-parallel split (tf.distribute, Horovod, PyTorch DDP) gives one device's value.
BATCH_COUPLED = {
    "Circle": "its loss compares every pair of examples in a batch (metric learning): a replica sees only the "
              "pairs within its share",
}

METRIC_KINDS = {
    **{name: "binary" for name in (
        "AUC", "Accuracy", "BinaryAccuracy", "BinaryCrossentropy", "BinaryIoU", "FalseNegatives", "FalsePositives",
        "Precision", "PrecisionAtRecall", "Recall", "RecallAtPrecision", "SensitivityAtSpecificity",
        "SpecificityAtSensitivity", "TrueNegatives", "TruePositives")},
    **{name: "one_hot" for name in (
        "CategoricalAccuracy", "CategoricalCrossentropy", "CategoricalHinge", "F1Score", "FBetaScore", "OneHotIoU",
        "OneHotMeanIoU", "TopKCategoricalAccuracy")},
    **{name: "sparse" for name in (
        "IoU", "MeanIoU", "SparseCategoricalAccuracy", "SparseCategoricalCrossentropy",
        "SparseTopKCategoricalAccuracy")},
    "KLDivergence": "probabilities", "MeanAbsolutePercentageError": "positive",
    "MeanSquaredLogarithmicError": "positive", "Poisson": "positive", "Hinge": "signs", "SquaredHinge": "signs",
}
METRIC_ARGUMENTS = {
    "IoU": {"num_classes": 3, "target_class_ids": [0, 2], "sparse_y_pred": False},
    "MeanIoU": {"num_classes": 3, "sparse_y_pred": False},
    "OneHotIoU": {"num_classes": 3, "target_class_ids": [0, 2]}, "OneHotMeanIoU": {"num_classes": 3},
    "PrecisionAtRecall": {"recall": 0.5}, "RecallAtPrecision": {"precision": 0.5},
    "SensitivityAtSpecificity": {"specificity": 0.5}, "SpecificityAtSensitivity": {"sensitivity": 0.5},
    "TopKCategoricalAccuracy": {"k": 2}, "SparseTopKCategoricalAccuracy": {"k": 2},
}
# Metrics compile() cannot take as they are: they reduce values of the user's, not (y_true, y_pred).
NOT_COMPILED = {"Mean": "a mean of values you pass", "Sum": "a sum of values you pass",
                "MeanMetricWrapper": "a wrapper that needs a function"}
# The loss each metric kind's model trains with.
KIND_LOSS = {"regression": "mse", "positive": "mse", "probabilities": "kl_divergence", "signs": "hinge",
             "binary": "binary_crossentropy", "one_hot": "categorical_crossentropy",
             "sparse": "sparse_categorical_crossentropy"}

WEIGHTINGS = ("none", "sample_weight", "class_weight")
CI_LOSSES = ("MeanSquaredError", "SparseCategoricalCrossentropy", "CTC")  # a regression, a class, a sequence
SPLITS = tuple(EXAMPLES)


@dataclasses.dataclass(frozen=True)
class LossCell:
    loss: str
    reduction: str  # str(reduction): "None" for None
    weighting: str
    split: str

    @property
    def name(self) -> str:
        return "/".join(dataclasses.astuple(self))

    @property
    def kind(self) -> str:
        return loss_kind(self.loss)


@dataclasses.dataclass(frozen=True)
class MetricCell:
    kind: str
    weighting: str
    split: str

    @property
    def name(self) -> str:
        return "/".join(dataclasses.astuple(self))


def loss_kind(loss: str) -> str:
    return LOSS_KINDS.get(loss, "regression")


def loss_exclusion(cell: LossCell) -> str | None:
    """Why ``cell`` makes no sense (left out), or None."""
    if cell.loss in BATCH_COUPLED:
        return f"{cell.loss}: {BATCH_COUPLED[cell.loss]}"
    if cell.weighting == "class_weight" and loss_kind(cell.loss) not in CLASSES:
        return "class_weight maps a label's class to a weight: these labels name no class"
    return None


def loss_cells() -> list[LossCell]:
    """Every valid loss cell."""
    cells = [LossCell(loss, str(reduction), weighting, split) for loss in keras_losses()
             for reduction in keras_reductions() for weighting in WEIGHTINGS for split in SPLITS]
    return [cell for cell in cells if loss_exclusion(cell) is None]


def metric_cells() -> list[MetricCell]:
    """One cell per kind of labels the metrics take x weighting x split (each cell reports every metric of
    its kind, plain and weighted)."""
    kinds = sorted({METRIC_KINDS.get(name, "regression") for name in keras_metrics() if name not in NOT_COMPILED})
    return [MetricCell(kind, weighting, split) for kind in kinds for weighting in WEIGHTINGS for split in SPLITS
            if weighting != "class_weight" or kind in CLASSES]


def ci_cells() -> list:
    """What CI runs: every loss once (the covering's first cell of each), every pair of values of the other
    dimensions on a regression, a class and a sequence loss, and the metric cells of partial splits."""
    cells = loss_cells()
    first = {}
    for cell in matrix.covering(2, cells):
        first.setdefault(cell.loss, cell)
    paths = matrix.covering(2, [cell for cell in cells if cell.loss in CI_LOSSES])
    metrics = [cell for cell in metric_cells() if cell.split == "partial_split"]
    return list(dict.fromkeys([*first.values(), *paths])) + metrics


def metrics_of(kind: str) -> list[str]:
    return [name for name in keras_metrics() if name not in NOT_COMPILED and METRIC_KINDS.get(name, "regression") == kind]


def _data(kind: str, weighting: str, split: str):
    """(x, y, fit's weighting keywords) for ``split``'s examples."""
    rng = np.random.default_rng(11)
    n = EXAMPLES[split]
    x = rng.normal(size=(n, 6, 4) if kind == "sequences" else (n, 4)).astype("float32")
    y = LABELS[kind][2](rng, n)
    if weighting == "sample_weight":
        return x, y, {"sample_weight": rng.uniform(0.2, 2.0, size=n).astype("float32")}
    if weighting == "class_weight":
        return x, y, {"class_weight": CLASS_WEIGHT if kind != "binary" else {0: 0.5, 1: 2.0}}
    return x, y, {}


def _model(kind: str) -> keras.Model:
    units, activation, _ = LABELS[kind]
    inputs = keras.Input((6, 4) if kind == "sequences" else (4,))
    hidden = keras.layers.Dense(5, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(units, activation=activation)(hidden))


def compile_key(cell) -> tuple:
    """What a cell's compiled model depends on: its loss and reduction, or its metrics' kind."""
    if isinstance(cell, LossCell):
        return "loss", cell.loss, cell.reduction
    return "metrics", cell.kind


def _train(strategy, cell, models: dict, initial, compile_kwargs, x, y, weighting_kwargs):
    """(weights after one epoch, fit's logs, evaluate's results) under ``strategy`` (None: one device), from
    ``initial``. Trains the model ``models`` keeps for the cell's ``compile_key`` on this arm, else a new one,
    and keeps it for the next cell of that key."""
    arm = (strategy is not None, compile_key(cell))
    model = models.pop(arm, None) or _compiled(strategy, cell.kind, compile_kwargs)
    _restart(model, initial)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, **weighting_kwargs)
    weights = {k: v for k, v in weighting_kwargs.items() if k == "sample_weight"}
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True, **weights)
    models[arm] = model  # kept only when it trained: a cell that fails leaves no model behind
    return model.get_weights(), {k: v[-1] for k, v in history.history.items()}, evaluated


def _compiled(strategy, kind: str, compile_kwargs) -> keras.Model:
    """A new model for ``kind``'s labels, compiled under ``strategy`` (None: one device)."""
    with strategy.scope() if strategy is not None else _nothing():
        model = _model(kind)
        model.compile(keras.optimizers.SGD(0.05), **compile_kwargs())
    return model


def _restart(model: keras.Model, initial) -> None:
    """``model`` as a new one: the ``initial`` weights, the optimizer at step 0 (fit and evaluate reset the
    metrics themselves)."""
    model.set_weights(initial)
    if model.optimizer.built:
        model.optimizer.iterations.assign(0)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _initial(kind: str) -> list:
    keras.utils.set_random_seed(3)
    return _model(kind).get_weights()


def _compare(initial, reference, distributed, skip=()) -> list[str]:
    """What differs between the one-device and the distributed (weights, logs, evaluated; not the keys in
    ``skip``)."""
    (w1, logs1, eval1), (w2, logs2, eval2) = reference, distributed
    problems = []
    update = max(float(np.max(np.abs(a - b))) for a, b in zip(w1, initial)) or 1.0
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(w1, w2)) / update
    if not diff <= TOLERANCE:
        problems.append(f"weights differ by {diff:.3g} of the update")
    for where, one, two in (("fit logs", logs1, logs2), ("evaluate", eval1, eval2)):
        for key in sorted(set(one) - set(skip)):
            a, b = np.asarray(one[key], "float64"), np.asarray(two.get(key, np.nan), "float64")
            if a.shape != b.shape or not np.allclose(a, b, rtol=LOSS_RTOL, atol=1e-6, equal_nan=True):
                problems.append(f"{where} {key}: {np.round(b, 6)} vs {np.round(a, 6)} on one device")
    return problems


def run_cells(cells: list, strategy) -> list[matrix.Verdict]:
    """The verdict on each cell, trained on one device and under ``strategy``. Cells of one ``compile_key`` train
    the same two compiled models, each cell from its own initial weights: fit's train function is traced once per
    key, arm and input structure (with or without example weights; class weights reach the step as sample
    weights, and either split's batches fit one trace), not once per cell."""
    models = {}
    return [(run_loss_cell if isinstance(cell, LossCell) else run_metric_cell)(cell, strategy, models)
            for cell in cells]


def run_loss_cell(cell: LossCell, strategy, models: dict) -> matrix.Verdict:
    """Trains ``cell`` on one device and under ``strategy`` (reusing ``models``, see ``run_cells``); the verdict
    on what differs."""
    reduction = None if cell.reduction == "None" else cell.reduction
    x, y, weighting = _data(cell.kind, cell.weighting, cell.split)

    def compile_kwargs():
        loss = getattr(keras.losses, cell.loss)(reduction=reduction, **LOSS_ARGUMENTS.get(cell.loss, {}))
        return {"loss": loss}

    # One device logs a loss of several values (reduction None) weighing each batch by its examples squared, which
    # no replica's share can give when a batch splits unevenly (tfdist.keras_fixes.batch_shares); the weights are
    # still checked.
    vector_display = reduction in (None, "none") and cell.split != "even"
    return _verdict(cell, compile_kwargs, x, y, weighting, strategy, models,
                    skip=("loss",) if vector_display else ())


def run_metric_cell(cell: MetricCell, strategy, models: dict) -> matrix.Verdict:
    """Trains ``cell``'s model with every metric and loss of its kind as metrics, plain and weighted (reusing
    ``models``, see ``run_cells``); the verdict on what differs."""
    x, y, weighting = _data(cell.kind, cell.weighting, cell.split)

    def compile_kwargs():
        def make(name, prefix):
            return getattr(keras.metrics, name)(name=prefix + name, **METRIC_ARGUMENTS.get(name, {}))

        def loss_metric(name):  # a Keras Loss used as a metric (Keras averages its replicas' values)
            return getattr(keras.losses, name)(name=f"{name}_loss", **LOSS_ARGUMENTS.get(name, {}))

        names = metrics_of(cell.kind)
        # not as weighted metrics: Keras fails there on one device (the Loss reduces to a scalar, which its
        # Mean cannot weigh by the batch's sample weights)
        as_metrics = [name for name in keras_losses() if loss_kind(name) == cell.kind and name not in BATCH_COUPLED]
        return {"loss": KIND_LOSS.get(cell.kind, "mse"),
                "metrics": [make(n, "") for n in names] + [loss_metric(n) for n in as_metrics],
                "weighted_metrics": [make(n, "weighted_") for n in names]}

    return _verdict(cell, compile_kwargs, x, y, weighting, strategy, models)


def _verdict(cell, compile_kwargs, x, y, weighting, strategy, models: dict, skip=()) -> matrix.Verdict:
    initial = _initial(cell.kind)
    try:
        reference = _train(None, cell, models, initial, compile_kwargs, x, y, weighting)
    except Exception as error:  # noqa: BLE001 - Keras cannot train it on one device: nothing to compare with
        return matrix.Verdict(cell, "one device fails too", f"{type(error).__name__}: {str(error)[:200]}")
    try:
        distributed = _train(strategy, cell, models, initial, compile_kwargs, x, y, weighting)
    except Exception as error:  # noqa: BLE001 - the verdict names it
        return matrix.Verdict(cell, "fail", f"{type(error).__name__}: {str(error)[:300]}")
    problems = _compare(initial, reference, distributed, skip)
    return matrix.Verdict(cell, "fail" if problems else "pass", "; ".join(problems) or "equal")


def table(verdicts: list[matrix.Verdict]) -> str:
    width = max(len(v.cell.name) for v in verdicts)
    lines = [f"{v.cell.name:<{width}}  {v.outcome:<20}  {v.detail}" for v in verdicts]
    counts = {o: sum(v.outcome == o for v in verdicts) for o in matrix.OUTCOMES}
    lines.append(f"{len(verdicts)} cells: " + ", ".join(f"{n} {o}" for o, n in counts.items() if n))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.equivalence.losses [--all | CELL ...]``: CI's cells (``ci_cells``), every cell, or the
    cells named."""
    argv = sys.argv[1:] if argv is None else argv
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import tfdist

    with tfdist.scope("mirrored", devices="CPU:[0-1]") as strategy:
        pass
    started = time.monotonic()
    named = [name for name in argv if not name.startswith("--")]
    if named:
        cells = [cell for cell in loss_cells() + metric_cells() if cell.name in named]
    else:
        cells = loss_cells() + metric_cells() if "--all" in argv else ci_cells()
    verdicts = run_cells(cells, strategy)
    print(table(verdicts))
    print(f"{time.monotonic() - started:.0f} s")
    return 1 if any(v.outcome == "fail" for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
