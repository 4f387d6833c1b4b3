"""Keras' test files, from the sdist of the installed Keras (fetched from the package registry once, then cached)."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib

CACHE_ENV = "TFDIST_KERAS_GATE_CACHE"


def cache_dir() -> pathlib.Path:
    """Where sdists and their extracted tests are kept: $TFDIST_KERAS_GATE_CACHE, else the user's cache folder."""
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV])
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return base / "tfdist-keras-gate"


def installed_keras() -> str:
    """The version of the Keras this Python imports, e.g. '3.15.1'."""
    return importlib.metadata.version("keras")


def fetch(version: str, cache: pathlib.Path) -> pathlib.Path:
    """The path of ``keras-<version>.tar.gz``, downloaded with pip from the configured registry if not cached."""
    target = cache / "sdist"
    found = sorted(target.glob(f"keras-{version}.tar.gz"))
    if found:
        return found[0]
    target.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", f"keras=={version}", "--no-binary", ":all:", "--no-deps",
               "--dest", str(target), "--quiet"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    found = sorted(target.glob(f"keras-{version}.tar.gz"))
    if result.returncode != 0 or not found:
        raise RuntimeError(
            f"Fetching the Keras {version} sdist failed (exit {result.returncode}): {' '.join(command)}\n"
            f"{result.stdout[-2000:]}{result.stderr[-2000:]}\nThe gate needs Keras' test files from the package "
            f"registry; put keras-{version}.tar.gz in {target} (or point {CACHE_ENV} at a folder whose sdist/ "
            f"holds it) to run offline.")
    return found[0]


def extract_tests(sdist: pathlib.Path, destination: pathlib.Path) -> pathlib.Path:
    """Writes every ``keras/src/**/*_test.py`` of ``sdist`` under ``destination`` (``keras/src/`` dropped, so no
    folder is named ``keras`` and the installed package is what the tests import), and a ``pytest.ini`` with
    Keras' own warning filters; returns ``destination``."""
    if (destination / ".complete").exists():
        return destination
    staging = pathlib.Path(tempfile.mkdtemp(prefix="keras-tests-", dir=destination.parent))
    try:
        with tarfile.open(sdist) as archive:
            for member in archive.getmembers():
                parts = pathlib.PurePosixPath(member.name).parts
                if member.isfile() and parts[1:3] == ("keras", "src") and parts[-1].endswith("_test.py"):
                    path = staging.joinpath(*parts[3:])
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(archive.extractfile(member).read())
                elif member.isfile() and parts[1:] == ("pyproject.toml",):
                    (staging / "pytest.ini").write_text(_pytest_ini(archive.extractfile(member).read()))
        (staging / ".complete").touch()
        shutil.rmtree(destination, ignore_errors=True)
        staging.rename(destination)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return destination


def _pytest_ini(pyproject: bytes) -> str:
    """A pytest.ini that makes the folder its own test root, with the warning filters Keras' CI runs its tests with."""
    options = tomllib.loads(pyproject.decode()).get("tool", {}).get("pytest", {}).get("ini_options", {})
    lines = ["[pytest]", "# Written by tests/keras_gate from Keras' pyproject.toml.", "filterwarnings ="]
    lines += [f"    {entry}" for entry in options.get("filterwarnings", [])]
    return "\n".join(lines) + "\n"


def keras_tests(cache: pathlib.Path | None = None) -> pathlib.Path:
    """The folder of the installed Keras' test files, relative to ``keras/src`` (``trainers/trainer_test.py``, ...)."""
    cache = cache or cache_dir()
    version = installed_keras()
    destination = cache / f"keras-{version}-tests"
    destination.parent.mkdir(parents=True, exist_ok=True)
    return extract_tests(fetch(version, cache), destination)
