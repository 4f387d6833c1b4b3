"""``fit`` under a multi-worker strategy tunes the gradient buckets in its first steps (``tfdist.autotune``).

Keras builds one train function per ``fit`` (``make_train_function``) and calls
``model.train_function`` once per call of K steps. Here, while no setting is chosen for
this model's gradients on these workers, that attribute is an ``autotune.Tuner``: each
candidate setting gets its own train function (each traced once), the tuner times them in
turn, and once it settles ``model.train_function`` is the chosen function itself. Not for
a sharded optimizer whose step sums shard rows of the gradients in no bucket (``sharded_state.sums_shard_rows``), nor
custom training loops (their ``tf.function`` is yours, traced once) nor ``tfdist.horovod``:
they keep the default buckets, or the setting autotune chose earlier in the process.
"""

from __future__ import annotations

import math
import sys

import tensorflow as tf
from keras.src.backend.tensorflow import trainer as keras_tf_trainer

from tfdist import autotune, buckets, process_group
from tfdist.keras_fixes import sharded_state, steps_per_execution
from tfdist.patching import Patch

patch = Patch(
    "autotune", "tfdist issue 34: no fixed gradient bucket setting is best on every link",
    without="fit keeps the default gradient buckets on every link (no autotuning).")


@patch.replaces(keras_tf_trainer.TensorFlowTrainer, "make_train_function", ("self", "force"))
def _tuned_train_function(original, self, force=False):
    """Keras' train function, or a tuner over the candidate settings while none is chosen."""
    if self.train_function is not None and not force:
        return self.train_function
    result = original(self, force=True)
    strategy = self.distribute_strategy
    if self.run_eagerly or not process_group.is_multi_worker(strategy):
        return result
    if sharded_state.sums_shard_rows(self.optimizer):
        # Its step sums shard rows, in no bucket: every candidate would be the same function, timed for nothing,
        # and its "choice" recorded under a key an unsharded run of this model would apply.
        return result
    group = process_group.for_strategy(strategy)
    if not _the_chief_tunes(group):
        return result
    chief = group.rank == 0
    sizes, kinds = _gradients(self)
    key = autotune.key(_hosts(strategy), sizes, kinds)
    choice = autotune.chosen(key)
    if choice is None:
        recorded = _recorded(group, key)
        if recorded is not None:
            autotune.apply(autotune.Choice(recorded, {}, 0, key), chief, record=False)
            return result
        settings = autotune.candidates(sizes, kinds)
        if len(settings) > 1:
            self.train_function = _tuner(self, original, settings, group, key)
            return result
        choice = autotune.Choice(settings[0], {}, 0, key)
    buckets.use_tuned(choice.setting.bucket_bytes, choice.setting.first_bucket_bytes)
    return result


def _tuner(model, make_train_function, settings, group, key) -> autotune.Tuner:
    def make():
        tuner = model.train_function
        make_train_function(model, force=True)
        function, model.train_function = model.train_function, tuner
        return function

    def steps_of(iterator, *args, **kwargs):
        """K for a whole call, the steps left for the last call of an epoch; None for any other call."""
        if isinstance(iterator, steps_per_execution.PartialExecution):
            return iterator.steps
        full = isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator))
        return model.steps_per_execution if full else None

    def agree(step_ms):
        with tf.init_scope():
            return group.broadcast(tf.constant(step_ms, tf.float64), 0, device="CPU").numpy().tolist()

    def settle(setting, step_ms, steps, function):
        autotune.apply(autotune.Choice(setting, step_ms, steps, key), group.rank == 0, record=True)
        if isinstance(model.train_function, autotune.Tuner):
            model.train_function = function  # from now on Keras calls it directly

    return autotune.Tuner(settings, make, steps_of, agree, settle)


def _the_chief_tunes(group) -> bool:
    """Whether worker 0 tunes (autotune on, no bucket size set there); every worker follows it (one broadcast).

    A worker whose own setting differs (``TFDIST_AUTOTUNE`` set on one host only) would otherwise tune alone
    and wait forever in a broadcast the others never join; it says so once and does as worker 0 does.
    """
    mine = int(autotune.enabled() and not buckets.explicit())
    with tf.init_scope():
        chiefs = int(group.broadcast(tf.constant([mine], tf.int64), 0, device="CPU").numpy()[0])
    if chiefs != mine:
        print(f"tfdist autotune: worker {group.rank} would {'tune' if mine else 'not tune'} the gradient buckets "
              f"but worker 0 {'tunes' if chiefs else 'does not'} ({autotune.ENV}, TFDIST_BUCKET_BYTES or "
              f"set_bucket_bytes differ between workers): following worker 0; set them alike on every worker.",
              file=sys.stderr, flush=True)
    return bool(chiefs)


def _recorded(group, key: str) -> autotune.Setting | None:
    """The chief's recorded setting for ``key``, on every worker (one broadcast)."""
    setting = autotune.recorded(key) if group.rank == 0 else None
    values = [1, setting.bucket_bytes, setting.first_bucket_bytes] if setting else [0, 0, 0]
    with tf.init_scope():
        found, bucket_bytes, first = group.broadcast(tf.constant(values, tf.int64), 0, device="CPU").numpy().tolist()
    return autotune.Setting(bucket_bytes, first) if found else None


def _gradients(model) -> tuple[list[int], list[tf.DType]]:
    """Bytes and wire dtype of each trainable variable's gradient, as the buckets will see them."""
    optimizer = model.optimizer
    compression = getattr(getattr(optimizer, "inner_optimizer", optimizer), "compression", None)
    sizes, kinds = [], []
    for variable in model.trainable_variables:
        dtype = tf.as_dtype(variable.dtype)
        if compression is not None:
            dtype = compression.compress(tf.zeros([], dtype))[0].dtype
        sizes.append(math.prod(variable.shape) * dtype.size)
        kinds.append(dtype)
    return sizes, kinds


def _hosts(strategy) -> list[str]:
    """The workers' hosts in rank order (ports change from run to run)."""
    spec = strategy.cluster_resolver.cluster_spec().as_dict()
    return [address.rsplit(":", 1)[0] for job in ("chief", "worker") for address in spec.get(job, [])]
