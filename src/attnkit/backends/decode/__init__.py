"""The ``decode`` and ``paged`` backends: ``backend`` (:class:`DecodeBackend`, the two backends'
one class), ``splitk`` (the split-K engine: its entry point, argument parsing apart from the
dispatch to an implementation), ``torch_impl`` (the engine in torch ops); the native C++ kernel
lives with the other native sources in :mod:`attnkit.native`."""

from .backend import MAX_DECODE_Q_LEN, DecodeBackend, auto_skip

__all__ = ["MAX_DECODE_Q_LEN", "DecodeBackend", "auto_skip"]
