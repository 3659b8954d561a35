"""Deprecated import path: the split-K engine is :mod:`attnkit.backends.decode.splitk`, its merge
and sinks helpers are in :mod:`attnkit.backends.common` (this module re-exports the old names)."""

import warnings

from ..common import finite, merge_partials, v_is_prefix_of_k, with_sinks
from ..decode.splitk import Q_CHUNK, implementation, splitk_attention

warnings.warn("attnkit.backends.cpu_splitk.engine is deprecated; use attnkit.backends.decode.splitk "
              "(merge_partials, finite, with_sinks and v_is_prefix_of_k: attnkit.backends.common)",
              DeprecationWarning, stacklevel=2)


def engine_name() -> str:
    """Deprecated: :func:`attnkit.backends.decode.splitk.implementation`."""
    warnings.warn("engine_name() is deprecated; use attnkit.backends.decode.splitk.implementation()",
                  DeprecationWarning, stacklevel=2)
    return implementation()


__all__ = ["Q_CHUNK", "engine_name", "finite", "merge_partials", "splitk_attention", "v_is_prefix_of_k",
           "with_sinks"]
