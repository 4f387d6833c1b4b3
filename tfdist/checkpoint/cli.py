"""``tfdist checkpoint export DIR OUT.keras``: a checkpoint of ``CheckpointManager`` as one Keras file.

Runs in one process with no cluster: rebuilds the model and its compiled optimizer from the configs the
checkpoint keeps, reads every variable whole (a sharded slot from its shards), and saves a ``.keras``
file that plain Keras loads, optimizer state included.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    """The ``tfdist checkpoint`` argument parser."""
    parser = argparse.ArgumentParser(prog="tfdist checkpoint", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     help="export: write a checkpoint as one .keras file plain Keras loads")
    export = commands.add_parser("export", help="write a checkpoint as one .keras file plain Keras loads")
    export.add_argument("directory", help="the CheckpointManager's directory, or one step-N checkpoint in it")
    export.add_argument("out", help="the .keras file to write")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tfdist checkpoint``."""
    args = build_parser().parse_args(argv)
    try:
        path = export_keras(args.directory, args.out)
    except (ValueError, FileNotFoundError) as error:
        print(f"tfdist checkpoint export: {error}", file=sys.stderr)
        return 2
    print(f"tfdist checkpoint export: wrote {args.out} from {path}")
    return 0


def export_keras(directory: str, out: str) -> str:
    """Writes the newest committed checkpoint under ``directory`` (or ``directory`` itself, a ``step-N``) as the
    Keras file ``out``; returns the checkpoint's path.

    Raises:
        ValueError: ``out`` does not end in ``.keras``, or the checkpoint keeps no model config.
        FileNotFoundError: no committed checkpoint there.
    """
    import keras

    from tfdist.checkpoint import manager, store

    if not out.endswith(".keras"):
        raise ValueError(f"the output must be a .keras file; received {out!r}.")
    path = directory if os.path.exists(os.path.join(directory, store.MANIFEST)) else None
    if path is None:
        found = store.committed(store.check_directory(directory))
        if not found:
            raise FileNotFoundError(f"no committed checkpoint in {directory!r} (a step-N folder with a "
                                    f"{store.MANIFEST}).")
        path = found[-1][1]
    config = store.read_manifest(path).get("model")
    if config is None:
        raise ValueError(f"{path} keeps no model config (the model could not be serialized when it was saved: "
                         "a subclassed model without get_config). Build the model in your own code and call "
                         "tfdist.checkpoint.restore_into(model, path), then model.save(...).")
    model = keras.models.model_from_json(config["model"])
    if config.get("compile"):
        model.compile_from_config(json.loads(json.dumps(config["compile"])))
    manager.restore_into(model, path)
    model.save(out)
    return path
