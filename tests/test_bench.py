"""`tfdist bench` end to end on tiny settings (mock and synthetic data, 1 and 2 replicas)."""

import csv
import json
import re
import subprocess
import sys

import matplotlib.image
import pytest

from tests.jobs import job_env

TIMEOUT = 240
TINY = ["--model", "small_cnn", "--image-size", "16", "--batch-size", "8", "--epochs", "2",
        "--steps-per-epoch", "2", "--mock-examples", "32", "--shards", "2"]


def bench(*args, launcher=(), env=None):
    """Runs `tfdist bench` (under `tfdist run LAUNCHER` when given); returns its stdout."""
    cli = [sys.executable, "-m", "tfdist.cli", "bench", *TINY, *args]
    command = [sys.executable, "-m", "tfdist.run", *launcher, "--", *cli] if launcher else cli
    result = subprocess.run(command, env=job_env(env, shield="--plot" not in args), capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def mock_run(tmp_path_factory, no_gpu_here):  # replicas 1,2 are logical CPUs here; one GPU would refuse 2
    out = tmp_path_factory.mktemp("bench")
    stdout = bench("--source", "mock", "--replicas", "1,2", "--cache-dir", str(out / "cache"),
                   "--json", str(out / "r.json"), "--csv", str(out / "r.csv"), "--plot", str(out / "r.png"))
    return out, stdout


def test_table_compares_one_and_two_replicas(mock_run):
    out, stdout = mock_run
    assert "small_cnn on tf_flowers, source mock" in stdout
    assert "replicas 2, global batch 8: epoch 2" in stdout
    assert "images_per_sec" in stdout and "efficiency" in stdout and "logical CPU devices" in stdout
    rows = list(csv.DictReader(open(out / "r.csv")))
    assert [(r["replicas"], r["global_batch"]) for r in rows] == [("1", "8"), ("2", "8")]
    assert float(rows[0]["speedup"]) == 1.0 and float(rows[1]["images_per_sec"]) > 0


def test_json_holds_versions_devices_config_and_every_epoch(mock_run):
    report = json.loads((mock_run[0] / "r.json").read_text())
    assert report["versions"]["tensorflow"].startswith("2.") and report["machine"]["cpu_cores"] >= 1
    assert report["config"]["source"] == "mock" and report["config"]["replicas"] == [1, 2]
    runs = report["runs"]
    assert [len(r["devices"]) for r in runs] == [1, 2] and runs[1]["strategy"] == "MirroredStrategy"
    assert all(len(r["epoch_seconds"]) == 2 for r in runs)
    assert (mock_run[0] / "cache").is_dir()  # the shards are kept for the next run


def test_plot_is_a_png_image(mock_run):
    path = mock_run[0] / "r.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(path).shape[2] in (3, 4)


def test_input_mode_says_whether_the_job_is_input_bound(tmp_path):
    stdout = bench("--source", "mock", "--mode", "input", "--replicas", "1", "--cache-dir", str(tmp_path))
    assert "input_records_per_sec" in stdout
    assert "records/s, training takes" in stdout and ("input-bound" in stdout or "compute-bound" in stdout)


def test_multi_worker_bench_profiles_the_step_under_the_launcher(tmp_path):
    stdout = bench("--source", "synthetic", "--strategy", "multi_worker", "--mode", "profile",
                   "--json", str(tmp_path / "mw.json"), launcher=("-n", "2", "--timeout", str(TIMEOUT)),
                   env={"TFDIST_AUTOTUNE": "1", "TFDIST_AUTOTUNE_FILE": str(tmp_path / "autotune.json")})
    assert "random tensors in memory" not in stdout  # the local orchestrator did not run
    report = json.loads((tmp_path / "mw.json").read_text())
    assert report["runs"][0]["replicas"] == 2 and report["runs"][0]["strategy"] == "CollectiveAllReduceStrategy"
    assert stdout.count("wrote ") == 1  # only the chief reports
    line = re.search(r"\[0\] replicas 2, global batch 8: step ([\d.]+) ms = compute ([\d.]+) \+ all-reduce "
                     r"([\d.]+) \+ other (-?[\d.]+) \(input ([\d.]+), overlapped\); in training, all-reduce "
                     r"([\d.]+) hidden under compute \+ ([\d.]+) exposed", stdout)
    step, compute, allreduce, other, _, hidden, exposed = map(float, line.groups())
    assert compute > 0 and allreduce > 0 and step == pytest.approx(compute + allreduce + other, abs=0.2)
    assert hidden + exposed > 0  # the trace found the gradient all-reduces of the training steps
    assert report["table"][0]["exposed_ms"] == pytest.approx(exposed, abs=0.06)
    assert report["table"][0]["allreduce_ms"] == pytest.approx(allreduce, abs=0.06)
    # 4 steps are too few for autotune to settle: the report says so (tfdist.autotune)
    assert re.search(r"\[0\] tfdist autotune: still measuring after \d+ steps \(buckets 4 MiB, first 1 MiB, ", stdout)
    assert report["runs"][0]["autotune"].startswith("tfdist autotune: still measuring")
