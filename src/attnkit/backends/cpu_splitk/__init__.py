"""The CPU split-K engine: ``backend`` (the ``decode`` and ``paged`` backends), ``engine``
(the algorithm: key intervals, the log-sum-exp merge, the torch implementation); its C++ kernel
lives with the other native sources in :mod:`attnkit.native`."""

from .backend import MAX_DECODE_Q_LEN, SplitKBackend, auto_skip, decode_refusals

__all__ = ["MAX_DECODE_Q_LEN", "SplitKBackend", "auto_skip", "decode_refusals"]
