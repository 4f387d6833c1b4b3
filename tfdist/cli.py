"""The ``tfdist`` command: ``tfdist run|bench|convert|doctor|checkpoint ...``.

Each subcommand's module is imported only when it is used, so ``tfdist run``
starts without importing TensorFlow. Each has a ``build_parser()``; docs/cli.md is
made from them (``parser``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from tfdist.extras import MissingExtraError

_SUBCOMMANDS = {
    "run": ("tfdist.run", "start the workers of a multi-worker job: this machine, several nodes, or Ray"),
    "bench": ("tfdist.bench.cli", "time 1 vs N replicas on a tensorflow-datasets dataset"),
    "doctor": ("tfdist.doctor", "check versions, devices, the cluster and its ports"),
    "convert": ("tfdist.data.convert", "write a tensorflow-datasets split into TFRecord shards"),
    "checkpoint": ("tfdist.checkpoint.cli", "export a CheckpointManager checkpoint as one .keras file"),
}

COMMANDS = tuple(_SUBCOMMANDS)


def parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of ``tfdist NAME`` (one of ``COMMANDS``)."""
    return importlib.import_module(_SUBCOMMANDS[name][0]).build_parser()


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatches to a subcommand; returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in _SUBCOMMANDS:
        print(f"tfdist: unknown command {name!r}; choose one of {sorted(_SUBCOMMANDS)}.\n\n{_usage()}",
              file=sys.stderr)
        return 2
    module = importlib.import_module(_SUBCOMMANDS[name][0])
    try:
        return module.main(rest)
    except MissingExtraError as err:
        print(f"tfdist {name}: {err}", file=sys.stderr)
        return 2


def _usage() -> str:
    lines = ["usage: tfdist COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {help_text}" for name, (_, help_text) in _SUBCOMMANDS.items()]
    lines += ["", "Run 'tfdist COMMAND --help' for a command's options."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
