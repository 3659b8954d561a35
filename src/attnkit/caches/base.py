"""Deprecated import path: the step protocol is :mod:`attnkit.caches.protocol`, the contiguous
caches :mod:`attnkit.caches.contiguous`, the quantized-storage policy (and ``as_bytes``)
:mod:`attnkit.caches.quant_policy`. Every name is also importable from :mod:`attnkit.caches`."""

from __future__ import annotations

import importlib
import warnings

_MOVED = {
    "KVCache": "protocol", "CacheStep": "protocol", "BoundCache": "protocol", "step": "protocol",
    "reorder": "protocol", "crop": "protocol", "reset": "protocol",
    "DynamicCache": "contiguous", "StaticCache": "contiguous",
    "as_bytes": "quant_policy",
}

__all__ = ["KVCache", "DynamicCache", "StaticCache", "CacheStep", "BoundCache", "step", "reorder", "crop", "reset"]


def __getattr__(name: str):
    room = _MOVED.get(name)
    if room is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"attnkit.caches.base is deprecated; import {name} from attnkit.caches.{room} "
                  f"(or attnkit.caches)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(f"attnkit.caches.{room}"), name)
