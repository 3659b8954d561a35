"""Deprecated import path: the entry points are in :mod:`attnkit.backends.triton.ops`, the Triton
kernels in :mod:`attnkit.backends.triton.kernel` (names are looked up there, in that order)."""

import warnings

from ..triton import kernel as _kernel, limits as _limits, ops as _ops

warnings.warn("attnkit.backends.triton_splitk.kernel is deprecated; use attnkit.backends.triton.ops (entry "
              "points) or attnkit.backends.triton.kernel (the kernels)", DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    for module in (_ops, _kernel, _limits):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
