"""The README and docs/ stay true: the tour runs as shown, code blocks parse, links and the
options they name exist."""

import ast
import re
import subprocess
import sys

import pytest

from tests.jobs import REPO, job_env

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks(path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), re.S)


def test_the_readme_tour_is_examples_tour():
    tour = (REPO / "examples" / "tour.py").read_text().split('"""', 2)[2].lstrip("\n")
    assert tour in blocks(REPO / "README.md", "python")


def test_the_tour_trains_on_two_workers_and_only_the_chief_saves(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tfdist.run", "-n", "2", "--timeout", "240", "--",
                             sys.executable, "examples/tour.py", str(tmp_path)], cwd=REPO, env=job_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count(f"worker 0 of 2, 2 replicas; saved in {tmp_path}") == 1
    assert "worker 1 of 2" not in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1.keras", "ckpt-2.keras"]  # backup deleted at the end


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_parse_and_links_resolve(page):
    for code in blocks(page, "python"):
        ast.parse(code)
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" not in target:
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
    for example in re.findall(r"\b(examples/[\w/.-]+\.(?:py|sbatch))", page.read_text()):
        assert (REPO / example).exists(), f"{page.name} names {example}, which does not exist"


def test_every_option_the_docs_give_a_command_exists():
    helps = {}
    for command in ("run", "bench", "doctor", "convert"):
        helps[command] = subprocess.run([sys.executable, "-m", "tfdist.cli", command, "--help"], env=job_env(),
                                        capture_output=True, text=True, timeout=120).stdout
    unknown = []
    for page in PAGES:
        for line in "\n".join(blocks(page, "bash")).splitlines():
            for command, options in re.findall(r"tfdist (run|bench|doctor|convert)((?: +-[-\w]+(?:[ =][^-\s]\S*)?)*)",
                                               line):
                unknown += [f"{page.name}: tfdist {command} {option}" for option in re.findall(r"--[\w-]+", options)
                            if option not in helps[command]]
    assert unknown == []
