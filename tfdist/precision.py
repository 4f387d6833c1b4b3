"""Mixed precision: Keras dtype policies and loss scaling, safe under tf.distribute.

The recipe (Micikevicius et al., ICLR 2018): compute in half precision, keep float32
master weights, scale the loss, unscale the gradients, skip steps whose gradients
overflow, and adapt the scale. Keras 3 has the parts (dtype policies,
``LossScaleOptimizer``); this module makes them one argument:

    with tfdist.scope(precision="mixed_float16"):
        model = build_model()                  # float32 variables, float16 compute
        model.compile(optimizer="adam", ...)   # Keras wraps it in a LossScaleOptimizer
    model.fit(...)                             # warns if the outputs are float16

For custom training loops, ``wrap_optimizer`` and ``make_train_step``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Sequence

import keras
import tensorflow as tf

from tfdist.errors import PrecisionError, PrecisionWarning

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16", "auto")
# Why "auto" picks each policy (printed by `tfdist doctor`).
AUTO_REASONS = {
    "mixed_bfloat16": "every GPU has compute capability >= 8.0 (bfloat16 tensor cores)",
    "mixed_float16": "the oldest GPU has compute capability 7.x (float16 tensor cores, no bfloat16 ones)",
    "float32": "no GPU with tensor cores (a CPU runs half precision slower than float32)",
}
HALF_DTYPES = ("float16", "bfloat16")
_check_outputs = False  # set once tfdist set a mixed policy: fit then checks outputs (keras_fixes.precision_check)
LossScaleOptimizer = keras.optimizers.LossScaleOptimizer


def auto_policy(compute_capabilities: Sequence[tuple[int, int]] | None = None) -> str:
    """The policy ``"auto"`` chooses for these GPUs (default: the visible ones).

    mixed_bfloat16 when every GPU has compute capability 8.0 or newer (bfloat16
    tensor cores arrived with Ampere), mixed_float16 on 7.x (float16 tensor cores
    since Volta; bfloat16 there is emulated and slow), float32 on older GPUs and
    on CPUs (CPUs run half precision slower than float32: they convert every
    value, with no tensor cores to win it back).

    Args:
        compute_capabilities: (major, minor) per GPU; None asks TensorFlow.

    Returns:
        "mixed_bfloat16", "mixed_float16" or "float32".
    """
    if compute_capabilities is None:
        compute_capabilities = [
            tf.config.experimental.get_device_details(gpu).get("compute_capability", (0, 0))
            for gpu in tf.config.list_physical_devices("GPU")
        ]
    if not compute_capabilities:
        return "float32"
    oldest = min(tuple(c) for c in compute_capabilities)
    if oldest >= (8, 0):
        return "mixed_bfloat16"
    if oldest >= (7, 0):
        return "mixed_float16"
    return "float32"


def check_name(name: str) -> str:
    """Returns ``name`` if it is one of POLICIES (without touching any device).

    Raises:
        PrecisionError: an unknown name; the message lists the valid ones.
    """
    if name not in POLICIES:
        raise PrecisionError(f"Unknown precision {name!r}; choose one of {list(POLICIES)}.")
    return name


def resolve_policy(name: str) -> str:
    """Checks a precision name and turns "auto" into a concrete policy name."""
    return auto_policy() if check_name(name) == "auto" else name


def set_policy(name: str) -> str:
    """Sets Keras' global dtype policy; layers built afterwards use it.

    Args:
        name: "float32", "mixed_float16", "mixed_bfloat16" or "auto" (see ``auto_policy``).

    Returns:
        The policy set ("auto" resolved).

    Raises:
        PrecisionError: unknown name.
    """
    global _check_outputs
    resolved = resolve_policy(name)
    _check_outputs = _check_outputs or resolved != "float32"
    keras.config.set_dtype_policy(resolved)
    return resolved


@contextlib.contextmanager
def policy_scope(name: str | None) -> Iterator[str]:
    """Sets the policy for the block and restores the previous one after; None changes nothing."""
    previous = keras.config.dtype_policy()
    if name is None:
        yield previous.name
        return
    try:
        yield set_policy(name)
    finally:
        keras.config.set_dtype_policy(previous)


def wrap_optimizer(optimizer: keras.optimizers.Optimizer, initial_scale: float = 2.0**15,
                   dynamic_growth_steps: int = 2000, *, loss_scale: bool | None = None) -> keras.optimizers.Optimizer:
    """Wraps an optimizer in Keras' LossScaleOptimizer when the policy computes in float16.

    Any Keras optimizer works, a ``tfdist.DistributedOptimizer`` included. An optimizer
    that already is (or wraps) a LossScaleOptimizer is returned as it is, so wrapping
    twice does not nest. ``model.compile`` does the same wrapping by itself under
    mixed_float16; this is for custom training loops.

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` instance.
        initial_scale: the first loss scale; overflowing steps halve it.
        dynamic_growth_steps: after this many finite steps in a row the scale doubles.
        loss_scale: None wraps under float16 compute only; True always wraps (under
            bfloat16 this adds skip-on-overflow, bfloat16 needs no scaling); False never.

    Returns:
        The LossScaleOptimizer, or ``optimizer`` itself.

    Raises:
        PrecisionError: not a Keras optimizer, or a bad scale or step count.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise PrecisionError(f"wrap_optimizer needs a keras.optimizers.Optimizer instance; received "
                             f"{type(optimizer).__name__}. Pass e.g. keras.optimizers.Adam().")
    if not initial_scale > 0:
        raise PrecisionError(f"initial_scale must be positive: received {initial_scale!r}; 2**15 is usual.")
    if isinstance(dynamic_growth_steps, bool) or not isinstance(dynamic_growth_steps, int) or dynamic_growth_steps < 1:
        raise PrecisionError(f"dynamic_growth_steps must be a positive int: received {dynamic_growth_steps!r}.")
    if loss_scale is None:
        loss_scale = keras.config.dtype_policy().compute_dtype == "float16"
    if not loss_scale or _find_loss_scale_optimizer(optimizer) is not None:
        return optimizer
    return LossScaleOptimizer(optimizer, initial_scale=float(initial_scale),
                              dynamic_growth_steps=dynamic_growth_steps)


def _find_loss_scale_optimizer(optimizer: Any) -> LossScaleOptimizer | None:
    """The LossScaleOptimizer in a chain of wrappers (``inner_optimizer``), or None."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        if isinstance(optimizer, LossScaleOptimizer):
            return optimizer
        seen.add(id(optimizer))
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


def current_loss_scale(optimizer: keras.optimizers.Optimizer) -> float | None:
    """The current loss scale of a (wrapped) LossScaleOptimizer, or None when it has none."""
    found = _find_loss_scale_optimizer(optimizer)
    if found is None:
        return None
    if not found.built:
        return float(found.initial_scale)
    return float(found.dynamic_scale.numpy())


def check_model(model: keras.Model) -> list[str]:
    """Warns about each model output computed in float16 or bfloat16, naming its layer.

    Half-precision softmax outputs and losses lose accuracy or overflow: the last
    layer should compute in float32.

    Args:
        model: a Keras model (functional and sequential models are checked output by
            output; for subclassed models, the last layer).

    Returns:
        The names of the layers that produce half-precision outputs.
    """
    bad = [(layer, dtype) for layer, dtype in _output_layers(model) if dtype in HALF_DTYPES]
    for layer, dtype in bad:
        warnings.warn(
            f"Model {model.name!r}: output layer {layer.name!r} computes in {dtype}; softmax and "
            "losses should run in float32. Pass dtype='float32' to that layer, or end the model "
            "with keras.layers.Activation('linear', dtype='float32').",
            PrecisionWarning, stacklevel=2)
    return [layer.name for layer, _ in bad]


def _output_layers(model: keras.Model) -> list[tuple[Any, str]]:
    """(layer, output dtype) for each model output; the last layer when outputs are unknown."""
    try:
        tensors = keras.tree.flatten(model.outputs)
    except (AttributeError, ValueError):  # subclassed, or sequential not built yet
        tensors = []
    found = [(t._keras_history.operation, keras.backend.standardize_dtype(t.dtype))
             for t in tensors if getattr(t, "_keras_history", None)]
    if not found and model.layers:
        found = [(model.layers[-1], model.layers[-1].compute_dtype)]
    return found


def checks_outputs() -> bool:
    """Whether ``fit`` adds a ``PrecisionCheck`` to half-precision models (after tfdist set a mixed policy)."""
    return _check_outputs


class PrecisionCheck(keras.callbacks.Callback):
    """Runs ``check_model`` when ``fit`` starts (after Keras built the model).

    ``tfdist`` adds it by itself to the ``fit`` of every model that computes in half
    precision, once a mixed policy was set through tfdist. Any order, any rank.
    """

    def on_train_begin(self, logs=None):
        check_model(self.model)


def make_train_step(model: keras.Model, loss_fn: Callable, optimizer: keras.optimizers.Optimizer,
                    strategy: tf.distribute.Strategy | None = None) -> Callable:
    """One custom-loop training step under ``strategy.run``, with loss scaling when wrapped.

    Each replica computes its loss (the mean over its examples, divided by the
    number of replicas, as Keras' own ``fit`` does), multiplies it by the loss scale
    (``optimizer.scale_loss``; a plain optimizer leaves it unchanged), and
    ``optimizer.apply`` unscales the gradients, skips the step when any replica's
    gradients overflow (tfdist's fix) and adapts the scale. Works in float32,
    float16 and bfloat16.

    Args:
        model: the model, built (its variables exist) under ``strategy``.
        loss_fn: ``loss_fn(y_true, y_pred) -> scalar`` mean loss, e.g. a keras.losses object.
        optimizer: from ``wrap_optimizer`` (required when the model computes in float16).
        strategy: defaults to the current one.

    Returns:
        A tf.function ``step((x, y)) -> loss`` (float32, averaged over replicas) taking
        a batch from ``strategy.experimental_distribute_dataset`` or a plain one.

    Raises:
        PrecisionError: a float16 model with an optimizer that does no loss scaling.
    """
    if model.compute_dtype == "float16" and _find_loss_scale_optimizer(optimizer) is None:
        raise PrecisionError(f"Model {model.name!r} computes in float16, but {type(optimizer).__name__} does "
                             "no loss scaling: pass tfdist.precision.wrap_optimizer(optimizer).")
    strategy = strategy or tf.distribute.get_strategy()
    if not optimizer.built:  # variables must exist before tracing (tf.function cannot create them)
        with strategy.scope():
            optimizer.build(model.trainable_variables)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.cast(loss_fn(y, model(x, training=True)), tf.float32)
            scaled = optimizer.scale_loss(loss / strategy.num_replicas_in_sync)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    @tf.function
    def step(batch):
        losses = strategy.run(replica_step, args=tuple(batch))
        return strategy.reduce(tf.distribute.ReduceOp.MEAN, losses, axis=None)

    return step
