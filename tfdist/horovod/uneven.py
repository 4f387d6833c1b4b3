"""``hvd.join()``: ranks that ran out of data stand in for the others' gradient all-reduces with zeros.

Every gradient all-reduce of a ``DistributedOptimizer`` or ``DistributedGradientTape``
carries one extra float: 0 from a rank still training, 1 from a rank that joined; it rides
in the gradients' own fused collective, so it costs no extra round trip. A rank in
``join()`` repeats the all-reduces its optimizers made in their last step (same shapes,
same collective keys), contributing zeros, until that float says every rank has joined.
With a ``DistributedOptimizer`` the repeat is the optimizer's own ``apply`` of zero
gradients, so the joined rank also applies the others' average and every rank ends with
the same weights; after a ``DistributedGradientTape`` loop, ``join`` broadcasts the
variables the tapes differentiated from the rank it returns (the last to join has every
update): Horovod leaves them stale and its users broadcast by hand (PyTorch's ``Join``
syncs the model). A plain optimizer's slots (Adam's moments) stay each rank's own.
An average weighed by examples (``GradientReduction``: ``fit``, ``tfdist.compute_average_loss``)
divides by the examples of the ranks still training (a joined rank adds none); an unweighed one
by ``size()``, joined ranks included, as Horovod does: Horovod's ``EnqueueTensorAllreduces``
turns Average into ``postscale_factor /= size`` (horovod/common/operations.cc) and its
controller fills joined ranks' tensors with zeros.

Limits: a joined rank stands in for gradient all-reduces only (not for ``hvd.allreduce``
of metrics, broadcasts or a LossScaleOptimizer's finite check), and only after it made
at least one step itself (it learns the gradients' shapes there). Sparse gradients need
``sparse_as_dense=True``, as with Horovod's join.
"""

from __future__ import annotations

import zlib

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

JOINED, ACTIVE = 1.0, 0.0

# The latest GradientReduction of each name (``GradientReduction.name``) that reduced gradients in this
# process, in order of first use, and the step counter of each name. Strong references: a
# DistributedGradientTape's reduction lives on a tape that is gone after tracing, while the traced step
# goes on running its all-reduce. A tape made anew every step (eagerly) or every trace keeps its name,
# so join stands in once per step for it, not once per tape ever made.
_used: dict[tuple, object] = {}
_steps: dict[tuple, list] = {}  # name -> [step counter variable, its value at the last join]
# name -> {id: variable} of every tape of that name since the last join: tapes with equal gradient shapes (two
# towers of one shape, each with its tape) share a name, and join must make all their variables equal.
_variables: dict[tuple, dict] = {}


def record(reduction) -> None:
    """Notes that ``reduction`` reduces gradients every step (``join`` repeats its all-reduce)."""
    _used[reduction.name] = reduction
    _variables.setdefault(reduction.name, {}).update((id(v), v) for v in reduction.variables)


def count_step(reduction) -> None:
    """Counts the reduction's all-reduces at run time (inside a tf.function too), so ``join`` knows which ran."""
    if reduction.name not in _steps:
        with tf.init_scope():
            _steps[reduction.name] = [resource_variable_ops.ResourceVariable(
                0, dtype=tf.int64, trainable=False, name="tfdist_join_steps"), 0]
    _steps[reduction.name][0].assign_add(1)


def used_reductions() -> list:
    """The live reductions that ran since the last ``join``, in order of first use."""
    return [_used[name] for name, (steps, seen) in _steps.items() if int(steps.numpy()) > seen]


def join(group) -> int:
    """Stands in with zeros until every rank of ``group`` joined; returns the last rank to join (eager).

    Raises:
        ValueError: a reduction this rank would stand in for had sparse gradients or a
            LossScaleOptimizer's finite check (named in the message).
    """
    reductions = used_reductions()
    for reduction in reductions:
        reduction.check_joinable()
    rounds = 0
    if reductions and group.size > 1:
        while True:
            rounds += 1
            counts = [int(round(float(reduction.stand_in()))) for reduction in reductions]
            if counts[0] >= group.size:
                break
    for counter in _steps.values():
        counter[1] = int(counter[0].numpy())
    variables = _stale_variables(reductions)
    _variables.clear()
    signature = zlib.crc32(repr([(tuple(v.shape), tf.as_dtype(v.dtype).name) for v in variables]).encode())
    everyone = group.allgather(tf.constant([rounds, len(variables), signature], tf.int64)).numpy().reshape(-1, 3)
    if len({(n, s) for _, n, s in everyone}) > 1:
        raise ValueError(
            "hvd.join(): the ranks' DistributedGradientTape loops differentiated different variables "
            f"({', '.join(f'rank {group.ranks[i]}: {n}' for i, (_, n, _) in enumerate(everyone))} variables), so "
            "they cannot be made equal: give every rank at least one step of the same loop before join().")
    # The ranks that stood in for the fewest rounds joined last; among those, the highest (Horovod's order).
    rounds_of = everyone[:, 0]
    last = int(np.flatnonzero(rounds_of == rounds_of.min())[-1])
    if variables and group.size > 1:  # the last rank to join applied every update: its values, everywhere
        for variable, value in zip(variables, group.grouped_broadcast([tf.convert_to_tensor(v) for v in variables],
                                                                      last)):
            variable.assign(value)
    return int(group.ranks[last])


def _stale_variables(reductions: list) -> list:
    """Every variable a tape loop updated that a joined rank's stand-ins did not, once each, in a fixed order."""
    found = {}
    for reduction in reductions:
        if not reduction.applies_in_join():
            found.update(_variables.get(reduction.name, {}))
            if reduction.optimizer is not None:  # a DistributedOptimizer that accumulates: its stand-in only reduces
                found.update((id(v), v) for v in reduction.optimizer._trainable_variables)
    return list(found.values())
