#!/usr/bin/env bash
# The test command (README, .ci/run): tests what users install, not the checkout.
#
# Builds tfdist's sdist and wheel, installs the wheel (not editable) with its test extras into
# the current Python, copies the test tree without tfdist's sources to a temporary folder, and
# runs pytest there, so every test and every worker it starts imports the installed package.
# Arguments go to pytest: bash tests/run.sh -k doctor
# TFDIST_TEST_WORKERS=N runs the tests on N pytest-xdist workers, each taking whole test modules (so a module's
# shared cluster or strategy stays one); a crashed worker fails the run at once instead of being replaced. The
# default, 0, runs them in one process: on 2 cores N=2 took 37 min instead of about 46; one of its first runs
# crashed in TensorFlow, a bug tfdist now avoids (README, Tests: tf_fixes.multi_device_input).
set -euo pipefail
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
if [ "${TFDIST_TEST_WORKERS:-0}" -gt 0 ]; then
  PARALLEL=(-n "$TFDIST_TEST_WORKERS" --dist loadfile --max-worker-restart 0)
fi
python -m pytest -q -p no:cacheprovider --durations=15 "${PARALLEL[@]}" "$@"
