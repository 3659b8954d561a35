"""The attention-variant options the attention modules share, checked and turned into masks and
:func:`attnkit.attention` arguments in one place.

:class:`~attnkit.modules.MultiHeadAttention`, :class:`~attnkit.modules.MultiHeadLatentAttention`
and :class:`~attnkit.distributed.ContextParallel` all take or honour the same options (``scale``,
``softcap``, ``sinks``, a sliding ``window``, ALiBi, torch's ``key_padding_mask``); this module
is where each rule lives, so the modules cannot drift apart.

Notation: B batch rows, Sk key length, H query heads.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .._checks import positive_number, shape_of
from ..caches import BoundCache, SlidingWindowCache
from ..masks import ALiBi, KeyPadding, Mask, SlidingWindow, as_mask

__all__ = ["check_variant_options", "check_flag", "attention_kwargs", "and_masks", "window_mask", "alibi_mask",
           "cache_q_start", "torch_key_padding"]


def check_variant_options(scale, softcap, window) -> tuple[float | None, float | None, int | None]:
    """Check the options every attention module takes; returns ``(scale, softcap, window)`` with
    the numbers as floats (None stays None: the default scale is 1 / sqrt(head_dim), no softcap,
    no window)."""
    scale = positive_number("scale", scale, none_means="1 / sqrt(head_dim)")
    softcap = positive_number("softcap", softcap, none_means="")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int (tokens each query sees, itself included) or None, "
                         f"got {window!r}")
    return scale, softcap, window


def check_flag(name: str, val) -> bool:
    """A bool option (``sinks``, ``alibi``): True or False, nothing truthy in their place."""
    if not isinstance(val, bool):
        raise TypeError(f"{name} must be a bool, got {val!r}")
    return val


def attention_kwargs(*, scale: float | None, softcap: float | None, sinks: Tensor | None) -> dict:
    """The :func:`attnkit.attention` keyword arguments for a module's options, leaving out those
    at their default (so a backend sees exactly what the module asks for)."""
    kw = {}
    if scale is not None:
        kw["scale"] = scale
    if softcap is not None:
        kw["softcap"] = softcap
    if sinks is not None:
        kw["sinks"] = sinks
    return kw


def and_masks(*masks: Mask | None) -> Mask | None:
    """The AND of the masks that are not None (None when none is left)."""
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else out & m
    return out


def cache_q_start(cache, batch: int, device) -> Tensor:
    """(B,) position of each row's first query this step: the tokens each row of ``cache`` holds
    before it (a copy: a cache may advance its lengths in place when it commits, before a mask
    built from them is read)."""
    q_start = cache.lengths
    if q_start.numel() == 0:
        return torch.zeros(batch, dtype=torch.long, device=device)
    return q_start if isinstance(cache, BoundCache) else q_start.clone()


def cache_offsets(cache, batch: int, device) -> Tensor:
    """Deprecated name of :func:`cache_q_start`."""
    warnings.warn("attnkit.modules.options.cache_offsets is deprecated; call cache_q_start", DeprecationWarning,
                  stacklevel=2)
    return cache_q_start(cache, batch, device)


def window_mask(window: int | None, cache, batch: int, device) -> Mask | None:
    """The sliding-window mask of a module with ``window`` over ``cache`` (None: no cache): each
    query sees itself and the ``window - 1`` keys before it, anchored at each row's own position
    (the cache's lengths before this step). A sliding cache applies its window itself (it must be
    the module's); None then."""
    if window is None:
        return None
    if cache is None:
        return SlidingWindow(window - 1)
    base = cache.cache if isinstance(cache, BoundCache) else cache
    if isinstance(base, SlidingWindowCache):
        if base.window != window:
            raise ValueError(f"this module attends over a window of {window} tokens but the sliding cache keeps "
                             f"window={base.window}; build the cache with window={window}")
        return None
    return SlidingWindow(window - 1, q_start=cache_q_start(cache, batch, device))


def alibi_mask(slopes: Tensor, cache, batch: int, device) -> Mask:
    """ALiBi bias ``slope_h * (j - i)`` with ``slopes`` (H,), in key coordinates, anchored like
    the causal mask (each row's own position with a cache; None: no cache)."""
    if cache is None:
        return ALiBi(slopes)
    return ALiBi(slopes, q_start=cache_q_start(cache, batch, device))


def torch_key_padding(kpm: Tensor, batch: int, kv_len: int | None) -> Mask:
    """``nn.MultiheadAttention``'s key_padding_mask (B, Sk) (True / -inf = ignore) as an attnkit
    mask. ``kv_len``: the expected Sk (None with a cache: the mask's own check names it)."""
    if (not isinstance(kpm, Tensor) or kpm.dim() != 2 or kpm.shape[0] != batch
            or (kv_len is not None and kpm.shape[1] != kv_len)):
        raise ValueError(f"key_padding_mask must be (B, Sk) = ({batch}, {'cached length' if kv_len is None else kv_len}), "
                         f"got shape {shape_of(kpm)}")
    if kpm.dtype == torch.bool:
        return KeyPadding(valid=~kpm)
    if kpm.dtype.is_floating_point:
        return as_mask(kpm[:, None, None, :])
    raise TypeError(f"key_padding_mask must be bool (True = padding) or float (added), got {kpm.dtype}")
