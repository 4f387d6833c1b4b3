"""Every error and warning class of tfdist, in one place (standard library only).

Each is re-exported where users meet it (``tfdist.strategy.StrategyError``, ``tfdist.StrategyError``, ...).
Errors say the value received and the fix; each subclasses ``TfdistError`` and the built-in
class callers already catch (``ValueError`` for bad arguments).
"""


class TfdistError(Exception):
    """Base of every tfdist error.

    Each subclass takes its message as ``Exception`` does, so an error raised while
    TensorFlow traces a ``tf.function`` (a Keras train step) reaches the caller as itself,
    not as AutoGraph's ``StagingError`` (which it uses for other constructors).
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" not in cls.__dict__:
            cls.__init__ = Exception.__init__


class ClusterConfigError(ValueError, TfdistError):
    """The environment describes a cluster that tfdist cannot use."""


class TFConfigChangedError(ClusterConfigError):
    """A script under ``tfdist run`` set a TF_CONFIG of its own that differs from the launcher's."""


class StrategyError(ValueError, TfdistError):
    """A strategy, device spec or option that tfdist cannot build; the message says the fix."""


class DistributionError(ValueError, TfdistError):
    """A ``keras.distribution`` setting tfdist cannot run on TensorFlow (a sharded layout, a bad cluster)."""


class PrecisionError(ValueError, TfdistError):
    """A precision name or argument tfdist cannot use; the message says the fix."""


class PrecisionWarning(UserWarning):
    """A model whose outputs are half precision (softmax and losses want float32)."""


class CollectiveMismatchError(ValueError, TfdistError):
    """Ranks made different collective calls, or passed tensors of different shapes or dtypes."""


class DataError(ValueError, TfdistError):
    """Bad data or arguments for tfdist.data; the message names the value and the fix."""


class ConvertError(DataError):
    """A dataset that cannot be loaded; the message says what to try."""


class ShardingWarning(UserWarning):
    """Fewer files than input pipelines: each pipeline reads a run of records of one or two files."""


class BenchError(ValueError, TfdistError):
    """Bad benchmark settings; the message names the value and the fix."""


class LaunchError(TfdistError):
    """Bad launcher arguments: the message says what to change."""


class HostListError(ValueError, TfdistError):
    """A host list or hostfile tfdist cannot read; the message names the bad value and the fix."""


class MasterError(TfdistError):
    """Node 0 cannot coordinate the job; the message says what to change."""


class NodeError(TfdistError):
    """This node cannot take part in the job; the message says why and what to change."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class RayLaunchError(TfdistError):
    """Ray cannot run the job as asked; the message says what to change."""


class WireError(TfdistError):
    """The connection broke, or the other side sent something that is not this protocol."""


class MissingExtraError(ImportError, TfdistError):
    """An optional dependency cannot be imported; the message names the command that installs it."""


class KerasCompatibilityError(TfdistError):
    """This Keras lacks an internal that a tfdist class overrides, so that class cannot work."""


class ClusterWarning(UserWarning):
    """A strategy that ignores the cluster this process belongs to."""


class KerasCompatibilityWarning(UserWarning):
    """This Keras (or TensorFlow) lacks an internal a tfdist fix replaces; that fix is off. The message says what breaks."""


class StartupWarning(UserWarning):
    """A tfdist start-up hook could not do its work; the message says what will not work."""


class ShardingError(ValueError, TfdistError):
    """An optimizer or option whose state ``shard_optimizer_state=True`` cannot shard exactly; the message names it."""


class CheckpointError(TfdistError):
    """A checkpoint could not be saved, committed, restored or read; the message says which worker, file or
    variable."""


class CompressionError(ValueError, TfdistError):
    """A gradient compression asked for with a bad value (``Compression.powersgd``'s arguments,
    ``TFDIST_COMPRESSION``), or one that cannot work with another option; the message lists the valid ones."""
