"""``fit`` stops at a step every worker agreed on, and a preempted job saves there (``tfdist.preemption``).

Keras 3's BackupAndRestore has no ``save_before_preemption`` (tf_keras 2's had it, on TF's
PreemptionCheckpointHandler, custom loops only), and a callback that sets
``model.stop_training`` on one worker leaves the others alone in the next step's collective.
With this fix each ``fit`` is a session of ``tfdist.preemption`` (opened as it starts, closed
when its steps end or it fails), and:

* at every batch end, a callback's ``model.stop_training = True`` on one worker of several
  becomes a request: every worker stops after the same agreed step (exit 0, the same weights);
* a stop signal (SIGTERM, SIGUSR1) to any worker makes every worker stop after the agreed
  step, save through the user's ``BackupAndRestore`` (its mid-epoch state: the epoch and
  the steps done in it, which ``tfdist.keras_fixes.callbacks`` resumes at), and exit 85.
  A stop that falls on an epoch's last step saves after the epoch's end (validation and
  epoch-end callbacks run first), so a resumed run never replays an empty epoch;
* at every epoch end, a ``model.stop_training`` set on any worker (a callback of its own)
  stops every worker after that epoch: the flag is summed over the workers by a collective
  every worker runs there;
* when the steps end (a signal in the last step, or during the last validation), before any
  callback's ``on_train_end``: every worker saves and exits 85 if a stop signal reached any of
  them, with BackupAndRestore's backup of the last epoch still there (the same command then
  finds the fit done and goes on after it).

A ``fit`` of a model outside the job's strategy (a probe on one worker, a ``fit`` inside a
callback) is a local session: it takes no stop signal and no number.

``fit`` on several workers without BackupAndRestore says once, where a preemption is likely
(under SLURM or Kubernetes), that nothing would be saved at the stop (or only what a
``tfdist.CheckpointManager`` of the process saved before it). Preempted without it, the message names
what a ``tfdist.CheckpointManager`` saved (committed first), or the steps lost. After a restore,
EarlyStopping's and ReduceLROnPlateau's counters go on from the backup
(``tfdist.keras_fixes.callback_state``): as they were when it saved (Keras runs callbacks in list
order, so list BackupAndRestore after them to keep their epoch end).
"""

from __future__ import annotations

import os
import sys

from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.callbacks.backup_and_restore import BackupAndRestore
from keras.src.callbacks.callback_list import CallbackList

from tfdist import preemption, process_group
from tfdist import fit_start
from tfdist.checkpoint import manager as checkpoint_manager
from tfdist.keras_fixes import callback_state
from tfdist.keras_fixes.callbacks import strategy_of, sum_over_workers
from tfdist.keras_fixes.signatures import FIT_PARAMETERS
from tfdist.patching import Patch

patch = Patch(
    "preemption", "keras#19280 (Keras 3 dropped BackupAndRestore(save_before_preemption))",
    without="a SIGTERM kills the workers with nothing saved since the last backup, and a callback that stops one "
            "worker leaves the others waiting in the next step's collective.")

# Where a scheduler may preempt the job: the hint about BackupAndRestore is said there only.
_SCHEDULER_VARIABLES = ("SLURM_JOB_ID", "KUBERNETES_SERVICE_HOST")
_hinted = False


def _backups(callbacks: CallbackList) -> list[BackupAndRestore]:
    return [c for c in callbacks.callbacks if isinstance(c, BackupAndRestore)]


def _several_workers(model) -> bool:
    return process_group.num_workers(strategy_of(model)) > 1


@patch.replaces(keras_tf_trainer.TensorFlowTrainer, "fit", FIT_PARAMETERS)
def _fit_is_a_session(original, self, *args, **kwargs):
    session = preemption.begin_fit(of_the_job=_several_workers(self))
    try:
        result = original(self, *args, **kwargs)
    except BaseException:
        preemption.end_fit(session, failed=True)  # its rounds end with it; its error goes on
        raise
    preemption.end_fit(session)
    return result


@patch.replaces(CallbackList, "on_train_begin", ("self", "logs"))
def _arm(original, self, logs=None):
    global _hinted
    original(self, logs)
    backups = _backups(self)
    for backup in backups:  # its saves keep the other callbacks' counters; a restore sets them back
        backup._tfdist_callbacks = self.callbacks
        callback_state.restore(self.callbacks, backup._training_metadata_path)
    if preemption.armed() and not _hinted and preemption.rank() == 0 and not backups and \
            any(name in os.environ for name in _SCHEDULER_VARIABLES) and preemption.in_fit() and \
            _several_workers(self._model):
        _hinted = True
        print(_no_backup_hint(), file=sys.stderr, flush=True)


def _no_backup_hint() -> str:
    """What fit says at start where a scheduler may preempt it and no BackupAndRestore would save at the stop."""
    head = "tfdist: fit has no keras.callbacks.BackupAndRestore: if this job is preempted (a stop signal), every worker"
    fix = "add BackupAndRestore(DIR) to the callbacks to save at the stop and resume there (docs/preemption.md)."
    managers = checkpoint_manager.directories()
    if not managers:
        return f"{head} stops at an agreed step but nothing is saved; {fix}"
    named = ", ".join(repr(directory) for directory in managers)
    return (f"{head} stops at an agreed step and only what tfdist.CheckpointManager({named}) saved before it is "
            f"kept: the steps since its last save are lost (unless a callback of yours saves at that step); {fix}")


@patch.replaces(CallbackList, "on_train_batch_end", ("self", "batch", "logs"))
def _stop_at_the_agreed_step(original, self, batch, logs=None):
    fit_start.close()  # the step pulled its data: no later iterator (a validation one) takes the fit's start
    original(self, batch, logs)
    model = getattr(self, "_model", None)
    if model is None or not preemption.in_fit():
        return  # a custom loop driving a CallbackList: should_stop is its way to stop
    if getattr(model, "stop_training", False) and _several_workers(model):
        model.stop_training = False  # one worker alone must not stop: ask every worker to stop together
        preemption.request(f"a callback set model.stop_training on worker {preemption.rank()} "
                           f"at batch {batch}")
    decision = preemption.step_done()
    if decision is None:
        return
    model.stop_training = True
    steps = self.params.get("steps")
    if decision.preempt and not (steps and batch + 1 >= steps):
        _save_and_exit(self, decision)
    # a preemption at an epoch's last step: saved after the epoch's end (below)


@patch.replaces(CallbackList, "on_epoch_begin", ("self", "epoch", "logs"))
def _training_data_next(original, self, epoch, logs=None):
    original(self, epoch, logs)
    preemption.arm_resume(epoch)  # fit enumerates its training data next: only that takes a mid-epoch resume


@patch.replaces(CallbackList, "on_epoch_end", ("self", "epoch", "logs"))
def _epoch_end_together(original, self, epoch, logs=None):
    original(self, epoch, logs)
    decision = preemption.decision()
    if decision is not None and decision.preempt:
        _save_and_exit(self, decision)
    model = getattr(self, "_model", None)
    if model is not None and preemption.in_fit() and _several_workers(model):
        model.stop_training = sum_over_workers(float(bool(model.stop_training)), model) > 0


@patch.replaces(CallbackList, "on_train_end", ("self", "logs"))
def _verdict_at_the_end(original, self, logs=None):
    decision = preemption.end_of_steps()  # every worker is here: a stop signal any of them got is a preemption
    if decision is not None:
        _save_and_exit(self, decision)  # before the callbacks' end (BackupAndRestore would delete its backup)
    original(self, logs)


def _save_and_exit(callbacks: CallbackList, decision: preemption.Decision) -> None:
    """Saves through every BackupAndRestore (worker 0's files kept) and exits EXIT_PREEMPTED on every worker."""
    backups = _backups(callbacks)
    for backup in backups:
        backup._save_model()
    step = int(callbacks.model.optimizer.iterations.numpy())
    head = f"tfdist: preempted ({decision.why}): every worker stopped after step {step}"
    if backups:
        backup = backups[0]
        where = (f"epoch {backup._current_epoch + 1}, step {backup._tfdist_steps_done} of it"
                 if getattr(backup, "_tfdist_steps_done", 0) else f"the end of epoch {backup._current_epoch}")
        message = f"{head} ({where}) and saved to {backup.backup_dir}; run the same command to resume there."
    else:
        message = _without_backup(head, step)
    preemption.exit_preempted(f"{message} Exit code {preemption.EXIT_PREEMPTED}.")


def _without_backup(head: str, step: int) -> str:
    """The message of a preemption at ``step`` that no BackupAndRestore saved: what a tfdist.CheckpointManager of
    this process saved (a callback's, at that step or before; its write is committed first), or that nothing was."""
    saves = checkpoint_manager.committed_saves()
    at_step = [path for saved, path in saves if saved == step]
    if at_step:
        return (f"{head} and tfdist.CheckpointManager saved it to {', '.join(at_step)}; run the same command to "
                "resume there (if the script calls manager.restore(model) before training).")
    earlier = [(saved, path) for saved, path in saves if saved < step and os.path.exists(path)]
    if not earlier:
        return (f"{head}; nothing was saved (no keras.callbacks.BackupAndRestore in fit's callbacks): the steps this "
                "run trained are lost.")
    saved, path = max(earlier)
    return (f"{head}; nothing was saved at that step (no keras.callbacks.BackupAndRestore in fit's callbacks): the "
            f"{step - saved} steps since tfdist.CheckpointManager saved step {saved} to {path} are lost.")
