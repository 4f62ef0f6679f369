"""Optional dependencies, imported only when a feature needs them."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["import_optional"]

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
        top = module.split(".")[0]
        pip_name = _PIP_NAMES.get(top, top)
        raise ImportError(
            f"{feature} needs the optional package {top!r}, which is not installed: "
            f"pip install {pip_name}"
        ) from err
