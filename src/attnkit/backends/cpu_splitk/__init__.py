"""Deprecated import path: the ``decode`` and ``paged`` backends live in
:mod:`attnkit.backends.decode` (this package re-exports its old names)."""

import warnings

from ..common import decode_refusals
from ..decode.backend import MAX_DECODE_Q_LEN, DecodeBackend, auto_skip

warnings.warn("attnkit.backends.cpu_splitk is deprecated; use attnkit.backends.decode (SplitKBackend is now "
              "DecodeBackend, decode_refusals is in attnkit.backends.common)", DeprecationWarning, stacklevel=2)

SplitKBackend = DecodeBackend

__all__ = ["MAX_DECODE_Q_LEN", "SplitKBackend", "auto_skip", "decode_refusals"]
