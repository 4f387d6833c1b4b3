"""Runs the gate and prints its report: ``python -m tests.keras_gate.run [--all | FILE ...] [--workers 2]``.

    python -m tests.keras_gate.run                       # the subset tfdist's patches touch (what CI runs)
    python -m tests.keras_gate.run --all                 # the whole set (selection.ALL_FOLDERS)
    python -m tests.keras_gate.run callbacks/early_stopping_test.py -k final_weights
    python -m tests.keras_gate.run --workers 2           # Keras' tf.distribute tests, plain vs tfdist run -n 2

Exit status 0 when the gate passes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys

from tests.keras_gate import passes, sdist, selection, verdict

# Keras' own tf.distribute tests that run under `tfdist run -n 2` (docs/keras-tests.md says why these).
ON_WORKERS = ("backend/tensorflow/distribute_test.py", "backend/tensorflow/optimizer_distribute_test.py",
              "callbacks/swap_ema_weights_test.py")


def gate(files: list[str] | None = None, everything: bool = False, workers: int = 1,
         extra: tuple[str, ...] = ()) -> tuple[verdict.Verdict, str]:
    """Runs the tfdist pass (or ``tfdist run -n workers``) of ``files`` and, beside it, the plain pass's collection;
    then plain the tests that did not pass with tfdist; (verdict, report)."""
    root = sdist.keras_tests()
    if not files:
        files = list(ON_WORKERS) if workers > 1 else selection.whole_set(root) if everything else selection.subset()
    absent = selection.missing(root, files)
    if absent:
        raise FileNotFoundError(f"Keras {sdist.installed_keras()} has no test file {absent}: update "
                                f"tests/keras_gate/selection.py for this Keras (its files are under {root}).")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the collection is short: the tfdist pass has the cores
        collection = pool.submit(passes.collect, root, files, extra=extra)
        changed = pool.submit(passes.run, root, files, with_tfdist=True, workers=workers, extra=extra)
        collection, changed = collection.result(), changed.result()
    plain = passes.rerun(root, collection, verdict.plain_runs(collection, changed))
    result = verdict.compare(plain, changed)
    return result, f"Keras {sdist.installed_keras()}, {len(files)} test files\n" + verdict.report(plain, changed, result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", help="test files relative to keras/src (default: the subset)")
    parser.add_argument("--all", action="store_true", help="the whole set: " + ", ".join(selection.ALL_FOLDERS))
    parser.add_argument("--workers", type=int, default=1,
                        help="run the second pass under `tfdist run -n WORKERS` (default: one process)")
    parser.add_argument("-k", dest="keyword", help="only the tests whose names match (pytest's -k)")
    arguments = parser.parse_args(argv)
    if arguments.workers < 1:
        parser.error(f"--workers must be 1 or more; received --workers {arguments.workers}")
    extra = ("-k", arguments.keyword) if arguments.keyword else ()
    result, text = gate(arguments.files, arguments.all, arguments.workers, extra)
    print(text)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
