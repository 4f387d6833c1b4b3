"""Gradient compression for collectives: what travels on the wire, and back.

Horovod's shape, so ``hvd.Compression.fp16`` is this module's ``Compression.fp16``::

    compressed, context = Compression.fp16.compress(tensor)   # float32 -> float16
    ...all-reduce ``compressed``...
    restored = Compression.fp16.decompress(reduced, context)  # float16 -> float32

``compress`` returns the tensor to send and a context ``decompress`` needs to restore the
original dtype. Only floating-point tensors are compressed; integers pass unchanged.
Compression halves the bytes a float32 all-reduce moves, at float16's precision (about 3
decimal digits) and range (values beyond 65504 overflow to inf): scale the loss or use
``prescale_factor`` when gradients can be that large.

``Compression.powersgd(rank=4)`` (Vogels, Karimireddy and Jaggi, NeurIPS 2019; PyTorch's
``powerSGD_hook``) is not element-wise: each gradient matrix travels as two thin factors
(``PowerSGD.reduce``), with error feedback and a warm-started basis kept as optimizer state by
the optimizer that applies it (``tfdist.DistributedOptimizer``, ``hvd.DistributedOptimizer``).
Its ``compress``/``decompress`` are the identity: vectors and small tensors travel exact.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Mapping, Sequence

import tensorflow as tf

from tfdist.cluster import ENV_COMPRESSION
from tfdist.errors import CompressionError


class Compressor:
    """Compresses a tensor before a collective and restores it after (the identity here)."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        """Returns the tensor to send and the context ``decompress`` needs."""
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, context: Any) -> tf.Tensor:
        """Returns ``tensor`` as it was before ``compress``."""
        return tensor


class NoneCompressor(Compressor):
    """No compression: tensors travel in their own dtype."""


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 and come back in their own dtype."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        dtype = tensor.dtype
        if dtype.is_floating and dtype != tf.float16:
            return tf.cast(tensor, tf.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: tf.Tensor, context: Any) -> tf.Tensor:
        if context is not None and tensor.dtype != context:
            return tf.cast(tensor, context)
        return tensor


class PowerSGD(Compressor):
    """Low-rank gradient compression with error feedback (PowerSGD); make it with ``Compression.powersgd``.

    Each floating-point gradient whose weight has 2 or more dimensions is seen as a matrix
    ``[n, m]`` (all dimensions but the last, by the last: a conv kernel ``[kh, kw, in, out]`` is
    ``[kh*kw*in, out]``) and compressed when ``rank * (n + m) * min_compression_rate < n * m``.
    Per step and matrix, on every replica (``reduce``)::

        M = g + e                 # e: this replica's error feedback, zeros at first
        P = allreduce(M @ Q)      # Q: [m, r], kept from the last step (warm start), random at first
        P = orthonormal(P)        # tf.linalg.qr, on every replica from the same P
        Q = allreduce(M^T @ P)
        approx = P @ Q^T          # the same on every replica: the gradient applied
        e = M - approx * share    # share: this replica's part of the reduced value (1/N for a sum)

    r * (n + m) numbers travel instead of n * m. Vectors, scalars, integer, float16 and bfloat16
    gradients, and matrices too small to gain, travel exact; a sparse gradient (an ``Embedding``'s
    ``tf.IndexedSlices``) is made dense and compressed. One replica runs it too (the
    all-reduces are the identity), so a result does not depend on the replica count. For the
    first ``start_step`` optimizer steps every gradient travels exact (PyTorch's
    ``start_powerSGD_iter``) and the error feedback stays zero. Config only: the state (``e``
    per replica, ``Q``) belongs to the optimizer that applies the gradients, so one
    ``PowerSGD`` may serve several optimizers.

    Args:
        rank: r, the columns of each factor: an int >= 1 (capped at min(n, m) per matrix).
        start_step: optimizer steps with exact all-reduce before compression starts: an int >= 0.
        min_compression_rate: compress a matrix only when it sends this many times fewer
            numbers: a number >= 0 (0 compresses every matrix; PyTorch's default is 2).
        seed: the seed of the first Q (the same on every replica and worker).

    Raises:
        CompressionError: a bad argument (the message names it and the valid values).
    """

    def __init__(self, rank: int = 4, start_step: int = 1000, min_compression_rate: float = 2.0, seed: int = 0):
        if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1):
            raise CompressionError(f"Compression.powersgd needs rank to be an int >= 1 (e.g. 4); received "
                                   f"rank={rank!r}.")
        if not (isinstance(start_step, int) and not isinstance(start_step, bool) and start_step >= 0):
            raise CompressionError(f"Compression.powersgd needs start_step to be an int >= 0 (the exact steps before "
                                   f"compression starts; 0: from the first step); received start_step={start_step!r}.")
        if not (isinstance(min_compression_rate, (int, float)) and not isinstance(min_compression_rate, bool)
                and math.isfinite(min_compression_rate) and min_compression_rate >= 0):
            raise CompressionError(f"Compression.powersgd needs min_compression_rate to be a number >= 0 (2: compress "
                                   f"a matrix when it sends half the numbers or fewer; 0: every matrix); received "
                                   f"min_compression_rate={min_compression_rate!r}.")
        if not (isinstance(seed, int) and not isinstance(seed, bool)):
            raise CompressionError(f"Compression.powersgd needs seed to be an int; received seed={seed!r}.")
        self.rank, self.start_step, self.min_compression_rate, self.seed = (
            rank, start_step, float(min_compression_rate), seed)

    def __repr__(self) -> str:
        return (f"Compression.powersgd(rank={self.rank}, start_step={self.start_step}, "
                f"min_compression_rate={self.min_compression_rate:g})")

    def __eq__(self, other) -> bool:
        return isinstance(other, PowerSGD) and repr(self) == repr(other) and self.seed == other.seed

    def __hash__(self) -> int:
        return hash((repr(self), self.seed))

    def matrix_shape(self, shape, dtype) -> tuple[int, int] | None:
        """``(n, m)`` when a weight of this static ``shape`` and ``dtype`` has its gradient compressed, else None."""
        shape = tf.TensorShape(shape)
        if shape.rank is None or shape.rank < 2 or not shape.is_fully_defined() or not (
                tf.as_dtype(dtype) in (tf.float32, tf.float64)):
            return None
        n, m = shape.num_elements() // shape[-1], shape[-1]
        if n == 0 or m == 0:
            return None
        rank = min(self.rank, n, m)
        return (n, m) if rank * (n + m) * self.min_compression_rate < n * m else None

    def first_q(self, shape, dtype, index: int) -> tf.Tensor:
        """The first Q of the ``index``-th compressed weight: ``[m, r]``, the same on every replica and worker."""
        shape = tf.TensorShape(shape)
        n, m = shape.num_elements() // shape[-1], shape[-1]
        return tf.random.stateless_normal([m, min(self.rank, n, m)], seed=[self.seed, index], dtype=dtype)

    def reduce(self, gradients: Sequence[tf.Tensor], errors: Sequence[tf.Tensor], qs: Sequence[tf.Tensor],
               step: tf.Tensor, allreduce: Callable[[list], list], share: float,
               others_finite: tf.Tensor | None = None) -> tuple[list, list, list]:
        """The reduced gradients of compressible weights, with their new error feedback and Q.

        ``reduce_with`` with nothing else riding in P's collective: see there.
        """
        reduced, errors, qs, _ = self.reduce_with(gradients, errors, qs, step, allreduce, share,
                                                  others_finite=others_finite)
        return reduced, errors, qs

    def reduce_with(self, gradients: Sequence[tf.Tensor], errors: Sequence[tf.Tensor], qs: Sequence[tf.Tensor],
                    step: tf.Tensor, allreduce: Callable[[list], list], share: float, exact: Sequence = (),
                    count: tf.Tensor | None = None,
                    others_finite: tf.Tensor | None = None) -> tuple[list, list, list, list]:
        """The reduced gradients of compressible weights, their new error feedback and Q, and ``exact`` reduced.

        One implementation for every front: ``allreduce`` sums or averages a list of tensors over
        the replicas (the caller's collective: a replica context's, a process group's), and
        ``share`` is this replica's part of its result (1/N for a sum, 1 for a mean). Every
        gradient in ``gradients`` has a ``matrix_shape``; ``errors`` are this replica's error
        feedback (the weights' shapes), ``qs`` the Qs. For ``step < start_step`` the gradients
        are all-reduced exact and the state comes back unchanged.

        Two collectives a step, each one ``allreduce`` call: every P, with ``exact`` (the
        gradients that travel exact: vectors, small tensors; they do not depend on P) riding
        along; then every Q. ``count``: every gradient given (compressed and exact) is this
        replica's sum over its examples, to be divided by the replicas' counts added up
        (``C``; ``tfdist.keras_fixes.batch_shares``' weighting): the count rides in P's
        collective too, and, as ``M = g / C + e`` needs ``C`` first, each matrix's ``g Q`` and
        ``e Q`` travel apart in it (``sum(M Q) = sum(g Q) / C + sum(e Q)``: P's numbers twice).
        A P of ``g + K e`` with a ``K`` known before (the replica's examples times N) would
        send them once, but mixes the replicas' errors into P's basis when a batch splits
        unevenly (``sum(K_i e_i)`` is not ``C sum(e_i)``; full rank then no longer spans the
        update). During the warm-up all of it travels in one call. A non-finite P or Q (an
        overflow on any replica: the same on all), a non-finite reduced ``exact`` tensor, or
        ``others_finite`` False (gradients the caller reduced apart are not all finite) keeps the
        old state: a step loss scaling skips leaves it as it was.
        """
        gradients, errors, qs, exact = list(gradients), list(errors), list(qs), list(exact)
        if not gradients and not exact:
            return [], [], [], []
        riders = exact + ([tf.cast(count, _float_of(gradients + exact))] if count is not None else [])

        def divided(tensors, total):
            return [tf.math.divide_no_nan(t, tf.cast(total, t.dtype)) if t.dtype.is_floating else t for t in tensors]

        def exact_step():
            reduced = list(allreduce(riders + gradients))
            sums, rest = reduced[len(riders):], reduced[:len(exact)]
            if count is not None:
                total = reduced[len(exact)]
                sums, rest = divided(sums, total), divided(rest, total)
            return sums, errors, qs, rest

        def compressed():
            shapes = [g.shape for g in gradients]
            flat = [tf.reshape(g, [-1, q.shape[0]]) for g, q in zip(gradients, qs)]
            flat_errors = [tf.reshape(e, [-1, q.shape[0]]) for e, q in zip(errors, qs)]
            if count is None:
                matrices = [g + e for g, e in zip(flat, flat_errors)]
                reduced = list(allreduce(riders + [tf.matmul(mat, q) for mat, q in zip(matrices, qs)]))
                ps, rest = reduced[len(riders):], reduced[:len(exact)]
            else:  # M = g / C + e, C not known before P's collective: sum(M Q) = sum(g Q) / C + sum(e Q)
                k = len(gradients)
                reduced = list(allreduce(riders + [tf.matmul(g, q) for g, q in zip(flat, qs)]
                                         + [tf.matmul(e, q) for e, q in zip(flat_errors, qs)]))
                total, sums = reduced[len(exact)], reduced[len(riders):]
                ps = [gq + eq for gq, eq in zip(divided(sums[:k], total), sums[k:])]
                rest = divided(reduced[:len(exact)], total)
                matrices = [g + e for g, e in zip(divided(flat, total), flat_errors)]
            ps = [tf.linalg.qr(p)[0] for p in ps]
            new_qs = list(allreduce([tf.matmul(mat, p, transpose_a=True) for mat, p in zip(matrices, ps)]))
            finite = all_finite(ps + new_qs + rest)
            if others_finite is not None:
                finite = tf.logical_and(finite, others_finite)
            approx = [tf.matmul(p, q, transpose_b=True) for p, q in zip(ps, new_qs)]
            new_errors = [tf.where(finite, tf.reshape(mat - a * tf.cast(share, a.dtype), e.shape), e)
                          for mat, a, e in zip(matrices, approx, errors)]
            kept = [tf.where(finite, new, old) for new, old in zip(new_qs, qs)]
            return [tf.reshape(a, shape) for a, shape in zip(approx, shapes)], new_errors, kept, rest

        if not gradients:
            return exact_step()
        if self.start_step == 0:
            return compressed()
        return tf.cond(tf.cast(step, tf.int64) < self.start_step, exact_step, compressed)


def _float_of(tensors: Sequence) -> tf.DType:
    """The dtype a count riding with ``tensors`` takes: the first float32 or float64 one's (no collective more)."""
    return next((t.dtype for t in tensors if t.dtype in (tf.float32, tf.float64)), tf.float32)


def all_finite(tensors: Sequence) -> tf.Tensor:
    """Whether every floating-point tensor (or ``tf.IndexedSlices``) in ``tensors`` is finite: a bool tensor."""
    checks = [tf.reduce_all(tf.math.is_finite(getattr(t, "values", t))) for t in tensors if t.dtype.is_floating]
    return tf.reduce_all(checks) if checks else tf.constant(True)


class Compression:
    """The compression choices: Horovod's ``Compression.none`` and ``Compression.fp16``, and ``Compression.powersgd``."""

    none = NoneCompressor
    fp16 = FP16Compressor

    @staticmethod
    def powersgd(rank: int = 4, start_step: int = 1000, min_compression_rate: float = 2.0,
                 seed: int = 0) -> PowerSGD:
        """Low-rank compression of gradient matrices with error feedback; see ``PowerSGD``."""
        return PowerSGD(rank, start_step, min_compression_rate, seed)


def is_powersgd(compression: Any) -> bool:
    """Whether ``compression`` is a ``PowerSGD`` (whose state an optimizer keeps)."""
    return isinstance(compression, PowerSGD)


def from_env(environ: Mapping[str, str] | None = None) -> type[Compressor] | PowerSGD | None:
    """The compression ``TFDIST_COMPRESSION`` names, or None when it is unset or empty.

    Values: ``none``, ``fp16``, ``powersgd`` (rank 4), ``powersgd:RANK`` or
    ``powersgd:RANK:START_STEP`` (default start step 1000, as ``Compression.powersgd``).

    Raises:
        CompressionError: any other value (the message lists the valid ones).
    """
    raw = (os.environ if environ is None else environ).get(ENV_COMPRESSION, "").strip()
    if not raw:
        return None
    name, _, arguments = raw.lower().partition(":")
    if name in ("none", "fp16") and not arguments:
        return Compression.none if name == "none" else Compression.fp16
    if name == "powersgd":
        parts = arguments.split(":") if arguments else []
        if len(parts) <= 2 and all(p.isdigit() for p in parts):
            try:
                return Compression.powersgd(*(int(p) for p in parts))
            except CompressionError as error:
                raise CompressionError(f"{ENV_COMPRESSION}={raw!r}: {error}") from None
    raise CompressionError(f"{ENV_COMPRESSION}={raw!r} is not a compression tfdist knows; valid values: none, fp16, "
                           "powersgd, powersgd:RANK, powersgd:RANK:START_STEP (e.g. powersgd:4 or powersgd:4:100), "
                           "or unset it.")


def check(compression: Any) -> type[Compressor] | Compressor:
    """Returns ``compression`` if it has ``compress`` and ``decompress``.

    Raises:
        TypeError: it does not (the message lists the choices).
    """
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"compression must be Compression.none, Compression.fp16 or an object with compress(tensor) "
                        f"and decompress(tensor, context) (or Compression.powersgd(rank=...)); received "
                        f"{compression!r}.")
    return compression
