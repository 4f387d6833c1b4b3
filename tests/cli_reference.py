"""docs/cli.md's flag reference, made from the parsers of every ``tfdist`` subcommand.

    python -m tests.cli_reference      # rewrites the generated part of docs/cli.md

Every flag's help ends with its default, ``(default: ...)``, or ``(required)``; the reference is a table
per argument group: the flag, that default, and the rest of the help.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

from tests.jobs import REPO
from tfdist import cli

PAGE = REPO / "docs" / "cli.md"
BEGIN = "<!-- The reference below is generated from the parsers: python -m tests.cli_reference -->"
END = "<!-- End of the generated reference -->"
_DEFAULT = re.compile(r"\s*\((?:default: (?P<default>[^()]*)|(?P<required>required))\)$")


@dataclasses.dataclass(frozen=True)
class Flag:
    """One option of one subcommand, as its help shows it."""

    command: str
    names: tuple[str, ...]  # e.g. ("-n", "--num-workers")
    metavar: str | None
    default: str | None  # what the help says after "default: ", "required", or None when it says neither
    text: str  # the help without its default
    action: argparse.Action

    @property
    def name(self) -> str:
        return self.names[-1]


def expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's help as --help prints it (``%(default)s`` and the like filled in), on one line."""
    params = {key: value for key, value in vars(action).items() if value is not argparse.SUPPRESS}
    params["prog"] = parser.prog
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    return " ".join((action.help % params).split())


def flags(command: str, parser: argparse.ArgumentParser | None = None) -> list[Flag]:
    """The options of ``tfdist COMMAND`` (not -h, nor suppressed ones), in the order of ``parser`` (its own)."""
    parser = parser or cli.parser(command)
    found = []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        help_text = expanded_help(parser, action)
        match = _DEFAULT.search(help_text)
        default = None if match is None else match["default"] if match["default"] is not None else "required"
        found.append(Flag(command, tuple(action.option_strings), _metavar(action), default,
                          help_text[:match.start()] if match else help_text, action))
    return found


def shown(value) -> str:
    """How a help text writes a parser's default value: 25.0 -> 25, (1, 2) -> 1,2, a home path with ~."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    home = os.path.expanduser("~")
    if isinstance(value, str) and home != "/" and value.startswith(home + os.sep):
        return "~" + value[len(home):]
    return str(value)


def _metavar(action: argparse.Action) -> str | None:
    if action.nargs == 0:
        return None
    metavar = action.metavar or ("{%s}" % ",".join(map(str, action.choices)) if action.choices else action.dest.upper())
    return f"[{metavar}]" if action.nargs == "?" else metavar


def _cell(text: str) -> str:
    return text.replace("|", r"\|")


def _flag_cell(flag: Flag) -> str:
    return ", ".join(f"`{name}{' ' + flag.metavar if flag.metavar else ''}`" for name in flag.names)


def render() -> str:
    """The generated part of docs/cli.md, markers included."""
    parts = [BEGIN]
    for command in cli.COMMANDS:
        parser = cli.parser(command)
        by_action = {f.action: f for f in flags(command, parser)}
        parts += [f"## `tfdist {command}`", " ".join(parser.description.split())]
        for group in parser._action_groups:
            rows = [by_action[a] for a in group._group_actions if a in by_action]
            positionals = [a for a in group._group_actions if not a.option_strings]
            if not rows and not positionals:
                continue
            if group.title not in ("options", "optional arguments", "positional arguments"):
                parts.append(f"### {group.title}")
            if group.description:
                parts.append(" ".join(group.description.split()))
            table = ["| flag | default | what it does |", "|---|---|---|"]
            table += [f"| `{_cell(a.metavar or a.dest)}` | | {_cell(expanded_help(parser, a))} |" for a in positionals]
            table += [f"| {_cell(_flag_cell(f))} | {_cell(f.default or '')} | {_cell(f.text)} |" for f in rows]
            parts.append("\n".join(table))
        if parser.epilog:
            epilog = parser.epilog.strip()
            parts.append(f"```text\n{epilog}\n```" if "\n" in epilog else epilog)
    return "\n\n".join(parts + [END]) + "\n"


def generated_part(page: str) -> str:
    """The part of ``page`` between the markers (both included), or '' when they are missing."""
    start, end = page.find(BEGIN), page.find(END)
    return page[start:end + len(END)] + "\n" if start >= 0 and end > start else ""


def write() -> None:
    """Replaces the generated part of docs/cli.md with ``render()``."""
    page = PAGE.read_text()
    old = generated_part(page)
    if not old:
        raise SystemExit(f"{PAGE}: the markers are missing; put {BEGIN!r} and {END!r} where the reference goes.")
    PAGE.write_text(page.replace(old, render()))


if __name__ == "__main__":
    write()
