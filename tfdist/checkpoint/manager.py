"""``CheckpointManager``: every worker saves what it owns, in the background; a checkpoint restores on any count.

Each worker writes one part: the whole variables it owns (a byte-balanced share of the weights and
of the unsharded optimizer state, ``layout.owners``) and its replicas' shards of a sharded optimizer's
slots. Nothing is gathered into one process. ``save`` snapshots those variables (copy on write: no copy
until training next updates them) and returns; a background thread writes the part and flushes it to
disk, and the chief commits the checkpoint once every worker's part is written (``store``). A save that
starts while the previous one still writes waits for it, so at most one copy is staged. ``restore`` reads
the newest committed checkpoint (as worker 0 sees it) into a model on any number of workers and replicas,
sharded or not: each replica reads the elements of its shard from the saved shards that hold them. When
another job's manager removes that checkpoint before every worker opened it (its ``max_to_keep``), every
worker reads the newer one instead (``_Agreement``).

Under several workers the directory must be one every worker sees (a shared or network filesystem);
the workers agree through the job's key-value store (``tfdist.kvstore``).
"""

from __future__ import annotations

import atexit
import errno
import functools
import os
import sys
import threading
import time
import uuid
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tfdist import kvstore, process_group, watchdog
from tfdist.checkpoint import layout, store
from tfdist.errors import CheckpointError
from tfdist.keras_fixes.sharded_state import is_shard_slot, local_shards, slot_replicas, slot_shape

FORMAT = 1
_ATTEMPT = "TFDIST_RESTART"
_managers = [0]  # managers of this process that began saving: the n-th is one manager on every worker
_restores = [0]  # restores of this process under several workers: the n-th is one restore on every worker
_savers: list[CheckpointManager] = []  # the managers of this process that began a save
_directories: list[str] = []  # the directories of the managers this process made


class CheckpointManager:
    """Saves and restores a Keras model and its optimizer, one part per worker.

    Args:
        directory: where the checkpoints go (``step-N`` folders); shared by every worker.
        max_to_keep: the committed checkpoints kept (older ones are removed after a commit); None keeps all.
        async_save: True: ``save`` returns once the state is snapshotted, and a background thread writes it;
            False: ``save`` returns once the checkpoint is committed.

    Raises:
        ValueError: a URL ``directory``, or a ``max_to_keep`` that is not a positive int or None.
    """

    def __init__(self, directory: str, max_to_keep: int | None = 3, async_save: bool = True):
        self.directory = store.check_directory(directory)
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or isinstance(max_to_keep, bool)
                                        or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be a positive int or None (keep all); received "
                             f"max_to_keep={max_to_keep!r}.")
        self.max_to_keep, self.async_save = max_to_keep, bool(async_save)
        self._token: str | None = None
        self._saves = 0
        self._writer: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._saving = threading.Lock()  # one save at a time, also when several threads call save
        self._claimed = False  # whether a commit of this manager claimed the directory (store.claim)
        self._last_save: tuple[int, str] | None = None  # (step, path) of the last save it began
        kvstore.before_leaving(self._leave)  # a job that leaves together still commits
        _directories.append(self.directory)
        atexit.register(self._report_unwaited)  # runs once Python joined the write

    @property
    def latest(self) -> str | None:
        """The path of the newest committed checkpoint, or None."""
        found = store.committed(self.directory)
        return found[-1][1] if found else None

    def save(self, model, metadata: dict[str, Any] | None = None) -> str:
        """Saves ``model`` (weights and optimizer state) as ``step-<optimizer.iterations>``; every worker calls it.

        Returns the path the checkpoint commits to. With ``async_save`` it is written in the background
        (``wait`` waits for the commit); an error of that write is raised by the next ``save`` or ``wait``.
        ``metadata`` (JSON) is kept in the manifest (``metadata()``).
        """
        with self._saving:
            return self._save(model, metadata)

    def _save(self, model, metadata: dict[str, Any] | None) -> str:
        self.wait()
        strategy = model.distribute_strategy
        rank, workers = process_group.worker_rank(strategy), process_group.num_workers(strategy)
        token = self._agree_on_token(rank, workers)
        self._saves += 1
        entries = _entries(model)
        step = _step(model)
        arrays = _stage(entries, rank, workers)
        manifest = {"format": FORMAT, "step": step, "workers": workers, "metadata": metadata or {},
                    "variables": [entry.describe() for entry in entries], "model": _config(model)}
        job = _SaveJob(self, token, self._saves, rank, workers, step, arrays, manifest)
        if self.async_save:
            self._writer = threading.Thread(target=job.run, name="tfdist-checkpoint-write")
            self._writer.start()
        else:
            job.run()
            self._raise_failure()
        path = os.path.join(self.directory, f"step-{step}")
        if self._last_save is None:
            _savers.append(self)
        self._last_save = (step, path)
        return path

    def wait(self) -> None:
        """Waits until the last save is committed (or failed); raises its error, if any."""
        self._join(None)
        self._raise_failure()

    def restore(self, model) -> int | None:
        """Restores the newest committed checkpoint into ``model`` on every worker; returns the optimizer's
        ``iterations`` then (the saved step without an optimizer), or None when the directory holds none.

        The model may run on another number of workers or replicas than the one that saved, with its optimizer
        state sharded or not. Waits for this manager's own save first.

        Raises:
            CheckpointError: the checkpoint is not this model's (another number or shape of variables), or a
                worker cannot open the newest one (a part missing).
        """
        self.wait()
        strategy = model.distribute_strategy
        agreement = _Agreement(self.directory, process_group.worker_rank(strategy),
                               process_group.num_workers(strategy))
        reader = self._open_newest(_Reader, agreement, discard=_Reader.close)
        return None if reader is None else _read_into(model, reader)

    def metadata(self, path: str | None = None) -> dict[str, Any]:
        """The ``metadata`` saved with the checkpoint at ``path`` (default: the newest; {} without one).

        Raises:
            CheckpointError: no committed checkpoint at ``path`` (``max_to_keep`` removed it, or it never committed).
        """
        if path is None:
            return self._open_newest(_metadata, _Agreement(self.directory, 0, 1)) or {}
        try:
            return _metadata(path)
        except FileNotFoundError as error:
            raise CheckpointError(
                f"CheckpointManager({self.directory!r}).metadata: no committed checkpoint at {path!r} (max_to_keep "
                f"removed it, or it never committed); the newest is {self.latest!r}. Pass a path that "
                "manager.latest returned since, or no path for the newest.") from error

    def _open_newest(self, read: Callable[[str], Any], agreement: _Agreement,
                     discard: Callable[[Any], None] = lambda found: None) -> Any:
        """``read(path)`` of the newest committed checkpoint as worker 0 sees it, or None without one.

        When another job's manager removes it (``max_to_keep``, after committing a newer one) before every worker
        read it, every worker reads the newer one instead (``discard`` drops what this worker read of the old one).
        """
        attempt, path = 0, agreement.choose(0, lambda: self.latest)
        while path is not None:
            try:
                found, problem = read(path), ""
            except FileNotFoundError as error:
                found, problem = None, str(error)
            problems = agreement.problems(attempt, problem)
            if not problems:
                return found
            if not problem:
                discard(found)
            attempt += 1
            path = agreement.choose(attempt, functools.partial(self._instead_of, path, problems))
        return None

    def _instead_of(self, path: str, problems: list[str]) -> str | None:
        """The checkpoint to read instead of ``path``, which a worker could not open (``problems``)."""
        newer = self.latest
        if newer == path:
            raise CheckpointError(
                f"{path} is the newest committed checkpoint, but {'; '.join(problems)}: a part of it is missing "
                "(removed by hand, or the workers do not share one filesystem). To restore the checkpoint before it, "
                "move it away.")
        return newer

    def _agree_on_token(self, rank: int, workers: int) -> str:
        """This manager's name in partial directories, the same on every worker (the chief's random one)."""
        if self._token is None:
            _managers[0] += 1
            key = f"tfdist/checkpoint/manager/{os.environ.get(_ATTEMPT, '0')}/{_managers[0]}"
            token = uuid.uuid4().hex[:12]
            if workers > 1:
                if rank == 0:
                    kvstore.put(key, token)
                else:
                    token = kvstore.wait_for(key, time.monotonic() + _timeout())
                    if token is None:
                        raise CheckpointError(f"CheckpointManager({self.directory!r}): worker 0 did not start this "
                                              f"save within {_timeout():g} s; every worker must call save.")
            self._token = token
        return self._token

    def _join(self, seconds: float | None) -> None:
        writer = self._writer
        if writer is not None:
            writer.join(seconds)
            if not writer.is_alive():
                self._writer = None

    def _leave(self, seconds: float) -> None:
        self._join(seconds)
        self._report_unwaited()

    def _report_unwaited(self) -> None:
        """Prints the error of a save nothing waited for (at exit, where it cannot be raised)."""
        failure, self._failure = self._failure, None
        if failure is not None:
            print(f"tfdist: CheckpointManager({self.directory!r}): its last save failed and nothing waited for it: "
                  f"{failure}", file=sys.stderr)

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure


def directories() -> list[str]:
    """The directories of the CheckpointManagers this process made, in order (what fit's preemption hint names)."""
    return list(_directories)


def committed_saves() -> list[tuple[int, str]]:
    """(step, path) of the last save of each CheckpointManager of this process, once each is committed (it waits for
    those still writing, and raises the error of one that failed): what a preemption's message names."""
    for manager in _savers:
        manager.wait()
    return [manager._last_save for manager in _savers]


class _Agreement:
    """How the workers of one restore agree, through the job's store: worker 0 chooses each checkpoint to read (another
    job may commit one while they look), and every worker learns which workers could not open it. One worker alone
    agrees with itself."""

    def __init__(self, directory: str, rank: int, workers: int):
        self.directory, self.rank, self.workers = directory, rank, workers
        if workers > 1:
            _restores[0] += 1
            self.key = f"tfdist/checkpoint/restore/{os.environ.get(_ATTEMPT, '0')}/{_restores[0]}"

    def choose(self, attempt: int, choice: Callable[[], str | None]) -> str | None:
        """Worker 0's ``choice()`` for ``attempt`` (a path, or None), on every worker; so is a CheckpointError of it."""
        if self.workers == 1:
            return choice()
        key = f"{self.key}/{attempt}/chosen"
        if self.rank == 0:
            try:
                path = choice()
            except CheckpointError as error:
                kvstore.put(key, f"failed: {error}")
                raise
            kvstore.put(key, path or "")
            return path
        said = self._wait(key, "worker 0 did not choose a checkpoint")
        if said.startswith("failed: "):
            raise CheckpointError(said[len("failed: "):])
        return said or None

    def problems(self, attempt: int, problem: str) -> list[str]:
        """What kept each worker from opening the checkpoint of ``attempt`` (this worker's: ``problem``, '' for
        nothing), the same list on every worker."""
        said = [problem]
        if self.workers > 1:
            kvstore.put(f"{self.key}/{attempt}/opened/{self.rank}", problem)
            said = [self._wait(f"{self.key}/{attempt}/opened/{worker}", f"worker {worker} did not open the checkpoint")
                    for worker in range(self.workers)]
        return [f"worker {worker} cannot open it ({said[worker]})" for worker in range(len(said)) if said[worker]]

    def _wait(self, key: str, missing: str) -> str:
        said = kvstore.wait_for(key, time.monotonic() + _timeout())
        if said is None:
            raise CheckpointError(f"CheckpointManager({self.directory!r}).restore: {missing} within {_timeout():g} s; "
                                  "every worker must call restore.")
        return said


class _SaveJob:
    """One save's write and commit (in the background thread with ``async_save``)."""

    def __init__(self, manager, token, save_id, rank, workers, step, arrays, manifest):
        self.manager, self.token, self.save_id, self.rank, self.workers = manager, token, save_id, rank, workers
        self.step, self.arrays, self.manifest = step, arrays, manifest
        self.partial = store.partial_dir(manager.directory, token, save_id)
        self.key = f"tfdist/checkpoint/{token}/{save_id}"

    def run(self) -> None:
        try:
            store.write_part(self.partial, self.rank, self.arrays)
            self.arrays = None  # the staged copy is freed as soon as it is on disk
            if self.rank == 0:
                self._commit()
            else:
                self._report_and_wait()
        except BaseException as error:  # noqa: BLE001 - raised again by the next save or wait
            error = self._another_owner() or error  # its claim removed this save's folder
            if self.workers > 1:
                kvstore.put(f"{self.key}/{self.rank}", f"failed: {type(error).__name__}: {error}")
                if self.rank == 0:
                    kvstore.put(f"{self.key}/committed", f"failed: {error}")
            self.manager._failure = error if isinstance(error, CheckpointError) else CheckpointError(
                f"Saving the checkpoint of step {self.step} into {self.manager.directory} failed on worker "
                f"{self.rank}: {type(error).__name__}: {error}{self._hint(error)}")

    def _hint(self, error: BaseException) -> str:
        """What to do about a full disk ('' for other errors)."""
        if not isinstance(error, OSError) or error.errno != errno.ENOSPC:
            return ""
        return (f": the filesystem of {self.manager.directory} is full. A save needs room for one more checkpoint "
                f"beside those kept (max_to_keep={self.manager.max_to_keep}; they are removed only once it commits): "
                "free space there, lower max_to_keep, or use a larger filesystem.")

    def _report_and_wait(self) -> None:
        kvstore.put(f"{self.key}/{self.rank}", "written")
        verdict = kvstore.wait_for(f"{self.key}/committed", time.monotonic() + _timeout())
        if verdict is None or verdict.startswith("failed"):
            raise CheckpointError(f"The checkpoint of step {self.step} was not committed: "
                                  f"{verdict or f'worker 0 did not commit it within {_timeout():g} s'}.")

    def _commit(self) -> None:
        deadline = time.monotonic() + _timeout()
        problems = []
        for worker in range(1, self.workers):
            said = kvstore.wait_for(f"{self.key}/{worker}", deadline)
            if said != "written":
                problems.append(f"worker {worker}: {said or f'wrote nothing within {_timeout():g} s'}")
        if problems:
            raise CheckpointError(f"The checkpoint of step {self.step} was not committed: " + "; ".join(problems))
        missing = [w for w in range(self.workers) if not os.path.exists(store.part_path(self.partial, w))]
        if missing:
            raise CheckpointError(
                f"Workers {missing} wrote their parts of step {self.step}, but worker 0 does not see them in "
                f"{self.partial}: the checkpoint directory must be one filesystem every worker shares.")
        if not self.manager._claimed or store.owner(self.manager.directory) is None:  # or it was removed since
            store.claim(self.manager.directory, self.token)  # (BackupAndRestore's end of fit removes backup_dir)
            self.manager._claimed = True
        taken = self._another_owner()
        if taken:
            raise taken
        self._check_newest()
        path = store.commit(self.partial, self.manager.directory, self.step, self.manifest)
        if self.workers > 1:
            kvstore.put(f"{self.key}/committed", path)
        if self.manager.max_to_keep is not None:
            store.keep_newest(self.manager.directory, self.manager.max_to_keep)
        store.remove_partials(self.manager.directory, self.token, self.save_id)

    def _another_owner(self) -> CheckpointError | None:
        """The error to raise when another manager has claimed the directory since this one did, or None."""
        holder = store.owner(self.manager.directory) if self.manager._claimed else None
        if holder in (None, self.token):
            return None
        return CheckpointError(f"Another CheckpointManager ({holder}) writes {self.manager.directory} now: two jobs or "
                               "two managers save into one directory. Give each its own directory.")

    def _check_newest(self) -> None:
        """Raises when a newer step is committed: this one would not be the latest (and max_to_keep would remove it)."""
        found = store.committed(self.manager.directory)
        if found and found[-1][0] > self.step:
            raise CheckpointError(
                f"The checkpoint of step {self.step} is older than the newest checkpoint in {self.manager.directory} "
                f"(step-{found[-1][0]}): restore would read that one. Call manager.restore(model) before training, "
                "or save into another directory.")


class _Entry:
    """A variable of the checkpoint: ``model/i`` (``model.weights[i]``) or ``optimizer/j``."""

    def __init__(self, key: str, variable):
        self.key, self.variable = key, variable
        self.sharded = is_shard_slot(variable)
        self.shape = tuple(slot_shape(variable) if self.sharded else variable.shape)
        self.dtype = np.dtype(variable.dtype if isinstance(variable.dtype, str) else variable.dtype.name)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.owner = 0

    def describe(self) -> dict[str, Any]:
        return {"key": self.key, "path": getattr(self.variable, "path", self.variable.name), "shape": list(self.shape),
                "dtype": self.dtype.name, "sharded": self.sharded, "owner": None if self.sharded else self.owner}


def _entries(model) -> list[_Entry]:
    entries = [_Entry(f"model/{i}", v) for i, v in enumerate(model.weights)]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        entries += [_Entry(f"optimizer/{j}", v) for j, v in enumerate(optimizer.variables)]
    return entries


def _stage(entries: list[_Entry], rank: int, workers: int) -> dict[str, tf.Tensor]:
    """Snapshots of what this worker writes (the whole variables it owns, its replicas' shards), without a copy.

    A read of a resource variable shares its buffer; TensorFlow copies a buffer another tensor still holds before
    it updates a variable (copy on write, also under XLA). So staging costs no time, and the next training step
    copies each variable it updates while the write holds the snapshot: at most one staged copy.
    """
    whole = [e for e in entries if not e.sharded]
    for entry, owner in zip(whole, layout.owners([e.size * e.dtype.itemsize for e in whole], workers)):
        entry.owner = owner
    arrays = {}
    for entry in entries:
        if entry.sharded:
            for replica, component in local_shards(entry.variable):
                arrays[f"{entry.key}/{replica}"] = _snapshot(component)
        elif entry.owner == rank:
            arrays[entry.key] = _snapshot(entry.variable)
    return arrays


def _snapshot(variable) -> tf.Tensor:
    value = variable if isinstance(variable, tf.Variable) else variable.value  # a Keras variable's tf.Variable
    return value.read_value() if isinstance(value, tf.Variable) else tf.identity(value)


def _step(model) -> int:
    optimizer = getattr(model, "optimizer", None)
    return int(optimizer.iterations.numpy()) if optimizer is not None and optimizer.built else 0


def _config(model) -> dict[str, Any] | None:
    """The model's and its compile's configs (``tfdist checkpoint export`` rebuilds it), or None."""
    try:
        return {"model": model.to_json(), "compile": model.get_compile_config()}
    except Exception:  # noqa: BLE001 - a subclassed model without get_config: export needs the model's code
        return None


def _timeout() -> float:
    return watchdog.timeout_from_env() or watchdog.DEFAULT_HANG_TIMEOUT


def restore_into(model, checkpoint: str) -> int:
    """Reads the checkpoint at ``checkpoint`` into ``model`` (its optimizer built first if the checkpoint has one);
    returns the optimizer's iterations (the saved step without one).

    Raises:
        CheckpointError: another number, shape or dtype of variables than the model's.
    """
    return _read_into(model, _Reader(checkpoint))


def _metadata(checkpoint: str) -> dict[str, Any]:
    """The ``metadata`` saved with the checkpoint at ``checkpoint`` (FileNotFoundError when it is gone)."""
    return store.read_manifest(checkpoint).get("metadata", {})


def _read_into(model, reader: _Reader) -> int:
    """``restore_into`` from a checkpoint ``reader`` opened (it closes it)."""
    checkpoint, manifest = reader.checkpoint, reader.manifest
    saved = manifest["variables"]
    optimizer = getattr(model, "optimizer", None)
    try:
        if any(v["key"].startswith("optimizer/") for v in saved) and optimizer is not None and not optimizer.built:
            with model.distribute_strategy.scope():
                optimizer.build(model.trainable_variables)
        entries = _entries(model)
        if len(entries) != len(saved):
            raise CheckpointError(
                f"{checkpoint} holds {len(saved)} variables ({_count(saved, 'model/')} of the model, "
                f"{_count(saved, 'optimizer/')} of its optimizer); this model has {len(entries)} "
                f"({_count([e.describe() for e in entries], 'model/')} and "
                f"{_count([e.describe() for e in entries], 'optimizer/')}): it was saved for another model or "
                "optimizer.")
        for entry, record in zip(entries, saved):
            if list(entry.shape) != record["shape"] or entry.dtype.name != record["dtype"]:
                raise CheckpointError(
                    f"{checkpoint}: {record['key']} ({record['path']}) was saved as {record['dtype']}"
                    f"{tuple(record['shape'])}; this model's {entry.key} ({entry.describe()['path']}) is "
                    f"{entry.dtype.name}{entry.shape}: it was saved for another model.")
            if entry.sharded:
                for replica, component in local_shards(entry.variable):
                    component.assign(reader.shard(record, replica, slot_replicas(entry.variable)))
            else:
                entry.variable.assign(reader.whole(record))
    finally:
        reader.close()
    return _step(model) if optimizer is not None and optimizer.built else int(manifest["step"])


def _count(records, prefix: str) -> int:
    return sum(r["key"].startswith(prefix) for r in records)


class _Reader:
    """A checkpoint opened for reading: its manifest, and its parts (each opened once, each array read when asked).

    Raises FileNotFoundError when a file of it is missing. Once it is open, a removal of the checkpoint (another
    manager's ``max_to_keep``) no longer disturbs it: its parts stay open.
    """

    def __init__(self, checkpoint: str):
        self.checkpoint = checkpoint
        self.manifest = store.read_manifest(checkpoint)
        self.files: list = []
        try:
            for worker in range(self.manifest["workers"]):
                self.files.append(np.load(store.part_path(checkpoint, worker)))
        except BaseException:
            self.close()
            raise
        self.where = {key: f for f in self.files for key in f.files}
        self.saved_replicas: dict[str, int] = {}

    def close(self) -> None:
        for file in self.files:
            file.close()

    def _array(self, key: str) -> np.ndarray:
        if key not in self.where:
            raise CheckpointError(f"The checkpoint has no array {key!r}: a part is missing or damaged.")
        return self.where[key][key]

    def _replicas_of(self, key: str) -> int:
        if key not in self.saved_replicas:
            self.saved_replicas[key] = sum(1 for k in self.where if k.rsplit("/", 1)[0] == key)
        return self.saved_replicas[key]

    def whole(self, record) -> np.ndarray:
        shape, key = tuple(record["shape"]), record["key"]
        if not record["sharded"]:
            return self._array(key).reshape(shape)
        size = int(np.prod(shape, dtype=np.int64))
        shards = [self._array(f"{key}/{r}") for r in range(self._replicas_of(key))]
        return np.concatenate(shards)[:size].reshape(shape)

    def shard(self, record, replica: int, replicas: int) -> np.ndarray:
        """Elements of replica ``replica``'s shard (of ``replicas``), padded with zeros to the shard's size."""
        size, key = int(np.prod(record["shape"], dtype=np.int64)), record["key"]
        start, stop = layout.shard_range(replica, replicas, size)
        if record["sharded"]:
            saved = self._replicas_of(key)
            parts = [self._array(f"{key}/{r}")[lo:hi] for r, lo, hi in layout.pieces(start, stop, saved, size)]
        else:
            parts = [self._array(key).reshape(-1)[start:stop]]
        values = np.concatenate(parts) if parts else np.zeros(0, np.dtype(record["dtype"]))
        return np.pad(values, (0, layout.shard_size(size, replicas) - values.size))

