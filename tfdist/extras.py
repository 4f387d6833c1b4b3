"""tfdist's optional dependencies: import one, or fail with one line that names what to install.

Standard library only. ``tfdist``'s commands print a ``MissingExtraError`` as that one line
(no traceback) and exit 2.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from tfdist.errors import MissingExtraError

# Top-level module -> (the pip package, the tfdist extra that installs it; None: a core requirement).
EXTRAS: dict[str, tuple[str, str | None]] = {
    "tensorflow_datasets": ("tensorflow-datasets", None),
    "matplotlib": ("matplotlib", "bench"),
    "ray": ("ray[train]", "ray"),
    "mpi4py": ("mpi4py", "mpi"),
}


def require(module: str, purpose: str) -> ModuleType:
    """Imports ``module`` (e.g. "ray.train") for ``purpose`` (e.g. "tfdist run --ray").

    Raises:
        MissingExtraError: it, or something it imports, is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtraError(missing_message(module, purpose, err)) from None


def missing_message(module: str, purpose: str, err: ImportError) -> str:
    """'PURPOSE needs PACKAGE, which cannot be imported here (ERR): pip install ...'."""
    package, extra = EXTRAS.get(module.split(".")[0], (module.split(".")[0], None))
    fix = (f'pip install "tfdist[{extra}]"' if extra else
           f"pip install --force-reinstall tfdist (tfdist requires {package}; this install lacks it)")
    return f"{purpose} needs {package}, which cannot be imported here ({err}): {fix}"
