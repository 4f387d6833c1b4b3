"""Multi-worker fit with tfdist's Keras fix turned off: shows the upstream bug is still there."""

import sys

from tfdist import keras_fixes

keras_fixes.apply_multi_worker_fit_fixes = lambda: None  # the patch under test, disabled

import tfdist  # noqa: E402
from tests.workers import common  # noqa: E402

with tfdist.scope() as strategy:
    pass
common.train_equivalence(strategy)
common.write_result(sys.argv[1], {"fit": "completed"})
