"""``model.save`` and ``save_weights`` called on every worker write whole files.

Keras 3 has no chief: under MultiWorkerMirroredStrategy every worker that calls ``model.save(path)``
writes the same path at once, and Keras writes a per-process id into ``config.json``, so the writes
interleave into a zip that fails its CRC (seen with sharded optimizer state and with Ray's checkpoint
callback: ../UPSTREAM.md, tensorflow#38635). Here each worker writes under a temporary name of its own
and moves the file into place in one step: on a shared filesystem the path holds one worker's whole
file (every worker's state is the same), on each worker's own disk each has its file, as in Keras.
"""

from __future__ import annotations

import os

from keras.src.saving import saving_lib

from tfdist import atomic_files, process_group
from tfdist.patching import Patch

patch = Patch(
    "model_files", "tensorflow#38635: every worker's model.save writes one path at once",
    without="model.save / save_weights on every worker of a multi-worker job write one file at once: a corrupt "
            "zip (Bad CRC-32 for file 'config.json') about one time in three.")


@patch.replaces(saving_lib, "save_model", ("model", "filepath", "weights_format", "zipped"))
def _model_file_whole(original, model, filepath, *args, **kwargs):
    return _whole_file(model, filepath, lambda path: original(model, path, *args, **kwargs))


@patch.replaces(saving_lib, "save_weights_only", ("model", "filepath", "max_shard_size", "objects_to_skip"))
def _weights_file_whole(original, model, filepath, *args, **kwargs):
    return _whole_file(model, filepath, lambda path: original(model, path, *args, **kwargs))


def _whole_file(model, filepath, save) -> None:
    """``save(filepath)``; under several workers, through a temporary file of this worker's (a path's only: a file
    object or a URL goes as it is)."""
    if not isinstance(filepath, (str, os.PathLike)) or \
            not process_group.is_multi_worker(getattr(model, "distribute_strategy", None)) or \
            not atomic_files.is_local(str(filepath)) or os.path.isdir(filepath):
        return save(filepath)
    atomic_files.atomic_write(save, str(filepath))
