"""The README and docs/ stay true: the tour runs as shown, code blocks parse, links and the
options they name exist."""

import ast
import os
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


FIRST_SCREEN = 64  # lines: "about 60", a tall terminal's worth


def paragraphs(text: str) -> list[list[str]]:
    """The blocks of a Markdown page a reader meets as one: runs of non-blank lines outside code blocks (a list or a
    table counts whole)."""
    found, current, in_code = [], [], False
    for line in text.splitlines() + [""]:
        fence = line.startswith("```")
        in_code ^= fence
        if fence or in_code or not line.strip():
            if current:
                found.append(current)
            current = []
        else:
            current.append(line)
    return found


def test_the_readme_first_screen_says_what_tfdist_is_how_to_install_it_the_main_command_and_what_it_does():
    lines = (REPO / "README.md").read_text().splitlines()
    screen = "\n".join(lines[:FIRST_SCREEN])
    assert lines[0] == "# tfdist" and not lines[1] and lines[2].startswith("Distributed training for Keras 3")
    for section in ("## Install", "## The main command", "## What it does"):
        assert f"\n{section}\n" in screen, f"{section} is not on the README's first screen"
    assert re.search(r"```bash\npython3 -m venv .*pip install \.\n```", screen)
    assert re.search(r"```bash\ntfdist run -n 2 -- python examples/multi_worker_fit.py\n```\n\n```text\n", screen)
    table = screen.split("## What it does", 1)[1].split("\n\n")[1].splitlines()
    assert table[:2] == ["| Capability | Read more |", "|---|---|"] and len(table) > 8
    assert all(re.search(r"\]\(docs/[\w-]+\.md", row) for row in table[2:]), "every capability links to its doc"
    assert len(lines) > FIRST_SCREEN and not lines[FIRST_SCREEN - 1].startswith("|"), "the table ends on the screen"


def test_no_readme_paragraph_is_longer_than_12_lines():
    long = [block[0] for block in paragraphs((REPO / "README.md").read_text()) if len(block) > 12]
    assert long == [], f"paragraphs of over 12 lines start with: {long}"


def test_the_paragraph_counter_counts_prose_lists_and_tables_not_code():
    page = "a\nb\n\n```\nx\ny\n```\n- one\n  more\n- two\n\n| t |\n|---|\n"
    assert paragraphs(page) == [["a", "b"], ["- one", "  more", "- two"], ["| t |", "|---|"]]


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


def test_the_quick_tier_names_test_modules_that_exist():
    from tests.conftest import QUICK_MODULES

    assert sorted(name for name in QUICK_MODULES if not (REPO / "tests" / f"{name}.py").exists()) == []
    assert "-m quick" in (REPO / "README.md").read_text()


def test_the_slowest_modules_go_first_under_xdist(tmp_path):
    """pytest-xdist's real scheduling over a generated tree: a listed slow module with one test starts before an
    unlisted one with many (xdist's own reorder, by number of tests, would start that one first)."""
    from tests.suite_order import SLOW_MODULES

    assert sorted(name for name in SLOW_MODULES if not (REPO / "tests" / f"{name}.py").exists()) == []
    log = tmp_path / "order.txt"
    for name, count in (("test_many", 10), (SLOW_MODULES[-1], 1)):
        (tmp_path / f"{name}.py").write_text("".join(
            f"def test_{i}():\n    open({str(log)!r}, 'a').write({name!r} + '\\n')\n\n" for i in range(count)))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.suite_order",
                           "-n", "1", "--dist", "loadfile", str(tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert log.read_text().split()[0] == SLOW_MODULES[-1], log.read_text()


def test_the_plain_benchmark_trains_what_the_example_trains():
    """benchmarks/plain_multi_worker_fit.py is examples/multi_worker_fit.py's training without tfdist, line for line
    (its model, data, fit and evaluate): plain_vs_tfdist.py's ratio compares the same work only while they agree."""
    def training(path):
        text = (REPO / path).read_text().replace("tfdist.is_chief()", "is_chief")
        lines = [line.strip() for line in text.splitlines()]
        start = next(i for i, line in enumerate(lines) if line.startswith("model = keras.Sequential("))
        end = next(i for i, line in enumerate(lines) if line.startswith("loss = model.evaluate("))
        return [line for line in lines[start:end + 1] if line and not line.startswith(("if ", "print("))]

    assert training("benchmarks/plain_multi_worker_fit.py") == training("examples/multi_worker_fit.py")
