"""tfdist.ray_fixes: only world rank 0 hands Ray a checkpoint; Ray's own callback goes through ray.train.report."""

import pytest

import tfdist  # noqa: F401  (arms the hook that patches ray.train when it is imported)

ray_train = pytest.importorskip("ray.train")


def test_ray_train_report_is_patched_when_ray_train_is_imported():
    from tfdist import ray_fixes
    from tfdist.patching import original_of

    assert ray_fixes.patch.applied
    assert original_of(ray_train.report).__module__ == "ray.train"


@pytest.mark.parametrize("rank, kept", [(0, True), (1, False)])
def test_only_the_chief_reports_a_checkpoint(monkeypatch, rank, kept):
    from tfdist import ray_fixes

    calls = []
    monkeypatch.setattr(ray_fixes, "_world_rank", lambda: rank)
    ray_fixes._chief_checkpoint_only(lambda metrics, checkpoint, *a, **k: calls.append((metrics, checkpoint)),
                                     {"loss": 1.0}, checkpoint="ckpt")
    assert calls == [({"loss": 1.0}, "ckpt" if kept else None)]  # metrics are reported by every worker


def test_rays_report_checkpoint_callback_calls_ray_train_report(monkeypatch):
    """Canary: the fix replaces ray.train.report; if Ray's callback stops calling it, this fails."""
    import keras
    from ray.air.integrations.keras import ReportCheckpointCallback

    calls = []
    monkeypatch.setattr(ray_train, "report", lambda metrics, checkpoint=None, **kwargs: calls.append(
        (metrics, sorted(p.name for p in __import__("pathlib").Path(checkpoint.path).iterdir()))))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    callback = ReportCheckpointCallback()
    callback.set_model(model)
    callback.on_epoch_end(0, {"loss": 0.5})
    assert calls == [({"loss": 0.5}, [".metadata.json", "model.keras"])]
