"""Ray Train's ``ray.train.report`` under tfdist: only the chief hands Ray a checkpoint.

Ray's own ``ReportCheckpointCallback`` (``ray.air.integrations.keras``), and any Keras
callback written the same way, saves ``model.keras`` and calls ``ray.train.report(...,
checkpoint=...)`` on every worker. Ray copies every worker's files into one checkpoint
directory; Keras 3 writes a per-process id into ``config.json``, so the copies differ and
overlapping copies leave a corrupt zip about one run in three (tfdist UPSTREAM.md). Under
data parallelism every worker holds the same model, so here the other workers report their
metrics with ``checkpoint=None`` and Ray keeps the chief's (world rank 0) files alone.
Every worker still saves (a save may involve every worker); Ray's callback deletes its copy.
"""

from __future__ import annotations

import importlib

from tfdist.patching import Patch

# By module, not attribute: this runs right after ray.train is imported, before ``ray.train`` is set on ``ray``.
ray_train = importlib.import_module("ray.train")

patch = Patch(
    "ray_report", "Ray's ReportCheckpointCallback on every worker (tfdist UPSTREAM.md)", library="ray",
    without="Ray's ReportCheckpointCallback lets every worker write model.keras into one checkpoint directory, "
            "and about one checkpoint in three is a corrupt zip.")


@patch.replaces(ray_train, "report", ("metrics", "checkpoint", "checkpoint_dir_name", "checkpoint_upload_mode",
                                      "delete_local_checkpoint_after_upload", "checkpoint_upload_fn", "validation"))
def _chief_checkpoint_only(original, metrics, checkpoint=None, *args, **kwargs):
    """Drops ``checkpoint`` on every worker but world rank 0 (their metrics still go to Ray)."""
    if checkpoint is not None and _world_rank() != 0:
        checkpoint = None
    return original(metrics, checkpoint, *args, **kwargs)


def _world_rank() -> int:
    try:
        return ray_train.get_context().get_world_rank()
    except Exception:  # noqa: BLE001  (outside a Ray Train worker: nothing to drop)
        return 0
