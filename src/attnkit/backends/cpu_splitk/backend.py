"""Deprecated import path: use :mod:`attnkit.backends.decode.backend` (this module re-exports its
old names)."""

import warnings

from ..common import decode_refusals
from ..decode.backend import MAX_DECODE_Q_LEN, DecodeBackend, auto_skip, min_auto_kv_elems

warnings.warn("attnkit.backends.cpu_splitk.backend is deprecated; use attnkit.backends.decode.backend "
              "(SplitKBackend is now DecodeBackend, decode_refusals is in attnkit.backends.common)",
              DeprecationWarning, stacklevel=2)

SplitKBackend = DecodeBackend

__all__ = ["MAX_DECODE_Q_LEN", "SplitKBackend", "auto_skip", "decode_refusals", "min_auto_kv_elems"]
