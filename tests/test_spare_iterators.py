"""Under a strategy, Keras' fit/evaluate make no distributed iterator they take no batch from
(tfdist.keras_fixes.spare_iterators), and train the same batches as with Keras' own spare iterators."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import input_lib

from tfdist import strategy as strategy_lib
from tfdist.keras_fixes import spare_iterators


@pytest.fixture
def mirrored():
    return strategy_lib.make_strategy("mirrored", devices="CPU:[0-1]")


@pytest.fixture
def iterators(monkeypatch):
    """How many distributed iterators were made (a list, one entry each)."""
    made, original = [], input_lib.DistributedDataset.__iter__

    def counted(self):
        made.append(1)
        return original(self)

    monkeypatch.setattr(input_lib.DistributedDataset, "__iter__", counted)
    return made


def keras_spare_iterators(monkeypatch):
    monkeypatch.setattr(spare_iterators, "_built", lambda model: False)
    monkeypatch.setattr(spare_iterators, "_next_epoch_makes_its_own", lambda epoch_iterator: False)


def train(strategy, unknown_length=False, **fit_kwargs):
    """Two fits and two evaluates (a model built already for all but the first fit): what a user compares."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
        rng = np.random.default_rng(1)
        model.set_weights([rng.normal(size=w.shape).astype("float32") for w in model.get_weights()])
        model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae"])
    x = np.random.default_rng(0).random((60, 6)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True)))
    data = (data.filter(lambda *_: True) if unknown_length else data).batch(8)  # 8 batches, the last of 4
    history = [model.fit(data, verbose=0, **fit_kwargs).history, model.evaluate(data, verbose=0),
               model.fit(data, verbose=0, **fit_kwargs).history, model.evaluate(data, verbose=0)]
    return model.get_weights(), history, int(model.optimizer.iterations.numpy())


@pytest.mark.parametrize("fit_kwargs", [{"epochs": 3}, {"epochs": 3, "steps_per_epoch": 4},
                                        {"epochs": 3, "unknown_length": True}],
                         ids=["epochs", "steps_per_epoch", "unknown_length"])
def test_the_same_batches_as_with_keras_spare_iterators(mirrored, monkeypatch, fit_kwargs):
    """steps_per_epoch=4 of 8 batches: the second epoch goes on with the first one's iterator, the third with the
    one Keras made at the second's end (Keras' way, kept). Data of unknown length: Keras learns its count in the
    first epoch and starts the next with the last one's count and steps seen."""
    ours = train(mirrored, **fit_kwargs)
    keras_spare_iterators(monkeypatch)
    theirs = train(mirrored, **fit_kwargs)
    np.testing.assert_equal(ours, theirs)


def test_only_iterators_a_batch_is_taken_from(mirrored, iterators):
    train(mirrored, epochs=3)
    # the first fit: one to build the compiled loss and metrics, one per epoch; then one per fit epoch and evaluate
    assert len(iterators) == 1 + 3 + 1 + 3 + 1


def test_keras_makes_spare_ones(mirrored, iterators, monkeypatch):
    keras_spare_iterators(monkeypatch)
    train(mirrored, epochs=3)
    # a build in each fit and evaluate; each epoch's end makes the next epoch's, which makes its own
    assert len(iterators) == (1 + 3 + 3) + (1 + 1 + 1) + (1 + 3 + 3) + (1 + 1 + 1)
