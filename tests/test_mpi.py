"""Jobs started by MPI: rank and size from the MPI launcher, the TF cluster exchanged over MPI.

The readers are checked on environment mappings; the jobs run for real under Open MPI's
``mpirun`` (Debian's openmpi-bin, and mpi4py: see .ci/system-packages.md), skipped with the
reason where either is missing.
"""

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest

from tests.jobs import REPO, WORKERS, job_env
from tfdist import cluster
from tfdist.launch import mpi

EXAMPLES = REPO / "examples"
TIMEOUT = 240
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}

needs_mpirun = pytest.mark.skipif(
    shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs Open MPI's mpirun (apt-get install openmpi-bin) and mpi4py (pip install mpi4py)")


def test_open_mpi_variables_give_rank_size_and_local_rank():
    info = cluster.cluster_from_env(OMPI)
    assert (info.num_workers, info.worker_index, info.local_rank, info.local_size) == (4, 1, 1, 2)
    assert info.source == "mpi" and not info.is_chief and info.worker_addresses == ()


def test_mpich_and_intel_mpi_variables_give_rank_size_and_local_rank():
    info = cluster.cluster_from_env({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0",
                                     "MPI_LOCALNRANKS": "2"})
    assert (info.num_workers, info.worker_index, info.local_rank, info.local_size, info.is_chief) == (2, 0, 0, 2, True)


def test_mpi_comes_before_slurm_variables_of_the_allocation():
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "1"}
    assert cluster.cluster_from_env({**slurm, **OMPI}).num_workers == 4


def test_mpi_rank_count_that_differs_from_tf_config_is_an_error():
    tf_config = cluster.make_tf_config(["h1:1", "h2:2"], 0)
    with pytest.raises(cluster.ClusterConfigError, match=r"MPI started 4 rank\(s\) \(OMPI_COMM_WORLD_SIZE=4\) "
                                                          r"but TF_CONFIG describes 2 .*mpirun -np 2"):
        cluster.cluster_from_env({**OMPI, "TF_CONFIG": tf_config})


def test_mpi_rank_out_of_range_is_an_error():
    with pytest.raises(cluster.ClusterConfigError, match="PMI_RANK=2 is out of range for PMI_SIZE=2"):
        cluster.cluster_from_env({"PMI_RANK": "2", "PMI_SIZE": "2"})


class FakeComm:
    def __init__(self, size, rank):
        self.size, self.rank = size, rank

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return self.rank

    def allgather(self, value):
        return [value] * self.size


def test_mpi4py_seeing_another_rank_count_than_the_launcher_is_an_error():
    with pytest.raises(cluster.ClusterConfigError, match=r"MPI.COMM_WORLD has 1 rank\(s\).*say 4.*Reinstall mpi4py"):
        mpi.exchange_addresses(cluster.cluster_from_env(OMPI), FakeComm(1, 0))


def test_addresses_on_one_host_are_loopback_ports_of_every_rank():
    addresses = mpi.exchange_addresses(cluster.cluster_from_env(OMPI), FakeComm(4, 1))
    assert len(addresses) == 4 and all(a.startswith("127.0.0.1:") for a in addresses)


def test_mpirun_without_mpi4py_is_one_clear_error_naming_the_extra(tmp_path):
    hidden = tmp_path / "mpi4py"
    hidden.mkdir()
    (hidden / "__init__.py").write_text("raise ImportError('No module named mpi4py (hidden by the test)')\n")
    env = job_env({**OMPI, "OMPI_COMM_WORLD_RANK": "0", "PYTHONPATH": f"{tmp_path}:{REPO}"})
    for code in ("import tfdist.horovod as hvd; hvd.init()", "import tfdist\nwith tfdist.scope(): pass"):
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode != 0
        assert 'started by MPI (mpirun/mpiexec) but mpi4py cannot be imported' in result.stderr, result.stderr[-2000:]
        assert 'pip install "tfdist[mpi]"' in result.stderr


def mpirun(out_dir, script, *args):
    command = ["mpirun", "--oversubscribe", "-np", "2", sys.executable, str(WORKERS / "horovod_example_job.py"),
               str(out_dir), str(script), *map(str, args)]
    env = job_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT, start_new_session=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads((out_dir / f"worker{rank}.json").read_text()) for rank in (0, 1)], result.stdout


@needs_mpirun
def test_horovod_keras_mnist_under_mpirun_trains_one_two_rank_job(tmp_path):
    ckpt = tmp_path / "ckpt"
    workers, output = mpirun(tmp_path, EXAMPLES / "horovod" / "tensorflow2_keras_mnist.py", "--epochs", "2",
                             "--steps", "16", "--batch-size", "16", "--checkpoint-dir", ckpt)
    for worker in workers:
        fit = worker["fits"][-1]
        assert len(fit["batches"]) == 2 * 8  # steps_per_epoch = 16 // hvd.size(): size is 2
        assert fit["epoch_logs"][-1]["loss"] < fit["epoch_logs"][0]["loss"]
    assert workers[0]["final_weights"] == workers[1]["final_weights"]
    assert workers[0]["fits"][-1]["batches"][0]["loss"] != workers[1]["fits"][-1]["batches"][0]["loss"]  # own data
    assert sorted(p.name for p in ckpt.iterdir()) == ["checkpoint-1.h5", "checkpoint-2.h5"]  # rank 0 alone
    assert output.count("Epoch 2/2") == 1


@needs_mpirun
def test_tfdist_scope_under_mpirun_trains_one_model_on_two_workers(tmp_path):
    (tmp_path / "model").mkdir()
    workers, output = mpirun(tmp_path, EXAMPLES / "multi_worker_fit.py", tmp_path / "model")
    assert "worker 0 of 2: 2 replicas in sync" in output
    assert workers[0]["final_weights"] == workers[1]["final_weights"]
    logs = workers[0]["fits"][-1]["epoch_logs"]
    assert logs[-1]["loss"] < logs[0]["loss"]
    assert [p.name for p in (tmp_path / "model").iterdir()] == ["multi_worker_model.keras"]


@needs_mpirun
def test_real_mpirun_without_mpi4py_stops_every_rank_with_the_error(tmp_path):
    hidden = tmp_path / "hide" / "mpi4py"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named mpi4py (hidden by the test)')\n")
    script = tmp_path / "train.py"
    script.write_text("import tfdist.horovod as hvd\nhvd.init()\nprint('size', hvd.size(), flush=True)\n")
    env = job_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                   "PYTHONPATH": f"{tmp_path / 'hide'}:{REPO}"})
    result = subprocess.run(["mpirun", "--oversubscribe", "-np", "2", sys.executable, str(script)], env=env,
                            capture_output=True, text=True, timeout=120, start_new_session=True)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "size" not in result.stdout  # never two jobs of size 1
    assert 'mpi4py cannot be imported' in output and 'pip install "tfdist[mpi]"' in output, output[-3000:]


@needs_mpirun
def test_horovod_shape_under_mpirun(tmp_path):
    script = tmp_path / "shape.py"
    script.write_text("import pathlib, sys\nimport tfdist.horovod as hvd\nhvd.init()\n"
                      "shape = f'shape {hvd.rank()} ' + str([hvd.size(), hvd.local_size(), hvd.local_rank() == hvd.rank(), "
                      "hvd.cross_size(), hvd.cross_rank(), hvd.is_homogeneous()])\n"
                      "pathlib.Path(sys.argv[1], f'rank{hvd.rank()}.txt').write_text(shape)\n")
    env = job_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    result = subprocess.run(["mpirun", "--oversubscribe", "-np", "2", sys.executable, str(script), str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=120, start_new_session=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    shapes = sorted(path.read_text() for path in tmp_path.glob("rank*.txt"))  # files: mpirun may interleave lines
    assert shapes == ["shape 0 [2, 2, True, 1, 0, True]", "shape 1 [2, 2, True, 1, 0, True]"]
