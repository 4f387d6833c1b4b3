"""Keras' own tests as a gate: what passes in plain Keras passes with tfdist imported.

The Keras sdist on the package registry carries Keras' test files. The gate fetches the sdist of the
installed Keras (``sdist``), picks test files (``selection``), runs them with ``import tfdist`` first,
collects them plain and runs plain the tests that did not pass with tfdist (``plugin`` is their conftest;
``passes`` runs a pass), and fails when a test that passes without tfdist does not pass with it
(``verdict``), unless ``allowed`` lists it with the upstream issue and a one-device case where Keras itself
trains other than asked.

    python -m tests.keras_gate.run            # the subset tfdist's patches touch (what CI runs)
    python -m tests.keras_gate.run --all      # trainers, losses, optimizers, callbacks, models, saving, backend/tensorflow

docs/keras-tests.md has the counts and the allow-list.
"""
