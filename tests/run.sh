#!/usr/bin/env bash
# The test command (README, .ci/run): tests what users install, not the checkout.
#
# Builds tfdist's sdist and wheel, installs the wheel (not editable) with its test extras into
# the current Python, copies the test tree without tfdist's sources to a temporary folder, and
# runs pytest there, so every test and every worker it starts imports the installed package.
# Arguments go to pytest: bash tests/run.sh -k doctor
# TFDIST_TEST_WORKERS=N runs the tests on N pytest-xdist workers (default 3), each taking whole test modules (so a
# module's shared cluster or strategy stays one); a crashed worker fails the run at once instead of being replaced.
# Three on 2 cores: many tests wait (for a peer, a timeout, a killed worker) with the cores idle, and a third worker
# fills them (2026-11-29: 0 workers 42 min, 2 workers 39 min, 3 workers 29 min, the last two beside other runs).
# TFDIST_TEST_WORKERS=0 runs them in this one process.
set -euo pipefail
WORKERS="${TFDIST_TEST_WORKERS:-3}"
if ! [[ "$WORKERS" =~ ^[0-9]+$ ]]; then
  echo "tests/run.sh: TFDIST_TEST_WORKERS is the number of pytest-xdist workers (0: one process);" \
       "received TFDIST_TEST_WORKERS='$WORKERS'. Set a whole number, e.g. TFDIST_TEST_WORKERS=3." >&2
  exit 2
fi
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STAGE="$(mktemp -d "${TMPDIR:-/tmp}/tfdist-tests.XXXXXX")"
trap 'rm -rf "$STAGE"' EXIT

# The wheel builder first: a fresh `pip install .` does not bring it (it is in the [test] extras,
# which are installed from the wheel it builds).
python -m pip install --quiet build
python -m build --sdist --wheel --outdir "$STAGE/dist" "$ROOT" >"$STAGE/build.log" 2>&1 \
  || { cat "$STAGE/build.log"; echo "tests/run.sh: building the sdist and wheel failed (log above)" >&2; exit 1; }
WHEEL="$(ls "$STAGE"/dist/tfdist-*.whl)"
python -m pip install --quiet --force-reinstall --no-deps "$WHEEL"
python -m pip install --quiet "$WHEEL[test]"

mkdir "$STAGE/tree"
tar -C "$ROOT" --exclude=./tfdist --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./dist \
    --exclude='*.egg-info' --exclude=__pycache__ --exclude=.pytest_cache -cf - . | tar -C "$STAGE/tree" -xf -
cd "$STAGE/tree"
# What tests/test_install.py checks the installed package against.
export TFDIST_SOURCE="$ROOT" TFDIST_DIST_DIR="$STAGE/dist"
PARALLEL=()
if [ "$WORKERS" -gt 0 ]; then
  PARALLEL=(-n "$WORKERS" --dist loadfile --max-worker-restart 0)
fi
python -m pytest -q -p no:cacheprovider --durations=15 "${PARALLEL[@]}" "$@"
