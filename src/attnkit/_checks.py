"""Argument checkers shared by every room of attnkit, so each rule and its message is written once.

They raise the error a user sees, naming the argument and the value it got. Private to the
package (the leading underscore of the module), public to its rooms (no underscore on the names).
"""

from __future__ import annotations

import math

from torch import Tensor

__all__ = ["shape_of", "positive_int", "positive_number", "check_sinks"]


def shape_of(t) -> tuple[int, ...]:
    """``t``'s shape as a tuple of ints, or ``()`` for anything without one (for error messages
    about arguments that may not even be tensors)."""
    return tuple(getattr(t, "shape", ()))


def positive_int(name: str, val, *, allow_none: bool = False):
    """``val`` if it is an int >= 1 (bools refused), else ValueError naming ``name``; with
    ``allow_none`` None passes too."""
    if val is None and allow_none:
        return None
    if not isinstance(val, int) or isinstance(val, bool) or val < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {val!r}")
    return val


def positive_number(name: str, val, *, none_means: str | None = None):
    """``float(val)`` if it is a finite real number > 0 (bools refused), else ValueError naming
    ``name``. ``none_means``: None is accepted (returned as None) and the message says what it
    stands for (e.g. ``"1 / sqrt(head_dim)"``); without it None is refused."""
    if val is None and none_means is not None:
        return None
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val) or val <= 0:
        tail = "" if none_means is None else f" or None ({none_means})" if none_means else " or None"
        raise ValueError(f"{name} must be a finite number > 0{tail}, got {val!r}")
    return float(val)


def check_sinks(sinks, q: Tensor) -> Tensor | None:
    """``sinks``: None or a floating (Hq,) tensor on q's device (one logit per query head of q
    (B, Hq, Sq, D)), as :func:`attnkit.attention` and ring attention take it."""
    if sinks is None:
        return None
    Hq = q.shape[1]
    if not isinstance(sinks, Tensor):
        raise TypeError(f"sinks must be a (Hq,) = ({Hq},) floating tensor or None, got {type(sinks).__name__}")
    if not sinks.dtype.is_floating_point or sinks.shape != (Hq,):
        raise ValueError(f"sinks must be a (Hq,) = ({Hq},) floating tensor (one logit per query head), got "
                         f"{sinks.dtype} of shape {shape_of(sinks)} for q {shape_of(q)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")
    return sinks
