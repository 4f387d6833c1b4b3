"""How tfdist patches Keras (and TensorFlow): check the internal first, replace it, keep the original.

A ``Patch`` groups the replacements of one fix (methods, functions or properties: a
property's getter is what gets replaced). ``apply()`` first checks every internal it
replaces (present, with the parameters tfdist was written against); if one is missing or
changed, it applies none of them and warns once, naming the library and its version, the internal,
and what will not work without the fix. Each replacement receives the original as its
first argument; ``original_of(patched)`` returns it (tests use it to show the bug).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import warnings
from typing import Any, Callable

# The releases tfdist's fixes were checked against (see README, "Versions").
TESTED_KERAS = "3.10 to 3.15"
TESTED_TENSORFLOW = "2.21"
TESTED_RAY = "2.60"


class KerasCompatibilityWarning(UserWarning):
    """This Keras (or TensorFlow) lacks an internal a tfdist fix replaces; that fix is off. The message says what breaks."""


@dataclasses.dataclass
class _Replacement:
    owner: Any
    attribute: str
    parameters: tuple[str, ...]
    function: Callable


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

    def apply(self) -> bool:
        """Applies every replacement, or none (with a warning); idempotent. Returns whether applied."""
        if self.applied or self.problem:
            return self.applied
        for replacement in self.replacements:
            self.problem = _check(replacement)
            if self.problem:
                title, tested = {"keras": ("Keras", TESTED_KERAS), "tensorflow": ("TensorFlow", TESTED_TENSORFLOW),
                                 "ray": ("Ray", TESTED_RAY)}[self.library]
                version = importlib.import_module(self.library).__version__
                warnings.warn(
                    f"tfdist cannot apply its fix for {self.issue} ({self.name}) to {title} {version}: "
                    f"{self.problem}. Without it, {self.without} tfdist's fixes were checked against {title} "
                    f"{tested}; install one of those to have it.", KerasCompatibilityWarning, stacklevel=2)
                return False
        for replacement in self.replacements:
            original = getattr(replacement.owner, replacement.attribute)
            if isinstance(original, property):
                patched = property(_wrap(original.fget, replacement.function), original.fset, original.fdel,
                                   original.__doc__)
            else:
                patched = _wrap(original, replacement.function)
            setattr(replacement.owner, replacement.attribute, patched)
        self.applied = True
        return True


def original_of(patched: Callable) -> Callable:
    """The Keras function a tfdist replacement stands in for."""
    return patched.__tfdist_original__


def _check(replacement: _Replacement) -> str | None:
    name = f"{getattr(replacement.owner, '__qualname__', None) or replacement.owner.__name__}.{replacement.attribute}"
    current = getattr(replacement.owner, replacement.attribute, None)
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


def _wrap(original: Callable, function: Callable) -> Callable:
    @functools.wraps(original)
    def patched(*args, **kwargs):
        return function(original, *args, **kwargs)

    patched.__tfdist_original__ = original
    return patched
