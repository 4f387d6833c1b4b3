"""Not matplotlib: the test suite's worker processes import TensorFlow and Keras without it (tests/shield/README.md)."""

raise ImportError("matplotlib is kept out of tfdist's test worker processes (tests/shield: jobs.job_env(shield=False) lets it in)")
