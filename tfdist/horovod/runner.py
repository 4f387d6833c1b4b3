"""``hvd.run(func, num_proc=N)``: Horovod's launcher as a function, on ``tfdist run``'s.

The calling process becomes the launcher: it starts N workers on this machine the way
``tfdist run -n N --horovod`` does (TF_CONFIG, ranks, the start-up hook, output prefixed
with the rank, every worker stopped when one fails), each worker calls
``func(*args, **kwargs)``, and ``run`` returns their results in rank order.

``func`` travels by reference (pickle): define it at module level. A function of the
script being run (``__main__``) is found again the way ``multiprocessing`` finds it: each
worker runs that script under the name ``__mp_main__``, so code under
``if __name__ == "__main__":`` does not run there.
"""

from __future__ import annotations

import json
import os
import pickle
import runpy
import sys
import tempfile
import types
import warnings
from typing import Callable, Sequence

from tfdist.launch import local, supervisor

_CALL = "call.pkl"
_MAIN = "main.json"
_WORKER_CODE = "import sys; from tfdist.horovod.runner import _worker; _worker(sys.argv[1])"
# Horovod options that have no meaning here, and what to do instead.
_UNSUPPORTED = {
    "min_num_proc": "hvd.run starts workers on this machine only; for a job whose nodes come and go start "
                    "'tfdist run --nnodes MIN:MAX --master ADDR:PORT -n P' on each node, with hvd.elastic.run "
                    "(or hvd.elastic with reset_limit=R to survive worker failures here)",
    "max_num_proc": "hvd.run starts workers on this machine only; for a job whose nodes come and go start "
                    "'tfdist run --nnodes MIN:MAX --master ADDR:PORT -n P' on each node, with hvd.elastic.run "
                    "(or hvd.elastic with reset_limit=R to survive worker failures here)",
    "hostfile": "hvd.run starts workers on this machine only; on several machines start "
                "'tfdist run --nnodes N --node-rank K --master ADDR:PORT -n P' on each",
    "host_discovery_script": "no script is polled for hosts: a host joins when 'tfdist run --nnodes MIN:MAX "
                             "--master ADDR:PORT -n P' starts on it, and leaves when it dies or its launcher stops",
    "ssh_port": "tfdist does not start workers over ssh",
    "ssh_identity_file": "tfdist does not start workers over ssh",
    "mpi_args": "tfdist uses no MPI",
    "output_filename": "the launcher prints every worker's output, each line prefixed with its rank; redirect "
                       "the calling process's output instead",
}


def run(func: Callable, args: Sequence = (), kwargs: dict | None = None, num_proc: int | None = None,
        min_num_proc=None, max_num_proc=None, slots=None, reset_limit: int | None = None, cooldown_range=None,
        hosts: str | None = None, hostfile=None, host_discovery_script=None, start_timeout: float | None = None,
        ssh_port=None, ssh_identity_file=None, disable_cache=None, output_filename=None, verbose=None,
        use_gloo=None, use_mpi=None, mpi_args=None, network_interface=None, network_interfaces=None,
        executable: str | None = None, np: int | None = None, min_np=None, max_np=None) -> list:
    """Runs ``func(*args, **kwargs)`` in ``num_proc`` worker processes; returns their results by rank.

    Args:
        func: a module-level function (it is pickled by reference).
        args, kwargs: its arguments (picklable).
        num_proc: worker processes (``np`` is Horovod's older name).
        reset_limit: restarts allowed when a worker fails (``tfdist run --max-restarts``).
        hosts: None or this machine with enough slots ("localhost:4").
        start_timeout: seconds for every worker to join (``tfdist run --start-timeout``).
        executable: the Python that runs the workers (default: this one).
        use_gloo, use_mpi: accepted; TensorFlow's collectives are used either way.
        slots, cooldown_range, disable_cache, verbose, network_interface(s): accepted, no effect.
        min_num_proc, max_num_proc (min_np, max_np), hostfile, host_discovery_script,
            ssh_port, ssh_identity_file, mpi_args, output_filename: must be None (the
            error says what to do instead).

    Returns:
        One result per rank, rank 0 first.

    Raises:
        ValueError: an option tfdist cannot honour, or hosts that are not this machine.
        RuntimeError: the job failed (its output, and the launcher's summary, came first).
    """
    num_proc = num_proc if num_proc is not None else (np if np is not None else 1)
    given = {"min_num_proc": min_num_proc if min_num_proc is not None else min_np,
             "max_num_proc": max_num_proc if max_num_proc is not None else max_np,
             "hostfile": hostfile, "host_discovery_script": host_discovery_script, "ssh_port": ssh_port,
             "ssh_identity_file": ssh_identity_file, "mpi_args": mpi_args, "output_filename": output_filename}
    for name, value in given.items():
        if value is not None:
            raise ValueError(f"hvd.run({name}={value!r}) cannot be honoured: {_UNSUPPORTED[name]}.")
    if not (isinstance(num_proc, int) and num_proc >= 1):
        raise ValueError(f"num_proc must be an int >= 1; received {num_proc!r}.")
    _check_hosts(hosts, num_proc)
    if use_gloo or use_mpi:
        warnings.warn("hvd.run: tfdist uses TensorFlow's own collectives; use_gloo/use_mpi change nothing.",
                      stacklevel=2)
    with tempfile.TemporaryDirectory(prefix="tfdist-hvd-run-") as workdir:
        main = sys.modules.get("__main__")
        call = {"func": func, "args": tuple(args), "kwargs": dict(kwargs or {})}
        with open(os.path.join(workdir, _MAIN), "w", encoding="utf-8") as f:
            json.dump({"path": os.path.abspath(main.__file__) if getattr(main, "__file__", None) else None,
                       "argv": list(sys.argv)}, f)
        try:
            payload = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, AttributeError, TypeError) as err:
            raise ValueError(f"hvd.run sends func and its arguments to the workers with pickle, which failed "
                             f"({err}): define func at module level (not a lambda or nested function) and pass "
                             "picklable arguments.") from None
        with open(os.path.join(workdir, _CALL), "wb") as f:
            f.write(payload)
        command = [executable or sys.executable, "-c", _WORKER_CODE, workdir]
        code = local.launch(command, num_workers=num_proc, settings=supervisor.WorkerSettings(horovod=True),
                            max_restarts=reset_limit or 0,
                            start_timeout=start_timeout if start_timeout is not None else supervisor.DEFAULT_START_TIMEOUT)
        if code != 0:
            raise RuntimeError(f"hvd.run: the job failed with exit code {code}; the workers' output is above.")
        results = []
        for rank in range(num_proc):
            with open(os.path.join(workdir, f"result-{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _check_hosts(hosts: str | None, num_proc: int) -> None:
    if hosts is None:
        return
    slots = 0
    for entry in hosts.split(","):
        host, _, count = entry.strip().partition(":")
        if host not in ("localhost", "127.0.0.1", os.uname().nodename):
            raise ValueError(f"hvd.run(hosts={hosts!r}) names {host!r}, but hvd.run starts workers on this machine "
                             "only; on several machines start 'tfdist run --nnodes N --node-rank K --master "
                             "ADDR:PORT -n P -- python train.py' on each.")
        slots += int(count or 1)
    if slots < num_proc:
        raise ValueError(f"hvd.run(hosts={hosts!r}) gives {slots} slot(s) for num_proc={num_proc}.")


def _worker(workdir: str) -> None:
    """A worker: load the call, run it, write the result as ``result-<rank>.pkl``."""
    with open(os.path.join(workdir, _CALL), "rb") as f:
        payload = f.read()
    with open(os.path.join(workdir, _MAIN), encoding="utf-8") as f:
        main = json.load(f)
    try:
        call = pickle.loads(payload)
    except AttributeError:  # func (or an argument) is defined in the caller's __main__ script
        if not main["path"]:
            raise
        _recreate_main(main["path"], main["argv"])
        call = pickle.loads(payload)
    result = call["func"](*call["args"], **call["kwargs"])
    rank = int(os.environ.get("TFDIST_WORKER_INDEX", "0"))
    with open(os.path.join(workdir, f"result-{rank}.pkl"), "wb") as f:
        pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)


def _recreate_main(path: str, argv: list[str]) -> None:
    """Runs the caller's script as ``__mp_main__`` and makes it ``__main__`` (as multiprocessing does)."""
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(path))
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
