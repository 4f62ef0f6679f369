"""Optional dependencies, imported only when a feature needs them."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

__all__ = ["import_optional", "require_optional"]

# module name -> what to pip install for it
_PIP_NAMES = {
    "xarray": "xarray",
    "netCDF4": "netCDF4",
    "matplotlib": "matplotlib",
    "plotext": "plotext",
    "flax": "'jaxhistory[nnx]'",
    "optax": "'jaxhistory[nnx]'",
    "wandb": "'jaxhistory[wandb]'",
    "tensorboardX": "'jaxhistory[tensorboard]'",
}


def _missing(module: str, feature: str) -> ImportError:
    top = module.split(".")[0]
    pip_name = _PIP_NAMES.get(top, top)
    return ImportError(
        f"{feature} needs the optional package {top!r}, which is not installed: "
        f"pip install {pip_name}"
    )


def import_optional(module: str, feature: str) -> ModuleType:
    """Imports ``module`` for ``feature``, or says what to install.

    ``import jaxhistory`` imports only jax and numpy; everything else is imported
    here, the first time a feature needs it.

    Raises:
        ImportError: the module is missing; the message names the feature and the
            ``pip install`` command that provides it.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise _missing(module, feature) from err


def require_optional(module: str, feature: str) -> None:
    """Raises the ImportError of :func:`import_optional` when ``module`` is not
    installed, without importing it (a check every process of a job can make
    before only one of them uses the module)."""
    if module in sys.modules:  # imported already, or blocked (None)
        if sys.modules[module] is None:
            raise _missing(module, feature)
        return
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise _missing(module, feature)
