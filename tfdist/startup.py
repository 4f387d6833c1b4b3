"""What a worker arms before the user's code runs. Standard library only; imports nothing of
tfdist's but its errors, so the hooks it runs are given to it.

``import tfdist`` arms it with tfdist's hooks (``tfdist/__init__.py``), and the
``sitecustomize`` that ``tfdist run`` puts first on every worker's PYTHONPATH imports tfdist,
so scripts that never import tfdist get the same. Arming imports nothing heavy; it watches
imports and runs each hook once its module has been imported:

* ``keras``: tfdist's Keras fixes (``tfdist.keras_fixes.apply_all``);
* ``tensorflow``: ``tfdist.runtime_hooks.install``, which builds the multi-worker strategy
  just before TensorFlow's runtime starts (so ``tfdist.scope()`` works after a tf.data
  pipeline was built) and makes a script's own ``tf.distribute.MultiWorkerMirroredStrategy()``
  the same object as tfdist's;
* ``ray.train``: ``tfdist.ray_fixes`` (only the chief's checkpoint reaches Ray);
* with ``aliases`` (``tfdist run --horovod``): extra module names that resolve to tfdist
  modules, e.g. ``horovod.tensorflow.keras`` -> ``tfdist.horovod``;
* with ``frozen`` (``tensorflow`` and ``keras``, unless ``TFDIST_GC_FREEZE=0``): while those
  imports run, Python's cyclic garbage collector pauses (if the importing thread is the process's
  only one), and once they have finished, one collection frees what died and every object alive
  is frozen out of later collections (``gc.freeze``). The import leaves about 300,000 objects that
  live as long as the process: the collector walked them again and again during the import, in
  every full collection after it (about 0.2 s each: a pause in some worker's step) and at exit
  (figures: benchmarks/RESULTS.md). The costs: a reference cycle among objects alive then that
  later becomes garbage is never collected, and ``gc.get_objects()`` and ``gc.get_referrers()``
  no longer see the frozen objects. A collector the program turned off stays off, and nothing is
  frozen then.

A hook whose module is imported while a tfdist module is still being imported (``import
tfdist.checkpoint`` imports TensorFlow, which imports Keras) waits until that tfdist import has
finished, so the hook never meets a half-imported tfdist module. A hook that fails warns and leaves
the import alone: the user's program keeps running.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.abc
import importlib.util
import os
import sys
import threading
import warnings
from typing import Callable, Iterable, Mapping

from tfdist.errors import StartupWarning

# `tfdist run --horovod`: Horovod's module names, each resolved to the tfdist module that stands in for it.
HOROVOD_ALIASES = {
    "horovod": "tfdist.horovod",
    "horovod.tensorflow": "tfdist.horovod",
    "horovod.tensorflow.keras": "tfdist.horovod",
    "horovod.keras": "tfdist.horovod",
    "horovod.tensorflow.keras.callbacks": "tfdist.horovod.callbacks",
    "horovod.keras.callbacks": "tfdist.horovod.callbacks",
    "horovod.tensorflow.elastic": "tfdist.horovod.elastic",
    "horovod.tensorflow.keras.elastic": "tfdist.horovod.elastic",
    "horovod.keras.elastic": "tfdist.horovod.elastic",
    "horovod.tensorflow.compression": "tfdist.compression",
}

# Where `import tfdist` ran ("train.py:12"), for error messages that name the line to move.
imported_at: str | None = None

_after_import: dict[str, list[Callable[[], None]]] = {}
_aliases: dict[str, str] = {}
_frozen: set[str] = set()  # modules imported with the collector paused, then frozen out of it
_heavy_imports = 0  # imports of ``frozen`` modules under way
_paused = False  # the collector is off for them
_busy: set[str] = set()
_tfdist_imports_running = 0
_waiting: list[tuple[str, Callable[[], None]]] = []  # hooks held until no tfdist module is being imported
_lock = threading.RLock()
_armed = False
_TFDIST_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARY_PARTS = ("importlib", f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def arm(hooks: Mapping[str, Callable[[], None]] | None = None, aliases: Mapping[str, str] | None = None,
        frozen: Iterable[str] = ()) -> None:
    """Installs the import watcher (idempotent) and ``hooks``: module name -> what to run once it is imported.

    ``aliases`` maps module names to the tfdist modules they stand for; ``frozen`` names modules
    imported with the cyclic garbage collector paused, their objects frozen out of it after.
    """
    global _armed
    with _lock:
        _aliases.update(aliases or {})
        _frozen.update(name for name in frozen if name not in sys.modules)
        if not _armed:
            _armed = True
            sys.meta_path.insert(0, _Finder())
        for name, hook in (hooks or {}).items():
            after_import(name, hook)


def gc_freeze_wanted(environ: Mapping[str, str]) -> bool:
    """``TFDIST_GC_FREEZE``: unset or 1 freezes TensorFlow's and Keras' import heap, 0 leaves the collector alone;
    any other value warns (naming it) and leaves the collector alone: an import must not fail."""
    raw = environ.get("TFDIST_GC_FREEZE", "").strip()
    if raw not in ("", "0", "1"):
        warnings.warn(f"TFDIST_GC_FREEZE={raw!r}: set it to 0 (leave Python's garbage collector alone) or 1 (the "
                      "default: freeze TensorFlow's and Keras' import-time objects out of it), or unset it; "
                      "left alone for now.", StartupWarning, stacklevel=3)
    return raw in ("", "1")


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Calls ``callback()`` once module ``name`` has been imported (now, if it already is)."""
    with _lock:
        if name in sys.modules:
            _call(name, callback)
        else:
            _after_import.setdefault(name, []).append(callback)


def record_import_site() -> None:
    """Remembers the first line outside importlib that is importing tfdist."""
    global imported_at
    if imported_at is None:
        imported_at = user_frame(sys._getframe(1))


def user_frame(frame) -> str:
    """'file.py:LINE' of the first frame, walking outwards, outside tfdist, installed packages and importlib."""
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(("<frozen", _TFDIST_DIR)) or any(part in name for part in _LIBRARY_PARTS)):
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "an unknown line"


def _call(name: str, callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception as err:  # a hook must never break the user's import
        warnings.warn(f"tfdist could not run its start-up hook for {name!r}: {type(err).__name__}: {err}",
                      StartupWarning, stacklevel=2)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of watched modules so their callbacks run after they execute; resolves aliases."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _aliases:
            return importlib.util.spec_from_loader(fullname, _AliasLoader(_aliases[fullname]))
        is_tfdist = fullname.startswith("tfdist.")
        if not (is_tfdist or fullname in _after_import or fullname in _frozen) or fullname in _busy:
            return None
        _busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            _busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = (_TfdistLoader if is_tfdist else _NotifyingLoader)(spec.loader, fullname)
        return spec


class _WrappingLoader(importlib.abc.Loader):
    def __init__(self, loader, name: str):
        self.loader, self.name = loader, name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__spec__.loader = module.__loader__ = self.loader  # leave no trace in the module
        self.loader.exec_module(module)

    def __getattr__(self, attribute):
        return getattr(self.loader, attribute)


@contextlib.contextmanager
def _collector_paused(name: str):
    """Imports of ``frozen`` modules (nested ones count once): the collector pauses while they run if the importing
    thread is the process's only one; then the garbage is collected and everything alive frozen out of it."""
    global _heavy_imports, _paused
    if name not in _frozen:
        yield
        return
    with _lock:
        _heavy_imports += 1
        # Another thread may turn the collector off or on meanwhile, or read it off: alone, none can.
        if _heavy_imports == 1 and gc.isenabled() and threading.active_count() == 1:
            _paused = True
            gc.disable()
    try:
        yield
    finally:
        with _lock:
            _heavy_imports -= 1
            last = _heavy_imports == 0
        if last:
            try:
                if _paused or gc.isenabled():  # a collector the program turned off: nothing frozen either
                    gc.collect()  # what died before and during the imports: frozen, it would never be freed
                    gc.freeze()
            finally:
                if _paused:
                    _paused = False
                    gc.enable()


def _collector_back_in_child() -> None:
    """A process forked by a paused import: the collector runs in the child (its import may never end there)."""
    global _paused
    if _paused:
        _paused = False
        gc.enable()


os.register_at_fork(after_in_child=_collector_back_in_child)


class _NotifyingLoader(_WrappingLoader):
    """Runs a watched module's hooks once it has executed (later, if a tfdist import is under way)."""

    def exec_module(self, module):
        with _collector_paused(self.name):
            super().exec_module(module)
        with _lock:
            callbacks = _after_import.pop(self.name, [])
            if _tfdist_imports_running:
                _waiting.extend((self.name, callback) for callback in callbacks)
                return
        for callback in callbacks:
            _call(self.name, callback)


class _TfdistLoader(_WrappingLoader):
    """Counts the tfdist imports under way; the last to finish runs the hooks that waited for it."""

    def exec_module(self, module):
        global _tfdist_imports_running
        with _lock:
            _tfdist_imports_running += 1
        try:
            super().exec_module(module)
        finally:
            with _lock:
                _tfdist_imports_running -= 1
                ready = [] if _tfdist_imports_running else _waiting[:]
                if ready:
                    _waiting.clear()
            for name, callback in ready:
                _call(name, callback)


class _AliasLoader(importlib.abc.Loader):
    """Makes ``import <alias>`` return the tfdist module it stands for."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass
