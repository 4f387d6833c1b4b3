"""The suite's jobs import TensorFlow and Keras without jax, pandas and matplotlib (tests/shield/README.md)."""

import importlib.util
import subprocess
import sys

from tests.jobs import job_env

SHIELDED = ("jax", "pandas", "matplotlib")


def test_a_jobs_workers_import_tensorflow_and_keras_without_the_shielded_packages():
    assert all(importlib.util.find_spec(name) for name in SHIELDED)  # installed: the pytest process has them
    probe = ("import sys, tensorflow, keras, tfdist; "
             f"print(sorted(name for name in {SHIELDED!r} if name in sys.modules))")
    shielded = subprocess.run([sys.executable, "-c", probe], env=job_env(), capture_output=True, text=True,
                              timeout=120)
    assert shielded.returncode == 0 and shielded.stdout.strip() == "[]", shielded.stdout + shielded.stderr[-3000:]
