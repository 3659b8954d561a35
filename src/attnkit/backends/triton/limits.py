"""The ``triton`` backend's limits and probes, apart from the kernels so that deciding about a
call (the registry asks on every call) never imports Triton."""

from __future__ import annotations

import importlib.util
import os

__all__ = ["MAX_HEAD_DIM", "MAX_Q_LEN", "MAX_V_HEAD_DIM", "NO_CAUSAL", "UNBOUNDED", "interpreting",
           "triton_installed"]

#: Most query tokens per sequence in one call (decode and speculative verification).
MAX_Q_LEN = 16
#: Widest K (D) and V (Dv) the kernel's tiles are sized for (checked to fit sm_80 shared memory).
MAX_HEAD_DIM, MAX_V_HEAD_DIM = 1024, 512
#: q_start meaning "not causal": every key below the sequence's length is visible.
NO_CAUSAL = 1 << 30
#: A window extent standing for "unbounded" (window positions are within +-NO_CAUSAL, so
#: position +- extent stays inside int32).
UNBOUNDED = 1 << 29


def _find_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as missing
        return False


#: Looked up once, at import: ``auto`` asks on every call, and a module search must never run
#: inside code torch.compile traces (dynamo cannot trace ``find_spec``: it raised on torch 2.11
#: and answered None on 2.13).
_TRITON_INSTALLED = _find_triton()


def triton_installed() -> bool:
    """Whether the ``triton`` package is installed (found once, without importing it)."""
    return _TRITON_INSTALLED


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (on CPU tensors). Triton reads
    ``TRITON_INTERPRET`` when a kernel is defined, i.e. when :mod:`attnkit.backends.triton.kernel`
    is imported."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
