"""``compile(steps_per_execution=K)`` under tf.distribute strategies (keras#19246).

Keras 3 runs K steps in one ``tf.function`` through a ``while_loop`` whose body calls the
one-step ``tf.function`` inside a ``tf.cond``; under MirroredStrategy and
MultiWorkerMirroredStrategy the nested function fails: "You must feed a value for placeholder
tensor '.../while/cond/Placeholder'". Under a strategy, the replacement traces the step body
inline, as the only call in a ``tf.while_loop`` that stops early at the end of the data (so
each replica's step is traced once, as in Keras' loop), and reduces the logged values across
replicas once per call (Keras returns only the last step's), which under a multi-worker
strategy saves a collective per step. Every other case (no strategy, K=1, eager, XLA, Python
iterators) stays with Keras: with no strategy Keras' function works. The loop's first call
that finds no batch returns nothing, and ``StopIteration`` ends the epoch, as in Keras.

``exact_steps_patch``: Keras 3.15 runs every call for K whole steps while the data lasts, so an
epoch of S steps (``steps_per_epoch``) trains ceil(S/K)*K (``fit(steps_per_epoch=70)`` at K=16
trains 80 a epoch, and ``predict(steps=70)`` returns 80 batches). The epoch iterator now hands
the last call of an epoch a ``PartialExecution`` of the steps left, which the function above
runs as a shorter loop (and Keras' own per-batch path runs batch by batch). Callbacks see
Keras' batch numbers where Keras trains the steps asked for (a call the data ends reports the
batch a whole call would end at: 2, 5, 8, 11 for 10 batches at K=3, as Keras' tests pin), and
the true last batch of a call tfdist cuts short where Keras would train past the epoch.

``auto_patch``: ``compile(steps_per_execution="auto")``, and any model compiled under a
strategy tfdist built without a ``steps_per_execution`` of its own, runs ``AUTO_STEPS``
steps per call in ``fit``, or 1 when a callback needs to see every batch.
"""

from __future__ import annotations

import inspect
import itertools

import tensorflow as tf
from keras.src import callbacks as callbacks_module
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.trainers import trainer as trainer_module
from keras.src.trainers.epoch_iterator import EpochIterator
from keras.src.utils import python_utils

from tfdist import process_group, state, step_clock
from tfdist.keras_fixes.signatures import COMPILE_PARAMETERS, FIT_PARAMETERS
from tfdist.patching import Patch

patch = Patch(
    "steps_per_execution", "keras#19246",
    without="compile(steps_per_execution=K>1) fails in fit/evaluate under MirroredStrategy and "
            "MultiWorkerMirroredStrategy (\"You must feed a value for placeholder tensor\").")


@patch.replaces(keras_tf_trainer.TensorFlowTrainer, "_make_function", ("self", "step_function"))
def _steps_traced_inline(original, self, step_function):
    step_function = _clocked(self, step_function, after_batch=not self.jit_compile)
    keras_function = original(self, step_function)
    steps = self.steps_per_execution
    if steps == 1:
        return keras_function
    if self.run_eagerly or self.jit_compile or _no_strategy(self):
        return _taking_partial_calls(keras_function)
    strategy = self.distribute_strategy

    def replicated_step(data):
        return strategy.run(step_function, args=(data,))

    if hasattr(self, "_autoconvert_optionals"):  # Keras >= 3.11 passes None inputs as empty Optionals
        replicated_step = self._autoconvert_optionals(replicated_step)

    # autograph=False: the loop is TensorFlow ops already, as Keras' functions are (do_not_convert); AutoGraph only
    # transpiled it (and, within, the clocked step and Keras' wrapper) at every first trace: ~0.4 s of a worker's CPU.
    @tf.function(reduce_retracing=True, autograph=False)
    def multi_step(iterator, steps_this_call):
        outputs = _steps_in_a_loop(replicated_step, iterator, steps_this_call)
        # Only the last step's logs are returned: reduce them once, not every step.
        return _map_optional(outputs, lambda logs: keras_tf_trainer.reduce_per_replica(logs, strategy, "auto"))

    def run(iterator, steps_this_call: int):
        outputs = multi_step(iterator, tf.constant(steps_this_call))
        if not outputs.has_value():
            raise StopIteration  # no batch was left for this call: Keras ends the epoch
        return outputs.get_value()

    def function(iterator):
        if isinstance(iterator, PartialExecution):
            return run(iterator.iterator, iterator.steps)
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            return run(iterator, steps)
        return keras_function(iterator)

    return function


def _steps_in_a_loop(replicated_step, iterator, steps) -> tf.experimental.Optional:
    """Up to ``steps`` steps on ``iterator``'s batches, fewer when the data ends: an Optional of the last step's
    outputs, empty when no batch was left. The loop's body is the step's one call site; the outputs' spec, unknown
    before the loop, is set when the body traces the step (as Keras' own loop does)."""
    last = tf.experimental.Optional.empty(None)

    def more(step, inputs, outputs):
        return tf.logical_and(step < steps, inputs.has_value())

    def body(step, inputs, outputs):
        outputs = tf.experimental.Optional.from_value(replicated_step(inputs.get_value()))
        last._element_spec = outputs.element_spec
        inputs = tf.cond(step + 1 < steps, iterator.get_next_as_optional, lambda: inputs)  # none past the call's
        return step + 1, inputs, outputs

    _, _, outputs = tf.while_loop(more, body, [tf.constant(0), iterator.get_next_as_optional(), last])
    outputs._element_spec = last.element_spec
    return outputs


def _map_optional(optional: tf.experimental.Optional, function) -> tf.experimental.Optional:
    """An Optional of ``function`` of ``optional``'s value, or an empty one."""
    mapped = tf.experimental.Optional.empty(None)

    def value():
        result = tf.experimental.Optional.from_value(function(optional.get_value()))
        mapped._element_spec = result.element_spec  # tf.cond traces this branch before the empty one
        return result

    return tf.cond(optional.has_value(), value, lambda: mapped)


def _no_strategy(model) -> bool:
    """Neither ``model`` nor the caller is under a tf.distribute strategy (Keras' default one)."""
    return not tf.distribute.has_strategy() and model.distribute_strategy is tf.distribute.get_strategy()


def _taking_partial_calls(keras_function):
    """Keras' function, given a ``PartialExecution`` whose data has ended as Keras' own iterator path is: it raises
    StopIteration (Keras ends the epoch), where Keras' per-batch path would fail with an unbound ``outputs``."""
    def function(iterator):
        if isinstance(iterator, PartialExecution):
            iterator = itertools.chain([next(iterator)], iterator)
        return keras_function(iterator)

    return function


def _clocked(model, step_function, after_batch: bool):
    """``step_function`` of ``model`` noting when its batch was ready (``tfdist.step_clock``: the step's start) where
    its step may write a row of step times (``_may_write_step_times``), and with ``after_batch`` every op of it
    after its batch.

    The optimizer's step counter does not depend on the data: without the control dependency, TensorFlow runs
    its increment in the call whose ``get_next`` finds the data's end (how Keras ends an epoch of unknown
    length), and each such epoch counts a step it never trained. Not under XLA (``jit_compile``): variables
    that the first step creates (a LossScaleOptimizer's) could not be lifted out of the compiled function.
    """
    def step(data):
        if _may_write_step_times(model, step_function):
            step_clock.step_starts(data)
        batch = [t for t in tf.nest.flatten(data, expand_composites=True) if isinstance(t, tf.Tensor)]
        try:
            with tf.control_dependencies(batch if after_batch else []):
                return step_function(data)
        finally:  # an evaluate or predict step all-reduces no gradients: its start must not reach the next step
            step_clock.step_ends()

    return step


def _may_write_step_times(model, step_function) -> bool:
    """Whether the step being traced may write a row of ``tfdist.step_clock`` (which takes its batch's time from
    ``step_starts``): under a strategy (tfdist's gradient all-reduce times it), with an optimizer that is not one of
    Keras' own classes (tfdist's, tfdist.horovod's: their reductions time it), or in a step of the model's own (a
    ``tfdist.horovod`` tape may time it). Keras' own step with Keras' optimizers and no strategy reduces nothing, so
    writes no row: there the clock read (a ``tf.cond`` per traced step, run at every step) would cost every plain
    Keras model its trace and its run for nothing."""
    if tf.distribute.has_strategy():
        return True
    own = getattr(step_function, "__func__", None)
    trainer = keras_tf_trainer.TensorFlowTrainer
    if own not in (trainer.train_step, trainer.test_step, trainer.predict_step):
        return True
    return not all(_keras_own(optimizer) for optimizer in _optimizers(model.optimizer))


def _keras_own(optimizer) -> bool:
    """Whether every class ``optimizer`` is made of is Keras' (or TensorFlow's): tfdist's optimizers are subclasses
    of the user's Keras class with a mixin of tfdist's, named and placed as that class (``tfdist.optimizer``)."""
    return all(cls.__module__.split(".")[0] in ("keras", "tensorflow", "builtins") for cls in type(optimizer).__mro__)


def _optimizers(optimizer) -> list:
    """``optimizer`` and every optimizer it applies through (a LossScaleOptimizer's inner one, a MultiOptimizer's)."""
    if optimizer is None:
        return []
    found = [optimizer]
    for inner in [getattr(optimizer, "inner_optimizer", None), *(getattr(optimizer, "optimizers", None) or [])]:
        found += _optimizers(inner)
    return found


# The last call of an epoch runs only the steps left ---------------------------------------------------

exact_steps_patch = Patch(
    "exact_steps_per_execution", "Keras 3.15: steps_per_execution trains past steps_per_epoch",
    without="with steps_per_execution=K, every epoch whose step count K does not divide trains (and predict "
            "returns) up to K-1 extra steps, and callbacks see batch numbers past the epoch's end.")


class PartialExecution:
    """The last call of an epoch: its iterator and how many steps are left (fewer than K).

    Iterating it yields at most ``steps`` batches, so Keras' per-batch paths (``predict``,
    eager or XLA functions) stop where the epoch does.
    """

    def __init__(self, iterator, steps: int):
        self.iterator, self.steps = iterator, steps

    def __iter__(self):
        return self

    def __next__(self):
        if self.steps <= 0:
            raise StopIteration
        self.steps -= 1
        return next(self.iterator)


@exact_steps_patch.replaces(EpochIterator, "_enumerate_iterator", ("self",))
def _last_call_runs_the_steps_left(original, self):
    for item in original(self):  # (begin, end, iterator) since Keras 3.11; (begin, iterator) before
        steps_in_epoch = self.steps_per_epoch or self._num_batches
        begin, iterator = item[0], item[-1]
        if not steps_in_epoch or begin + self.steps_per_execution <= steps_in_epoch:
            yield item
            continue
        left = steps_in_epoch - begin
        keras_stops_here = _data_ends_within(self, left)
        if hasattr(self, "_steps_seen"):  # Keras counted a whole call: count what will really run
            self._steps_seen -= self.steps_per_execution - left
        partial = PartialExecution(iterator, left)
        if len(item) == 2:
            yield begin, partial
        else:  # Keras' number where its call would stop at the data's end too; else the true last batch
            yield begin, item[1] if keras_stops_here else steps_in_epoch - 1, partial


def _data_ends_within(epoch_iterator, left: int) -> bool:
    """Whether the data of the call being handed out (Keras counted it whole in ``_steps_seen``) ends within
    ``left`` batches: then Keras' call stops there by itself and trains the steps asked for."""
    batches, seen = epoch_iterator._num_batches, getattr(epoch_iterator, "_steps_seen", None)
    return bool(batches) and seen is not None and batches - (seen - epoch_iterator.steps_per_execution) <= left


# steps_per_execution="auto" ------------------------------------------------------------------------

AUTO_STEPS = 16  # steps per call when tfdist picks: amortises per-call dispatch, callbacks still often called
_BATCH_HOOKS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")
# Keras callbacks that handle K steps per call themselves (they see every K-th batch and count right).
_HANDLE_K_STEPS = (callbacks_module.ProgbarLogger, callbacks_module.History, callbacks_module.ModelCheckpoint,
                   callbacks_module.BackupAndRestore, callbacks_module.TensorBoard, callbacks_module.CSVLogger,
                   callbacks_module.EarlyStopping, callbacks_module.ReduceLROnPlateau,
                   callbacks_module.TerminateOnNaN)

auto_patch = Patch(
    "auto_steps_per_execution", "tfdist: steps_per_execution='auto'",
    without="compile(steps_per_execution='auto') is refused, and models compiled under tfdist.scope() run "
            "one step per call.")


@auto_patch.replaces(trainer_module.Trainer, "compile", COMPILE_PARAMETERS)
def _compile_with_auto_steps(original, self, *args, **kwargs):
    """``steps_per_execution="auto"``, or none given under a strategy tfdist built: tfdist picks K in fit."""
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    requested = bound.arguments.get("steps_per_execution")
    if requested == "auto":
        bound.arguments["steps_per_execution"] = 1
    original(*bound.args, **bound.kwargs)
    self._tfdist_auto_steps = requested == "auto" or (requested is None and _under_tfdist_strategy())


@auto_patch.replaces(keras_tf_trainer.TensorFlowTrainer, "fit", FIT_PARAMETERS)
def _fit_with_auto_steps(original, self, *args, **kwargs):
    """K for this fit only (evaluate/predict outside fit keep Keras' one step per call); the smallest any
    worker picks, so that every worker's calls hold as many steps (collectives match)."""
    if not getattr(self, "_tfdist_auto_steps", False):
        return original(self, *args, **kwargs)
    arguments = inspect.signature(original).bind(self, *args, **kwargs).arguments
    steps = auto_steps(arguments.get("callbacks"),
                       *(arguments.get(name) for name in ("steps_per_epoch", "validation_steps")))
    if process_group.num_workers(self.distribute_strategy) > 1:  # a per-batch callback on one worker: K=1 for all
        group = process_group.for_strategy(self.distribute_strategy)
        steps = int(group.allreduce(tf.constant([steps], tf.int64), op="min", device="CPU").numpy()[0])
    if getattr(self, "_tfdist_traced_steps", 1) != steps:
        # Retrace for the new K (kept across fits with the same K). K=1 too: a function traced for K runs K
        # steps a call whatever steps_per_execution says, so a fit with a per-batch callback after one without
        # would train K times the steps asked for.
        self.train_function = None
    self._tfdist_traced_steps = steps
    if steps == 1:
        return original(self, *args, **kwargs)
    self.steps_per_execution = steps
    self.test_function = None  # validation runs at K too
    try:
        return original(self, *args, **kwargs)
    finally:
        self.steps_per_execution = 1
        self.test_function = None


def auto_steps(callbacks, *step_limits: int | None) -> int:
    """K for ``fit``: AUTO_STEPS, at most any given step count, or 1 when a callback needs every batch."""
    for callback in callbacks or ():
        if not isinstance(callback, _HANDLE_K_STEPS) and not all(
                python_utils.is_default(getattr(callback, hook)) for hook in _BATCH_HOOKS):
            return 1
    return min([AUTO_STEPS, *filter(None, step_limits)])


def _under_tfdist_strategy() -> bool:
    """Inside the scope of (or after ``init()`` with) a strategy tfdist built, not one it adopted."""
    built = state.built_by_tfdist()
    return built is not None and tf.distribute.get_strategy() is built
