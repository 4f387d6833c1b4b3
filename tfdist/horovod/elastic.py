"""``hvd.elastic`` on ``tfdist run --max-restarts``: committed state survives a worker's death.

Horovod's elastic mode keeps the survivors running and rolls them back to the last commit
in memory. TensorFlow cannot drop a dead peer from a running collective group, so tfdist
does it with restarts instead:

* ``state.commit()`` snapshots the state (model and optimizer variables, and the extra
  attributes such as ``epoch`` and ``batch``); rank 0 also writes it, atomically, under
  the job directory that ``tfdist run`` keeps across restarts (``TFDIST_JOB_DIR``).
* When a worker dies, ``tfdist run --max-restarts R`` stops every worker and starts them
  all again. ``hvd.elastic.run`` then loads the last commit on rank 0, broadcasts it to
  every rank (``state.sync()``), calls the reset callbacks and runs the training function:
  the job resumes from the last commit, losing at most the batches since it.
* A stop signal (``tfdist.preemption``) to any worker of a custom loop: every worker stops at
  the same ``commit()``, which exits 85 once committed; ``--max-restarts`` restarts the job
  from that commit (under Keras' fit, fit's own agreed stop acts first).
* Under ``tfdist run --nnodes MIN:MAX`` nodes join and leave at such restarts too: the job
  restarts with the new number of workers, rank 0 (always on node 0, whose job directory
  keeps the commits) loads the last commit and the reset callbacks see the new size.
  Workers never join a running round. Without a job directory (plain ``python``), commits
  stay in memory.

With Keras, ``UpdateBatchStateCallback`` makes the first epoch after a restart start at
the committed batch (the batches before it are read and skipped), and
``CommitStateCallback`` commits after the other callbacks of the same batch or epoch have
updated the state, whatever their order in the list.
"""

from __future__ import annotations

import functools
import itertools
import os
import pickle
from typing import Any, Callable

import keras
import numpy as np

from tfdist import atomic_files, preemption
from tfdist import cluster as cluster_lib
from tfdist.horovod import basics, ops

__all__ = ["CommitStateCallback", "KerasState", "ObjectState", "State", "TensorFlowKerasState", "TensorFlowState",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]

_state_numbers = itertools.count()
_commits = itertools.count(1)  # commits of every state: the same count on every rank


class State:
    """State kept across a worker's death: commit it; ``run`` restores and syncs it.

    Args:
        bcast_object: how values travel from rank 0 (default ``hvd.broadcast_object``).
        get_rank: this process's rank (default ``hvd.rank``).
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None, get_rank: Callable[[], int] | None = None):
        self._bcast_object = bcast_object or ops.broadcast_object
        self._rank = get_rank or basics.rank
        self._reset_callbacks: list[Callable[[], None]] = []
        self._number = next(_state_numbers)  # the same on every rank: states are built in the same order

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions to call after the state was restored from a commit (after a restart)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Runs ``reset()`` and the reset callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Snapshots the state; rank 0 also writes it where a restarted job finds it."""
        self.save()
        path = self._commit_path()
        if path is not None and self._rank() == 0:
            payload = pickle.dumps(self._payload(), protocol=pickle.HIGHEST_PROTOCOL)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_files.atomic_write(lambda temp: _write_bytes(temp, payload), path)
        if not preemption.in_fit() and preemption.should_stop(next(_commits)):
            preemption.exit_if_preempted()  # every rank committed this same state: a restart resumes here

    def check_host_updates(self) -> None:
        """Nothing to check: no worker joins or leaves a running tfdist job."""

    def save(self) -> None:
        """Snapshots the state in memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Goes back to the last snapshot."""
        raise NotImplementedError

    def sync(self) -> None:
        """Makes every rank's state rank 0's."""
        raise NotImplementedError

    def reset(self) -> None:
        """Called by ``on_reset`` before the reset callbacks."""

    def _payload(self) -> dict:
        raise NotImplementedError

    def _load_payload(self, payload: dict) -> None:
        raise NotImplementedError

    def _commit_path(self) -> str | None:
        job_dir = os.environ.get(cluster_lib.ENV_JOB_DIR)
        return os.path.join(job_dir, "elastic", f"state-{self._number}.pkl") if job_dir else None

    def _restore_commit(self) -> bool:
        """Rank 0 loads the last commit of an earlier attempt, if any; returns (on every rank) whether it did."""
        path = self._commit_path()
        found = False
        if self._rank() == 0 and path is not None and os.path.exists(path):
            with open(path, "rb") as f:
                self._load_payload(pickle.load(f))
            self.save()
            found = True
        return bool(self._bcast_object(found))


class ObjectState(State):
    """Plain Python values as attributes (``state.epoch``, ``state.batch``, ...).

    Args:
        bcast_object, get_rank: see ``State``.
        **kwargs: the attributes and their starting values.
    """

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)

    def _payload(self) -> dict:
        return {"attributes": dict(self._saved_state)}

    def _load_payload(self, payload: dict) -> None:
        self._saved_state = dict(payload["attributes"])
        self._set_attrs()


class TensorFlowState(ObjectState):
    """A list of ``tf.Variable`` plus attributes.

    Args:
        variables: the variables to keep.
        session: accepted (TF1); must be None.
        **kwargs: attributes, as ``ObjectState``.
    """

    def __init__(self, variables=None, session=None, **kwargs):
        if variables is None:
            raise ValueError("TensorFlowState needs variables=[...] (TensorFlow 2 has no global variables list).")
        self.variables = list(variables)
        self._values = [v.numpy() for v in self.variables]
        super().__init__(**kwargs)

    def save(self) -> None:
        self._values = [v.numpy() for v in self.variables]
        super().save()

    def restore(self) -> None:
        _assign(self.variables, self._values, "variables")
        super().restore()

    def sync(self) -> None:
        ops.broadcast_variables(self.variables, root_rank=0)
        self._values = [v.numpy() for v in self.variables]
        super().sync()

    def _payload(self) -> dict:
        return {**super()._payload(), "variables": self._values}

    def _load_payload(self, payload: dict) -> None:
        _assign(self.variables, payload["variables"], "variables")
        super()._load_payload(payload)


class TensorFlowKerasState(ObjectState):
    """A Keras model and its optimizer, plus attributes.

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default ``model.optimizer``).
        backend: accepted (TF1); unused.
        **kwargs: attributes, as ``ObjectState``.

    Raises:
        ValueError: the model is not built yet.
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not model.built:
            raise ValueError("TensorFlowKerasState needs a built model: call model.build(input_shape), or train "
                             "one step, before creating the state.")
        self.model = model
        self.optimizer = optimizer or model.optimizer
        self._save_model()
        super().__init__(**kwargs)

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        self._load_model(self._model_values, self._optimizer_values)
        super().restore()

    def sync(self) -> None:
        self._build_optimizer()
        optimizer_variables = list(self.optimizer.variables) if self.optimizer is not None else []
        ops.broadcast_variables(list(self.model.variables) + optimizer_variables, root_rank=0)
        self._save_model()
        super().sync()

    def _build_optimizer(self) -> None:
        if self.optimizer is not None and not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)

    def _save_model(self) -> None:
        self._model_values = [np.asarray(v.numpy()) for v in self.model.variables]
        self._optimizer_values = [np.asarray(v.numpy()) for v in self.optimizer.variables] if self.optimizer else []

    def _load_model(self, model_values: list, optimizer_values: list) -> None:
        _assign(self.model.variables, model_values, "model variables")
        if optimizer_values:
            self._build_optimizer()
            _assign(self.optimizer.variables, optimizer_values, "optimizer variables")

    def _payload(self) -> dict:
        return {**super()._payload(), "model": self._model_values, "optimizer": self._optimizer_values}

    def _load_payload(self, payload: dict) -> None:
        self._load_model(payload["model"], payload["optimizer"])
        super()._load_payload(payload)


class KerasState(TensorFlowKerasState):
    """A Keras model (with its compiled optimizer) plus attributes; Horovod's Keras name."""

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, **kwargs)


def run(func: Callable) -> Callable:
    """Decorator: ``func(state, ...)`` runs from the last commit of an earlier attempt, synced on every rank.

    Before calling ``func``, rank 0 loads the last commit (when the job was restarted
    after a worker died), every rank takes rank 0's state, and the reset callbacks run if
    a commit was loaded. A failure inside ``func`` ends the process (``tfdist run
    --max-restarts`` restarts the job); it is not retried in place.
    """
    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        restored = state._restore_commit()
        state.sync()
        if restored:
            state.on_reset()
        try:
            result = func(state, *args, **kwargs)
        except BaseException:
            preemption.end_loop(failed=True)  # its commits' rounds end with it; its error goes on
            raise
        preemption.end_loop()  # a stop signal acts as without tfdist again
        return result

    return wrapper


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches and at the end of every epoch.

    The commit happens once the other callbacks of that batch or epoch have run (at the
    start of the next one, or when training ends), so ``state.batch`` and ``state.epoch``
    are up to date whatever the callbacks' order.
    """

    def __init__(self, state: State, batches_per_commit: int = 1):
        super().__init__()
        if not (isinstance(batches_per_commit, int) and batches_per_commit >= 1):
            raise ValueError(f"batches_per_commit must be an int >= 1; received {batches_per_commit!r}.")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._remaining = batches_per_commit
        self._due = False

    def _commit_if_due(self) -> None:
        if self._due:
            self._due = False
            self.state.commit()

    def on_train_begin(self, logs=None):
        self._remaining = self.batches_per_commit
        self._due = False

    def on_train_batch_begin(self, batch, logs=None):
        self._commit_if_due()

    def on_train_batch_end(self, batch, logs=None):
        self._remaining -= 1
        if self._remaining == 0:
            self._due = True
            self._remaining = self.batches_per_commit

    def on_epoch_begin(self, epoch, logs=None):
        self._commit_if_due()

    def on_epoch_end(self, epoch, logs=None):
        self._due = True

    def on_train_end(self, logs=None):
        self._commit_if_due()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` = batches done in the current epoch; a restored run starts the epoch there."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state

    def on_train_begin(self, logs=None):
        if self.state.batch:
            preemption.resume_at(self.state.batch)

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` = epochs done, counting those before a restart."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self._initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self._initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._initial_epoch + epoch + 1


def _assign(variables, values, what: str) -> None:
    variables = list(variables)
    if len(variables) != len(values):
        raise ValueError(f"The committed state holds {len(values)} {what}, but this process has {len(variables)}: "
                         "the script must build the same model and optimizer as the run that committed it.")
    for variable, value in zip(variables, values):
        variable.assign(value)


def _write_bytes(path: str, payload: bytes) -> None:
    with open(path, "wb") as f:
        f.write(payload)
