"""``tfdist bench``: time 1 vs N replicas on a tensorflow-datasets dataset, like the TF guide's tables.

Modules: ``config`` (arguments and their checks), ``models``, ``sources`` (synthetic,
mock, tfds and TFRecord input), ``runner`` (one timed run, in its own worker process),
``report`` (table, JSON, CSV, PNG), ``cli`` (the command).
"""
