"""What users install: the sdist and wheel carry every run-time file, the suite imports the
installed package (under ``bash tests/run.sh``), a broken install is named, and a missing
optional dependency is one line that says what to install."""

import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

import tfdist
from tests.jobs import REPO, job_env

SOURCE = pathlib.Path(os.environ.get("TFDIST_SOURCE", REPO))
INSTALLED = pathlib.Path(tfdist.__file__).resolve().parent


def package_files(root: pathlib.Path) -> set[str]:
    """Every file of the tfdist package under ``root`` ('tfdist/launch/site/sitecustomize.py', ...)."""
    return {str(path.relative_to(root)) for path in (root / "tfdist").rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"}


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> pathlib.Path:
    """The sdist and wheel tests/run.sh built, or ones built here from the checkout."""
    if os.environ.get("TFDIST_DIST_DIR"):
        return pathlib.Path(os.environ["TFDIST_DIST_DIR"])
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(SOURCE)],
                   check=True, capture_output=True, timeout=300)
    return out


def test_wheel_and_sdist_carry_every_file_of_the_package(dists):
    expected = package_files(SOURCE)
    assert "tfdist/launch/site/sitecustomize.py" in expected
    [wheel] = dists.glob("tfdist-*.whl")
    [sdist] = dists.glob("tfdist-*.tar.gz")
    in_wheel = {name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("tfdist/")}
    with tarfile.open(sdist) as archive:
        in_sdist = {name.split("/", 1)[1] for name in archive.getnames() if name.count("/") and "/tfdist/" in f"/{name}"}
    assert expected - in_wheel == set()
    assert expected - in_sdist == set()


def test_the_suite_and_its_workers_import_the_installed_tfdist():
    if (REPO / "tfdist").is_dir():
        pytest.skip("run from the checkout; `bash tests/run.sh` runs the suite against the installed wheel")
    assert "site-packages" in INSTALLED.parts or "dist-packages" in INSTALLED.parts, INSTALLED
    assert INSTALLED != (SOURCE / "tfdist").resolve() and not INSTALLED.is_relative_to(REPO)
    worker = subprocess.run([sys.executable, "-c", "import tfdist; print(tfdist.__file__)"], env=job_env(),
                            cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert pathlib.Path(worker.stdout.strip()).resolve().parent == INSTALLED
    assert package_files(INSTALLED.parent) >= package_files(SOURCE)  # the wheel installed every file


@pytest.fixture(scope="module")
def broken_install(tmp_path_factory) -> dict:
    """Arguments for subprocess.run: a Python whose tfdist is the installed one less its workers' start-up hook."""
    root = tmp_path_factory.mktemp("broken")
    shutil.copytree(INSTALLED, root / "tfdist", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.rmtree(root / "tfdist" / "launch" / "site")
    env = job_env({"PYTHONPATH": f"{root}{os.pathsep}{job_env()['PYTHONPATH']}", "TF_CONFIG": ""})
    return {"env": env, "cwd": root, "capture_output": True, "text": True}


def test_doctor_names_a_broken_install_and_its_fix(broken_install):
    result = subprocess.run([sys.executable, "-m", "tfdist.cli", "doctor"], timeout=120, **broken_install)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "PROBLEM: this tfdist install lacks its worker start-up hook" in result.stdout
    assert "pip install --force-reinstall tfdist" in result.stdout


def test_run_refuses_to_start_workers_without_their_fixes(broken_install):
    result = subprocess.run([sys.executable, "-m", "tfdist.cli", "run", "-n", "1", "--", sys.executable, "-c", "pass"],
                            timeout=60, **broken_install)
    assert result.returncode == 2
    assert "lacks its worker start-up hook" in result.stderr and "--no-fixes" in result.stderr
    assert "Traceback" not in result.stderr


def test_doctor_passes_on_this_install():
    result = subprocess.run([sys.executable, "-m", "tfdist.cli", "doctor"], env=job_env({"TF_CONFIG": ""}),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"tfdist       {tfdist.__version__}" in result.stdout
    assert "PROBLEM" not in result.stdout and str(INSTALLED) in result.stdout


def without(module: str, *argv: str) -> subprocess.CompletedProcess:
    """Runs the tfdist command ``argv`` in a Python where ``module`` cannot be imported."""
    code = (f"import sys; sys.modules[{module!r}] = None; from tfdist import cli; "
            f"sys.exit(cli.main({list(argv)!r}))")
    return subprocess.run([sys.executable, "-c", code], env=job_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module, argv, message", [
    ("tensorflow_datasets", ["bench", "--source", "synthetic", "--replicas", "1"],
     "tfdist bench: tfdist bench needs tensorflow-datasets, which cannot be imported here (import of "
     "tensorflow_datasets halted; None in sys.modules): pip install --force-reinstall tfdist (tfdist requires "
     "tensorflow-datasets; this install lacks it)"),
    ("tensorflow_datasets", ["convert", "--dataset", "mnist", "--out", "/nonexistent"],
     "tfdist convert: tfdist convert needs tensorflow-datasets"),
    ("matplotlib", ["bench", "--plot", "out.png"],
     'tfdist bench: tfdist bench --plot needs matplotlib, which cannot be imported here (import of matplotlib '
     'halted; None in sys.modules): pip install "tfdist[bench]"'),
    ("ray", ["run", "--ray", "-n", "1", "--", sys.executable, "-c", "pass"],
     'tfdist run --ray needs ray[train], which cannot be imported here (import of ray halted; None in '
     'sys.modules): pip install "tfdist[ray]"'),
])
def test_a_missing_dependency_is_one_line_naming_what_to_install(module, argv, message):
    result = without(module, *argv)
    assert result.returncode == 2, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert message in output and "Traceback" not in output
