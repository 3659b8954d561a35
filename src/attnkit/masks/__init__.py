"""Typed, composable attention masks (True = attend): :mod:`attnkit.masks.typed` holds the
user's mask types, ALiBi and composition; :mod:`attnkit.masks.reduced` the one reduction of a
call's mask that backends read (:class:`~attnkit.masks.reduced.ReducedMask`, importable from
here too but not part of the public names)."""

from .reduced import ReducedMask
from .typed import (ALiBi, Additive, And, Causal, Dense, Document, KeyPadding, Mask, Or, PrefixLM, QueryPadding,
                    SelectedBlocks, SelectedKeys, Selection, SlidingWindow, alibi_slopes, as_mask, has_alibi,
                    has_bias, has_selection, has_structure, shifted_bias, split_alibi)

from . import typed as _typed

__all__ = list(_typed.__all__)  # the user's mask types; ReducedMask is importable, not public
