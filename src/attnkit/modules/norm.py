"""``RMSNorm``: the root-mean-square norm of every decoder family attnkit loads, as parameters.

Notation: ``x (..., N)``; the norm runs over the last dim N.

Families differ only in where the weight is applied and in its offset:

==============================  ====================================================================
Llama, Mistral, Qwen, DeepSeek  ``weight * rms(x.float()).to(x.dtype)`` (cast, then scale)
OLMo 2                          ``(weight * rms(x.float())).to(x.dtype)`` (``scale_in_fp32=True``)
Gemma 2 / 3                     ``(rms(x.float()) * (1 + weight.float())).to(x.dtype)``
                                (``unit_offset=True``, which also scales in fp32; weight starts at 0)
==============================  ====================================================================

For fp32 inputs the three orders are the same floats.

Inference on CPU (no autograd, not under torch.compile, contiguous x, weight in x's dtype) runs
the same arithmetic in one compiled pass (``torch.ops.attnkit_cpu.rms_norm``,
:mod:`attnkit.native`) instead of seven torch ops; only the order of the sum of squares
differs (torch's own order depends on the CPU's vector width). Without a compiler the torch ops run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import positive_int
from .. import native

__all__ = ["RMSNorm"]


def _native_ok(x: Tensor, w: Tensor) -> bool:
    """The compiled one-pass norm applies: a contiguous CPU fp32 / bf16 / fp16 x with a weight of
    its dtype, outside autograd and torch.compile (which fuses the torch ops itself), and the
    native library built on this machine. (Runs on every norm of a decode step: cheap checks.)"""
    return (x.is_cpu and w.is_cpu and x.dtype in _NATIVE_DTYPES and w.dtype == x.dtype and x.is_contiguous()
            and w.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
            and not torch.compiler.is_compiling() and native.load() is not None)


_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in fp32, then scaled by ``weight``.

    Args:
        dim: N, the normalised width.
        eps: added to the mean square.
        unit_offset: scale by ``1 + weight`` (Gemma; ``weight`` is initialised to 0).
        scale_in_fp32: multiply by the weight before casting back to x's dtype (OLMo 2, Gemma),
            instead of after (Llama). Implied by ``unit_offset``.

    Shapes: x (..., N) -> (..., N), x's dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, unit_offset: bool = False, scale_in_fp32: bool = False,
                 device=None, dtype=None):
        super().__init__()
        positive_int("dim", dim)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ValueError(f"eps must be a float in (0, 1), got {eps!r}")
        for name, val in (("unit_offset", unit_offset), ("scale_in_fp32", scale_in_fp32)):
            if not isinstance(val, bool):
                raise TypeError(f"{name} must be a bool, got {val!r}")
        init = torch.zeros if unit_offset else torch.ones
        self.weight = nn.Parameter(init(dim, device=device, dtype=dtype))
        self.eps = float(eps)
        self.unit_offset = unit_offset
        self.scale_in_fp32 = scale_in_fp32 or unit_offset

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.unit_offset else 1.0)

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[-1] != w.shape[0]:
            raise ValueError(f"x must be a (..., {w.shape[0]}) tensor for RMSNorm({w.shape[0]}), got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        if _native_ok(x, w):
            return native.load().rms_norm(x, w, self.eps, 2 if self.unit_offset else 1 if self.scale_in_fp32 else 0)
        if x.dtype == torch.float32 and w.dtype == torch.float32:  # one dtype: the orders agree
            y = F.rms_norm(x, (x.shape[-1],), eps=self.eps)
            return y * (w + 1.0) if self.unit_offset else y * w
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.unit_offset:
            return (y * (1.0 + w.float())).to(x.dtype)
        if self.scale_in_fp32:
            return (w * y).to(x.dtype)
        return w * y.to(x.dtype)

    def extra_repr(self) -> str:
        extra = ", unit_offset=True" if self.unit_offset else ", scale_in_fp32=True" if self.scale_in_fp32 else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{extra}"
