"""Applying RoPE: the torch rotations (:func:`apply_rotary`, and :func:`rotate_signed`, the one
:class:`~attnkit.rope.RotaryEmbedding` uses) and their dispatch to the native one-pass rotation
for inference on CPU. See :mod:`attnkit.rope` for the notation and the two layouts."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import native

__all__ = ["apply_rotary", "rotate_signed", "rotation_sign"]


def _rotate(xr: Tensor, interleaved: bool) -> Tensor:
    """The 90-degree partner of each pair: rotate-half ``(-x2, x1)`` or pairwise ``(-x1, x0)``."""
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        return torch.stack((-x1, x0), dim=-1).flatten(-2)
    half = xr.shape[-1] // 2
    return torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> Tensor:
    """Rotate the first R dims of every head of ``x``; the last D - R dims pass through.

    Args:
        x: (B, H, S, D) queries or keys, any floating dtype.
        cos, sin: (B, S, R) or (1, S, R) from :meth:`RotaryEmbedding.cos_sin`, R even, R <= D,
            in the layout ``interleaved`` names (rotate-half: ``cat(c, c)``; interleaved: each
            value repeated twice).
        interleaved: pairs ``(x0, x1), (x2, x3), ...`` instead of ``(x_i, x_{i+R/2})``.

    Returns:
        (B, H, S, D) in ``x.dtype``, computed in fp32 (fp64 for fp64 inputs) and cast back.

    Equivalent PyTorch code (rotate-half, the Hugging Face Llama formula)::

        r = cos.shape[-1]
        c, s = cos[:, None].float(), sin[:, None].float()
        xr = x[..., :r].float()
        rot = torch.cat((-xr[..., r // 2:], xr[..., :r // 2]), -1)
        out = torch.cat(((xr * c + rot * s).to(x.dtype), x[..., r:]), -1)
    """
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if x.dim() != 4:
        raise ValueError(f"x must be (B, H, S, D), got shape {tuple(x.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    B, _, S, D = x.shape
    if cos.dim() != 3 or cos.shape[0] not in (1, B) or cos.shape[1] != S:
        raise ValueError(f"cos/sin must be (B, S, R) = ({B}, {S}, R) or (1, {S}, R) for x of shape "
                         f"{tuple(x.shape)}, got {tuple(cos.shape)}")
    R = cos.shape[-1]
    if R % 2 or R > D:
        raise ValueError(f"cos/sin last dim R ({R}) must be even and <= head dim D ({D}) of x")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    return _apply_rotary(x, cos, sin, interleaved)


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """:func:`apply_rotary` without the argument checks (callers have validated)."""
    R, D = cos.shape[-1], x.shape[-1]
    ct = torch.promote_types(x.dtype, torch.float32)
    xr = (x if R == D else x[..., :R]).to(ct)
    c, s = cos[:, None].to(ct), sin[:, None].to(ct)
    out = (xr * c + _rotate(xr, interleaved) * s).to(x.dtype)
    return out if R == D else torch.cat((out, x[..., R:]), dim=-1)


def rotation_sign(rotary_dim: int, interleaved: bool, device=None) -> Tensor:
    """(R,) fp32: -1 where the rotation's partner enters negated (first half, or the first of each
    pair), +1 elsewhere; ``sin * sign`` is :class:`RotaryAngles`' ``sin_signed``."""
    sign = torch.ones(rotary_dim, device=device)
    if interleaved:
        sign[0::2] = -1.0
    else:
        sign[: rotary_dim // 2] = -1.0
    return sign


def _native_ok(x: Tensor, cos: Tensor, sin_signed: Tensor) -> bool:
    """The compiled one-pass rotation applies: a 4-D CPU fp32 / bf16 / fp16 x outside autograd
    and outside torch.compile (which fuses the torch ops itself), fp32 angles of x's rank, and the
    native library built on this machine."""
    return (x.device.type == "cpu" and x.dim() == 4 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.stride(-1) == 1 and cos.dtype == torch.float32 and sin_signed.dtype == torch.float32
            and cos.dim() == 4 and cos.stride(-1) == 1 and sin_signed.stride() == cos.stride()
            and cos.shape == sin_signed.shape
            and not (torch.is_grad_enabled() and x.requires_grad) and not torch.compiler.is_compiling()
            and native.load() is not None)


def rotate_signed(x: Tensor, cos: Tensor, sin_signed: Tensor, interleaved: bool) -> Tensor:
    """RoPE as ``x * cos + partner(x) * sin_signed`` on the first R dims of x (any layout whose
    last dim is D; cos / sin_signed broadcast against ``x[..., :R]``), in fp32 (fp64 for fp64 x)
    and cast back; the last D - R dims pass through.

    ``partner`` swaps the two halves (rotate-half) or the two members of each pair (interleaved);
    the rotation's minus sign lives in ``sin_signed``. The products are the same floats as
    :func:`_apply_rotary`'s (``-a * b == a * -b`` exactly), with one op fewer."""
    R, D = cos.shape[-1], x.shape[-1]
    if _native_ok(x, cos, sin_signed):  # inference on CPU: one pass, the same floats
        return native.load().rope_rotate(x, cos, sin_signed, interleaved)
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    xr = x if R == D else x[..., :R]
    if xr.dtype != ct:
        xr = xr.to(ct)
    if cos.dtype != ct:
        cos, sin_signed = cos.to(ct), sin_signed.to(ct)
    partner = xr.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) if interleaved else xr.roll(R // 2, -1)
    out = xr * cos + partner * sin_signed
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out if R == D else torch.cat((out, x[..., R:]), dim=-1)

