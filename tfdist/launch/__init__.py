"""The launcher side of ``tfdist run``: starts, watches and stops worker processes.

``supervisor`` starts a job's workers, watches them and stops them all (every launcher
uses it); ``policy`` decides, after each attempt, whether the job ends or starts again (the
supervisor and the master ask it); ``lifeline`` decides what signals to a launcher, and its
death, do to its workers;
``local`` runs the workers of this machine; ``output`` copies their output; ``site``
holds the ``sitecustomize`` every worker's Python runs first (it arms
``tfdist.startup``). A job on several nodes: ``nodes`` (each node's launcher),
``master`` (node 0's coordinator) and ``wire`` (their signed messages). ``ray`` places
the workers with Ray (and imports Ray only when used). Nothing here imports TensorFlow.
"""
