"""``tfdist bench``: runs every replica count and batch in its own worker process, then reports.

Under ``tfdist run -n N -- tfdist bench --strategy multi_worker`` it runs in place on the
cluster instead, and the chief writes the report.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Sequence

from tfdist import cluster, extras
from tfdist.launch import local as launcher
from tfdist.launch import supervisor
from tfdist.bench.config import BenchConfig, BenchError, build_parser, parse_config
from tfdist.errors import DataError

__all__ = ["build_parser", "main"]  # the parser tfdist.cli finds here, and the command


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tfdist bench``; returns the exit code."""
    try:
        config = parse_config(list(sys.argv[1:] if argv is None else argv))
        if config.plot:
            extras.require("matplotlib", "tfdist bench --plot")  # before the runs, not after
        if cluster.cluster_from_env().is_multi_worker or config.strategy == "multi_worker":
            return _bench_on_cluster(config)
        return _bench_locally(config)
    except (BenchError, DataError) as err:  # bad settings, or a dataset that cannot be loaded
        print(f"tfdist bench: {err}", file=sys.stderr)
        return 2


def _bench_locally(config: BenchConfig) -> int:
    import tensorflow as tf

    from tfdist.bench import sources
    from tfdist.bench.runner import RunResult

    gpus = len(tf.config.list_physical_devices("GPU"))
    _check_replicas(config, gpus)
    sources.num_classes(config.dataset)
    pattern = sources.prepare_records(config)
    print(f"tfdist bench: {config.model} on {config.dataset}, source {config.source}"
          + (f" ({pattern})" if pattern else " (random tensors in memory: compute only)"), flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        config_path = os.path.join(tmp, "config.json")
        with open(config_path, "w") as f:
            f.write(config.to_json())
        for batch in config.batch_sizes:
            for replicas in config.replicas:
                out_path = os.path.join(tmp, f"result-{replicas}-{batch}.json")
                code = launcher.launch(
                    [sys.executable, "-m", "tfdist.bench.runner", config_path, str(replicas), str(batch), out_path,
                     pattern or ""],
                    num_workers=1, settings=supervisor.WorkerSettings(cpu_devices=None if gpus else replicas))
                if code:
                    print(f"tfdist bench: the run with {replicas} replica(s) at batch {batch} failed "
                          f"(exit {code}); its output is above.", file=sys.stderr)
                    return code
                with open(out_path) as f:
                    results.append(RunResult.from_json(f.read()))
    note = None if gpus or max(config.replicas) == 1 else (
        f"Note: no GPU here, so replicas are logical CPU devices sharing {os.cpu_count()} core(s): this "
        "measures tf.distribute's overhead, not a speedup. Run on GPUs or several machines for scaling.")
    _report(config, results, note)
    return 0


def _bench_on_cluster(config: BenchConfig) -> int:
    import tfdist

    strategy = tfdist.get_strategy("multi_worker")  # first: TensorFlow must not start before it
    from tfdist import collectives
    from tfdist.bench import runner, sources

    sources.num_classes(config.dataset)
    if tfdist.is_chief():  # the chief writes the shards once; the others then find them (shared storage)
        sources.prepare_records(config)
    collectives.barrier()
    pattern = sources.prepare_records(config)
    results = [runner.run(config, strategy, batch, pattern) for batch in config.batch_sizes]
    if tfdist.is_chief():
        _report(config, results)
    return 0


def _check_replicas(config: BenchConfig, gpus: int) -> None:
    available, kind = (gpus, "GPU(s)") if gpus else (os.cpu_count() or 1, "CPU cores (logical CPU replicas)")
    too_many = [r for r in config.replicas if r > available]
    if too_many:
        raise BenchError(f"--replicas {max(too_many)} is more than the {available} {kind} this machine has; "
                         f"use at most {available}.")


def _report(config: BenchConfig, results, note: str | None = None) -> None:
    from tfdist.bench import report

    rows = report.table_rows(config, results)
    print("\n" + report.format_table(rows))
    for line in dict.fromkeys(r.autotune for r in results if r.autotune):
        print(line)
    if note:
        print("\n" + note)
    if config.mode == "input":
        print("\n" + report.input_verdict(rows))
    for path, write in ((config.json, lambda p: report.write_json(p, config, results, rows)),
                        (config.csv, lambda p: report.write_csv(p, rows)),
                        (config.plot, lambda p: report.write_plot(p, rows))):
        if path:
            write(path)
            print(f"wrote {path}")
