"""How tfdist patches Keras (and TensorFlow): check the internal first, replace it, keep the original.

A ``Patch`` groups the replacements of one fix (methods, functions or properties: a
property's getter is what gets replaced), the attributes it adds (``adds``: the library
must not have them), and the private methods a tfdist subclass overrides (``overrides``:
checked, not replaced; the subclass asks ``apply()`` before it relies on them).
``apply()`` first checks every internal it replaces (present, with the parameters tfdist
was written against); if one is missing or changed, it applies none of them and warns once,
naming the library and its version, the internal, and what will not work without the fix. Each replacement receives the original as its
first argument; ``original_of(patched)`` returns it (tests use it to show the bug).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import warnings
from typing import Any, Callable

from tfdist.errors import KerasCompatibilityWarning

# The releases tfdist's fixes were checked against, as (oldest, newest) (major, minor) (see README, "Versions").
TESTED_RANGES = {"keras": ((3, 10), (3, 15)), "tensorflow": ((2, 21), (2, 21)), "ray": ((2, 60), (2, 60))}


def tested_range(library: str) -> str:
    """'3.10 to 3.15' (or '2.21'): the tested releases of ``library``, for messages."""
    oldest, newest = (".".join(map(str, version)) for version in TESTED_RANGES[library])
    return oldest if oldest == newest else f"{oldest} to {newest}"


def is_tested(library: str, version: str) -> bool:
    """Whether ``version`` (e.g. '3.15.1') is inside the tested range of ``library``."""
    major_minor = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    oldest, newest = TESTED_RANGES[library]
    return oldest <= major_minor <= newest


TESTED_KERAS = tested_range("keras")
TESTED_TENSORFLOW = tested_range("tensorflow")
TESTED_RAY = tested_range("ray")


@dataclasses.dataclass
class _Replacement:
    owner: Any
    attribute: str
    parameters: tuple[str, ...] | None  # None: the attribute must not exist yet (``adds``)
    function: Callable | None           # None: only checked, a subclass of tfdist's overrides it (``overrides``)
    value: Any = None                   # what ``adds`` sets
    calls: int = 0                      # times the replacement ran (canary tests read it)


@dataclasses.dataclass
class Patch:
    """One fix: its name, the upstream issue, and what breaks without it; ``library`` is what it patches."""

    name: str
    issue: str
    without: str
    library: str = "keras"
    replacements: list[_Replacement] = dataclasses.field(default_factory=list)
    applied: bool = False
    problem: str | None = None  # why it could not be applied

    def replaces(self, owner: Any, attribute: str, parameters: tuple[str, ...]):
        """Decorator: ``function(original, *args, **kwargs)`` replaces ``owner.attribute``."""
        def register(function: Callable) -> Callable:
            self.replacements.append(_Replacement(owner, attribute, parameters, function))
            return function
        return register

    def overrides(self, owner: Any, attribute: str, parameters: tuple[str, ...]) -> None:
        """Declares that a tfdist subclass overrides ``owner.attribute``: checked like a replacement, not replaced."""
        self.replacements.append(_Replacement(owner, attribute, parameters, None))

    def adds(self, owner: Any, attribute: str, value: Any) -> None:
        """Sets ``owner.attribute = value``, checking first that the library has no such attribute."""
        self.replacements.append(_Replacement(owner, attribute, None, None, value))

    def apply(self) -> bool:
        """Applies every replacement, or none (with a warning); idempotent. Returns whether applied."""
        if self.applied or self.problem:
            return self.applied
        for replacement in self.replacements:
            self.problem = _check(replacement)
            if self.problem:
                title = {"keras": "Keras", "tensorflow": "TensorFlow", "ray": "Ray"}[self.library]
                tested = tested_range(self.library)
                version = importlib.import_module(self.library).__version__
                warnings.warn(
                    f"tfdist cannot apply its fix for {self.issue} ({self.name}) to {title} {version}: "
                    f"{self.problem}. Without it, {self.without} tfdist's fixes were checked against {title} "
                    f"{tested}; install one of those to have it.", KerasCompatibilityWarning, stacklevel=2)
                return False
        for replacement in self.replacements:
            if replacement.function is None:
                if replacement.parameters is None:
                    setattr(replacement.owner, replacement.attribute, replacement.value)
                continue
            original = getattr(replacement.owner, replacement.attribute)
            if isinstance(original, property):
                patched = property(_wrap(original.fget, replacement, self.name), original.fset, original.fdel,
                                   original.__doc__)
            else:
                patched = _wrap(original, replacement, self.name)
            setattr(replacement.owner, replacement.attribute, patched)
        self.applied = True
        return True

    def restore(self) -> None:
        """Puts the originals back, for a patch needed only until something happened (idempotent); refuses, undoing
        nothing, where a later patch wraps one of its functions (unwrapping would take that one off)."""
        if not self.applied:
            return
        for replacement in self.replacements:
            if replacement.function is None:
                continue
            current = getattr(replacement.owner, replacement.attribute)
            current = current.fget if isinstance(current, property) else current
            if getattr(current, "__tfdist_replacement__", None) is not replacement:
                owner = getattr(replacement.owner, "__qualname__", None) or replacement.owner.__name__
                raise RuntimeError(
                    f"tfdist cannot undo its patch {self.name}: {owner}.{replacement.attribute} was patched again "
                    f"since ({getattr(current, '__tfdist_patch__', 'not by tfdist')}); undo that one first.")
        for replacement in reversed(self.replacements):
            if replacement.function is None:
                if replacement.parameters is None:
                    delattr(replacement.owner, replacement.attribute)
                continue
            current = getattr(replacement.owner, replacement.attribute)
            if isinstance(current, property):
                setattr(replacement.owner, replacement.attribute, property(
                    original_of(current.fget), current.fset, current.fdel, current.__doc__))
            else:
                setattr(replacement.owner, replacement.attribute, original_of(current))
        self.applied = False


def original_of(patched: Callable) -> Callable:
    """The Keras function a tfdist replacement stands in for."""
    return patched.__tfdist_original__


def _check(replacement: _Replacement) -> str | None:
    name = f"{getattr(replacement.owner, '__qualname__', None) or replacement.owner.__name__}.{replacement.attribute}"
    current = getattr(replacement.owner, replacement.attribute, None)
    if replacement.parameters is None:
        return None if current is None else f"{name} already exists"
    if current is None:
        return f"{name} does not exist"
    if isinstance(current, property):
        current = current.fget
    current = getattr(current, "__tfdist_original__", current)
    try:
        found = tuple(inspect.signature(current).parameters)
    except (TypeError, ValueError):
        return f"{name} cannot be inspected"
    if found != replacement.parameters:
        return f"{name} takes {found}, tfdist expects {replacement.parameters}"
    return None


def _wrap(original: Callable, replacement: _Replacement, patch_name: str) -> Callable:
    function = replacement.function

    @functools.wraps(original)
    def patched(*args, **kwargs):
        replacement.calls += 1
        return function(original, *args, **kwargs)

    patched.__tfdist_original__ = original
    patched.__tfdist_replacement__, patched.__tfdist_patch__ = replacement, patch_name
    return patched
