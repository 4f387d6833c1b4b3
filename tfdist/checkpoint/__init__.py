"""Checkpoints written by every worker, in the background, loadable on any number of workers.

``CheckpointManager`` (``manager``) saves and restores; ``layout`` says who writes what; ``store`` is the
directory on disk; ``cli`` is ``tfdist checkpoint export``.
"""

from tfdist.checkpoint.manager import CheckpointManager, restore_into

__all__ = ["CheckpointManager", "restore_into"]
