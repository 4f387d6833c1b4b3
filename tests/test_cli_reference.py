"""`tfdist COMMAND --help` shows every flag's default, and docs/cli.md lists every flag with that default:
both come from the parsers (tests/cli_reference.py), so neither drifts from them."""

import re
import subprocess
import sys

import pytest

from tests import cli_reference
from tests.jobs import job_env
from tfdist import cli


def documented() -> dict[tuple[str, str], str]:
    """(command, flag name) -> the default docs/cli.md gives it, from the tables of its generated part."""
    found, command = {}, None
    for line in cli_reference.generated_part(cli_reference.PAGE.read_text()).splitlines():
        heading = re.fullmatch(r"## `tfdist (\w+)`", line)
        if heading:
            command = heading[1]
        elif line.startswith("| `-") and command:
            flag_cell, default = (cell.strip().replace(r"\|", "|") for cell in re.split(r"(?<!\\)\|", line)[1:3])
            for name in re.findall(r"`(--?\w[-\w]*)", flag_cell):
                found[(command, name)] = default
    return found


def test_docs_cli_md_lists_every_flag_of_every_command_with_its_default():
    in_docs = documented()
    problems = []
    for command in cli.COMMANDS:
        for flag in cli_reference.flags(command):
            for name in flag.names:
                if (command, name) not in in_docs:
                    problems.append(f"docs/cli.md lacks tfdist {command} {name}")
                elif in_docs.pop((command, name)) != flag.default:
                    problems.append(f"docs/cli.md gives tfdist {command} {name} another default than its help: "
                                    f"{flag.default!r}")
    problems += [f"docs/cli.md lists tfdist {command} {name}, which its parser does not have"
                 for command, name in in_docs]
    assert problems == [], "\n".join(problems + ["(regenerate it: python -m tests.cli_reference)"])


def test_docs_cli_md_holds_the_reference_the_parsers_make():
    assert cli_reference.generated_part(cli_reference.PAGE.read_text()) == cli_reference.render(), (
        "docs/cli.md's reference differs from the parsers' help: regenerate it with python -m tests.cli_reference")


@pytest.mark.parametrize("command", cli.COMMANDS)
def test_help_ends_every_flag_with_its_default_as_the_parser_has_it(command):
    printed = subprocess.run([sys.executable, "-m", "tfdist.cli", command, "--help"], env=job_env({"COLUMNS": "80"}),
                             capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    unspaced = "".join(printed.stdout.split())  # --help wraps lines, at hyphens too
    problems = []
    for flag in cli_reference.flags(command):
        action, said = flag.action, flag.default
        if said is None:
            problems.append(f"{flag.name}: its help does not end with (default: ...) or (required)")
            continue
        shown = "(required)" if said == "required" else f"(default: {said})"
        if "".join(shown.split()) not in unspaced:
            problems.append(f"{flag.name}: --help does not show {shown}")
        if action.required:
            expected = "required"
        elif action.nargs == 0 and action.default is False:
            expected = "off"
        elif action.default not in (None, [], ()):
            expected = cli_reference.shown(action.default)
        else:
            continue  # a default the parser leaves to the code (None): the help says it in words
        if said != expected and not said.startswith(expected + ";"):
            problems.append(f"{flag.name}: the help says (default: {said}) where the parser's default is {expected}")
    assert problems == []


def test_run_help_fits_an_80_column_terminal():
    printed = subprocess.run([sys.executable, "-m", "tfdist.cli", "run", "--help"], env=job_env({"COLUMNS": "80"}),
                             capture_output=True, text=True, timeout=60)
    assert [line for line in printed.stdout.splitlines() if len(line) > 80] == []
    assert "exit codes:" in printed.stdout and "the workers:" in printed.stdout
