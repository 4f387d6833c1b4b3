"""The benchmark's report: the table people publish, plus JSON, CSV and a PNG."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import platform
from typing import Sequence

from tfdist import extras
from tfdist.bench import profile
from tfdist.bench.config import BenchConfig
from tfdist.bench.runner import RunResult

COLUMNS = ("dataset", "model", "source", "replicas", "global_batch", "warmup_s", "s_per_epoch",
           "images_per_sec", "speedup", "efficiency")


def table_rows(config: BenchConfig, results: Sequence[RunResult]) -> list[dict]:
    """One row per run; speedup is against the fewest replicas at the same global batch."""
    rows = []
    for result in results:
        same_batch = [r for r in results if r.global_batch == result.global_batch]
        base = min(same_batch, key=lambda r: r.replicas)
        speedup = result.images_per_sec / base.images_per_sec
        row = {"dataset": config.dataset, "model": config.model, "source": config.source,
               "replicas": result.replicas, "global_batch": result.global_batch,
               "warmup_s": round(result.warmup_seconds, 3), "s_per_epoch": round(result.seconds_per_epoch, 3),
               "images_per_sec": round(result.images_per_sec, 1), "speedup": round(speedup, 3),
               "efficiency": round(speedup * base.replicas / result.replicas, 3)}
        if result.breakdown is not None:
            parts = profile.StepBreakdown(**result.breakdown)
            row.update({"step_ms": round(parts.step_ms, 2), "compute_ms": round(parts.compute_ms, 2),
                        "allreduce_ms": round(parts.allreduce_ms, 2), "other_ms": round(parts.other_ms, 2),
                        "input_ms": round(parts.input_ms, 2), "hidden_ms": round(parts.hidden_ms, 2),
                        "exposed_ms": round(parts.exposed_ms, 2)})
        elif result.input_records_per_sec is not None:
            row["input_records_per_sec"] = round(result.input_records_per_sec, 1)
            row["bound"] = "input-bound" if result.input_records_per_sec < result.images_per_sec else "compute-bound"
        rows.append(row)
    return rows


def format_table(rows: Sequence[dict]) -> str:
    """A plain-text table of ``rows`` (every key of the first row, in order)."""
    headers = list(rows[0])
    cells = [[str(row[h]) for h in headers] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    line = lambda values: "  ".join(v.rjust(w) for v, w in zip(values, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def input_verdict(rows: Sequence[dict]) -> str:
    """One sentence per run in input mode: is the job input-bound?"""
    lines = []
    for row in rows:
        ratio = row["input_records_per_sec"] / row["images_per_sec"]
        lines.append(f"replicas {row['replicas']}, batch {row['global_batch']}: the input pipeline gives "
                     f"{row['input_records_per_sec']:.0f} records/s, training takes {row['images_per_sec']:.0f} "
                     f"images/s ({ratio:.2f}x): {row['bound']}"
                     + (" - speed up the input (more shards, cache, smaller images)" if ratio < 1 else "."))
    return "\n".join(lines)


def write_json(path: str, config: BenchConfig, results: Sequence[RunResult], rows: Sequence[dict]) -> None:
    """Versions, devices, the full config, every epoch's time, and the table."""
    import keras
    import tensorflow as tf

    import tfdist

    payload = {
        "versions": {"tfdist": tfdist.__version__, "tensorflow": tf.__version__, "keras": keras.__version__,
                     "python": platform.python_version()},
        "machine": {"platform": platform.platform(), "processor": platform.machine(), "cpu_cores": os.cpu_count(),
                    "gpus": [d.name for d in tf.config.list_physical_devices("GPU")]},
        "config": dataclasses.asdict(config),
        "runs": [{**dataclasses.asdict(r), "images_per_sec": r.images_per_sec} for r in results],
        "table": list(rows),
    }
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def write_csv(path: str, rows: Sequence[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_plot(path: str, rows: Sequence[dict]) -> None:
    """A PNG with two views: images/s against replicas beside ideal linear scaling (each point
    labelled with its efficiency), and seconds per epoch against replicas (the TensorFlow
    guide's view). Both y axes start at 0. One line per global batch."""
    matplotlib = extras.require("matplotlib", "tfdist bench --plot")
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, (rate, epoch) = plt.subplots(1, 2, figsize=(11, 4))
    replicas = sorted({row["replicas"] for row in rows})
    for batch in sorted({row["global_batch"] for row in rows}):
        points = sorted((row["replicas"], row) for row in rows if row["global_batch"] == batch)
        xs = [x for x, _ in points]
        line, = rate.plot(xs, [r["images_per_sec"] for _, r in points], marker="o", label=f"global batch {batch}")
        base_replicas, base = points[0]
        rate.plot(xs, [base["images_per_sec"] * x / base_replicas for x in xs], linestyle="--",
                  color=line.get_color(), alpha=0.6, label=f"ideal (linear), batch {batch}")
        for x, row in points:
            rate.annotate(f"{row['efficiency']:.0%}", (x, row["images_per_sec"]), textcoords="offset points",
                          xytext=(0, 6), ha="center", fontsize=8)
        epoch.plot(xs, [r["s_per_epoch"] for _, r in points], marker="o", label=f"global batch {batch}")
    for axes, label in ((rate, "images/s (labels: scaling efficiency)"), (epoch, "seconds per epoch")):
        axes.set_xlabel("replicas")
        axes.set_ylabel(label)
        axes.set_xticks(replicas)
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(f"{rows[0]['model']} on {rows[0]['dataset']} ({rows[0]['source']})")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
