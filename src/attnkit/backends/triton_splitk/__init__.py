"""Deprecated import path: the ``triton`` backend lives in :mod:`attnkit.backends.triton` (this
package re-exports its old names)."""

import warnings

from ..triton.backend import TritonBackend
from ..triton.limits import MAX_HEAD_DIM, MAX_Q_LEN, MAX_V_HEAD_DIM, NO_CAUSAL, interpreting

warnings.warn("attnkit.backends.triton_splitk is deprecated; use attnkit.backends.triton",
              DeprecationWarning, stacklevel=2)

__all__ = ["MAX_HEAD_DIM", "MAX_Q_LEN", "MAX_V_HEAD_DIM", "NO_CAUSAL", "TritonBackend", "interpreting"]
