"""examples/horovod/ on 2 workers through `tfdist run`: what a Horovod user checks.

The Keras MNIST and elastic examples run as committed; the custom-loop MNIST example runs
with Horovod's own import line put back (``import horovod.tensorflow as hvd``) under
``tfdist run --horovod``: the script a Horovod user already has.
"""

import json
import shutil
import subprocess
import sys

import pytest

from tests.jobs import REPO, job_env, run_job

EXAMPLES = REPO / "examples" / "horovod"
TIMEOUT = 240


def launch(*args, cwd=REPO):
    command = [sys.executable, "-m", "tfdist.run", "--timeout", str(TIMEOUT), *args]
    return subprocess.run(command, cwd=cwd, env=job_env(), capture_output=True, text=True, timeout=TIMEOUT + 30)


@pytest.fixture(scope="module")
def keras_mnist(tmp_path_factory):
    out = tmp_path_factory.mktemp("keras_mnist")
    result = run_job("horovod_example_job.py", out, str(EXAMPLES / "tensorflow2_keras_mnist.py"), "--epochs", "4",
                     "--steps", "16", "--batch-size", "16", "--checkpoint-dir", str(out / "ckpt"),
                     timeout=TIMEOUT).check()
    result.out_dir = out
    return result


def main_fit(job, rank):
    return job.results[rank]["fits"][-1]


def test_keras_mnist_loss_goes_down_and_weights_end_identical(keras_mnist):
    logs = main_fit(keras_mnist, 0)["epoch_logs"]
    assert logs[-1]["loss"] < 0.7 * logs[0]["loss"]
    assert logs == main_fit(keras_mnist, 1)["epoch_logs"]  # MetricAverageCallback: the same on both
    assert keras_mnist.results[0]["final_weights"] == keras_mnist.results[1]["final_weights"]


def test_keras_mnist_each_worker_steps_on_its_own_batch_of_b(keras_mnist):
    for rank in (0, 1):
        batches = main_fit(keras_mnist, rank)["batches"]
        assert len(batches) == 4 * 8  # steps_per_epoch = 16 // size()
        assert all(b["seen"] == 16 * (b["batch"] + 1) for b in batches)  # this process's loss tracker: B per step
    first_losses = [main_fit(keras_mnist, rank)["batches"][0]["loss"] for rank in (0, 1)]
    assert first_losses[0] != first_losses[1]  # same weights (broadcast), different data


def test_keras_mnist_warmup_follows_horovod_and_ends_at_lr_times_size(keras_mnist):
    size, base, steps, warmup_epochs = 2, 0.001, 8, 3
    for rank in (0, 1):
        fit = main_fit(keras_mnist, rank)
        for b in fit["batches"]:
            epoch = b["epoch"] + (b["batch"] + 1) / steps  # Horovod sets each batch's rate as of its end
            want = base * size if b["epoch"] >= warmup_epochs else base * (epoch * (size - 1) / warmup_epochs + 1)
            assert b["lr"] == pytest.approx(want, rel=1e-6)
        assert fit["lr_end"][warmup_epochs - 1] == pytest.approx(base * size)


def test_keras_mnist_only_rank_0_wrote_checkpoints_and_printed(keras_mnist):
    import tfdist.horovod as hvd

    ckpt = keras_mnist.out_dir / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == [f"checkpoint-{e}.h5" for e in (1, 2, 3, 4)]
    model = hvd.load_model(ckpt / "checkpoint-4.h5")  # the optimizer comes back wrapped, with its state
    assert model.optimizer._tfdist_reduction is not None and int(model.optimizer.iterations.numpy()) == 32
    output = keras_mnist.output
    assert "[0] Epoch 4/4" in output and "[1] Epoch" not in output
    assert "[0] Epoch 3: finished gradual learning rate warmup" in output
    assert "[1] Epoch 3: finished" not in output


def test_unchanged_horovod_custom_loop_script_runs_under_tfdist_run_horovod(tmp_path):
    source = (EXAMPLES / "tensorflow2_mnist.py").read_text()
    horovod_line = "import horovod.tensorflow as hvd"
    script = tmp_path / "tensorflow2_mnist.py"
    script.write_text(source.replace("import tfdist.horovod as hvd  # Horovod: " + horovod_line, horovod_line))
    shutil.copy(EXAMPLES / "mnist_like.py", tmp_path)
    assert "import tfdist" not in script.read_text() and horovod_line in script.read_text()
    # 60 steps a worker: the loss falls from about 2.3 to under 0.05 by step 50 (its prints come every 10 steps); at
    # 30 a worker, step 20's loss was still above step 0's in one run in about fourteen (2.21, 2.26, 2.34).
    result = run_job("horovod_example_job.py", tmp_path / "out", str(script), "--steps", "120", "--batch-size", "16",
                     "--checkpoint-dir", str(tmp_path / "ckpt"), launcher_args=("--horovod",), timeout=TIMEOUT,
                     env={"HOROVOD_TIMELINE": str(tmp_path / "timeline.json")}).check()
    assert result.results[0]["final_weights"] == result.results[1]["final_weights"]
    losses = [float(line.split("Loss: ")[1]) for line in result.output.splitlines() if line.startswith("[0] Step #")]
    assert len(losses) == 6 and losses[-1] < losses[0] / 4, losses
    assert "[1] Step" not in result.output
    assert (tmp_path / "ckpt" / "ckpt-1.index").exists()
    # HOROVOD_TIMELINE: rank 0 wrote tfdist's timeline (at exit): both ranks' tape steps and their buckets' all-reduces
    trace = json.loads((tmp_path / "timeline.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        steps = [e for e in spans if e["pid"] == rank and e["name"].startswith("step ")]
        assert len(steps) >= 20 and sum(e["pid"] == rank and e["name"] == "bucket 0" for e in spans) == len(steps)


@pytest.mark.parametrize("script, extra", [
    ("tensorflow2_keras_synthetic_benchmark.py", ["--fp16-allreduce"]),
    ("tensorflow2_synthetic_benchmark.py", ["--num-warmup-batches", "1"]),
])
def test_synthetic_benchmarks_report_images_per_second_on_rank_0(script, extra):
    result = launch("-n", "2", "--", sys.executable, str(EXAMPLES / script), "--no-cuda", "--model", "MobileNet",
                    "--image-size", "32", "--batch-size", "8", "--num-iters", "2", "--num-batches-per-iter", "2",
                    *extra)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "[0] Total img/sec on 2 CPU(s): " in result.stdout
    assert "[1] Iter" not in result.stdout and "[1] Total" not in result.stdout


def test_hvd_run_starts_the_workers_and_returns_their_results():
    result = subprocess.run([sys.executable, str(REPO / "tests" / "workers" / "hvd_run_driver.py"), "hello"],
                            env=job_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "results [(0, 2, 3.0, 'hello'), (1, 2, 3.0, 'hello')]" in result.stdout


@pytest.fixture(scope="module")
def elastic(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic")
    # rank 1 is SIGKILLed at the start of batch 3 of epoch 1 of the training fit (fit #1; #0 is the
    # example's one-step optimizer initialisation); commits come every 2 batches and at epoch ends.
    result = run_job("horovod_example_job.py", out, str(EXAMPLES / "tensorflow2_keras_mnist_elastic.py"),
                     "--epochs", "3", "--steps", "12", "--batch-size", "16", "--batches-per-commit", "2",
                     launcher_args=("--max-restarts", "1"), env={"HOROVOD_TEST_KILL": "1:1:1:3"},
                     timeout=TIMEOUT).check()
    result.out_dir = out
    return result


def test_elastic_run_resumes_from_the_last_commit_after_a_worker_is_killed(elastic):
    import json

    assert "worker 1 was killed by SIGKILL" in elastic.output and "restarting all workers (1/1)" in elastic.output
    commits = json.loads((elastic.out_dir / "commits-attempt0.json").read_text())
    last = commits[-1]
    assert [c["epoch"] for c in commits] == [0, 0, 1, 1] and [c["batch"] for c in commits] == [2, 4, 0, 2]
    for rank in (0, 1):
        result = elastic.results[rank]
        assert result["attempt"] == 1
        assert result["resumed"] == last  # epoch 1, batch 2 and the committed weights, on both ranks
        fit = result["fits"][-1]
        assert fit["start_weights"] == last["weights"]
        done = [(b["epoch"], b["batch"]) for b in fit["batches"]]
        # epochs=3 - 1: the rest of epoch 1 (batches 2-5), then all of epoch 2
        assert done == [(0, 2), (0, 3), (0, 4), (0, 5)] + [(1, b) for b in range(6)]
    assert elastic.results[0]["final_weights"] == elastic.results[1]["final_weights"]
