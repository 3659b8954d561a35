"""Fused kernels (Triton). Import :mod:`attnkit.kernels.triton_decode` only where it is used:
Triton is optional, and its interpreter mode (``TRITON_INTERPRET=1``) is read when a kernel is
defined, i.e. when that module is imported."""

import os


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
