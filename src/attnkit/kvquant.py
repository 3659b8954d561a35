"""Quantized K/V values: int8 and fp8 (e4m3) rows with one fp32 scale per row.

Notation: a row is one token of one KV head, its last dim D (or the MLA latent's ``r + rope``).

Scheme: symmetric absmax per row, ``scale = max|x| / QMAX`` (QMAX 127 for int8, 448 for fp8
e4m3) and ``data = x / scale`` (int8: rounded to nearest; fp8: torch's round-to-nearest cast);
``dequantize(data, scale) = data * scale`` in fp32. Why this scheme:

* per row, not per tensor: a row's absmax is known when the token is written, so a cache
  quantizes each step's tokens alone, never rescaling what it already holds (llama.cpp's q8_0
  and vLLM's per-token fp8 do the same);
* symmetric: K and V rows are centred near 0, and a zero point would cost a subtraction per
  element in the kernels' inner loops;
* fp32 scales: 4 bytes per row, about 3% of a D=128 int8 row (bf16 scales would save 1.5%), and
  the scale is exact, so the dequantized row is ``data * scale`` with no second rounding.

Keys have outlier channels (a few channels many times larger than the rest, the same ones for
every token of a head; KIVI, Liu et al. 2024): with one scale per row they set the scale, and the
other channels keep a few levels. Keys may therefore carry a second, fixed scale per (KV head,
channel), :func:`channel_scale`: K is divided by it before quantizing, so a key row is
``data * row_scale * channel_scale``. It costs nothing in the kernels: ``q . (k * c) = (q * c) . k``,
so the backends multiply the query by it (and, when V is read from K, the output). Measured
in ``benchmarks/results/*/quantized.md``. int8 caches set one by default, from the keys of their
first write (``k_channel_scale=`` of :class:`attnkit.caches.KVCache`); fp8 keeps an exponent per
element, and channel scales measured no gain for it.

The kernels never build the dequantized rows: they widen ``data`` to fp32 in registers and
multiply the row's score by its K scale and its probability by its V scale (the same product,
reassociated). What they compute equals attention over :func:`dequantize`'s K/V (checked against
the fp64 oracle within rule R).

Bad rows: a row holding NaN gets a NaN scale and one holding inf an infinite scale; either way
the row is NaN (below), so a query that sees it gets NaN (NaN in, NaN out); an all-zero row gets
scale 0 and data 0. Scales a caller builds by hand are used as given, except that a scale of inf
or NaN makes its row NaN on every path (an infinite scale would otherwise turn some scores into
-inf, silently masking the key): 0 makes the row zero, a negative scale flips its sign.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import native

__all__ = ["QUANTIZED_DTYPES", "kv_storage_dtype", "quantize", "dequantize", "finite_or_nan", "channel_scale",
           "dtype_name"]

#: Storage dtypes of quantized K/V and their largest magnitude.
_QMAX: dict[torch.dtype, float] = {torch.int8: 127.0}
if hasattr(torch, "float8_e4m3fn"):
    _QMAX[torch.float8_e4m3fn] = 448.0

QUANTIZED_DTYPES: tuple[torch.dtype, ...] = tuple(_QMAX)

#: Spellings ``kv_dtype=`` takes (and ``--kv-dtype`` on the command line).
_NAMES: dict[str, torch.dtype] = {"int8": torch.int8}
if torch.float8_e4m3fn in _QMAX:
    _NAMES.update({"fp8_e4m3": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn})


def kv_storage_dtype(kv_dtype) -> torch.dtype | None:
    """The storage dtype a ``kv_dtype=`` argument names: None (the model's own dtype, no
    quantization), ``"int8"``, ``"fp8_e4m3"`` (or ``"fp8"``), or the torch dtype itself.
    Anything else raises a ValueError listing the choices."""
    if kv_dtype is None:
        return None
    if isinstance(kv_dtype, torch.dtype) and kv_dtype in _QMAX:
        return kv_dtype
    if isinstance(kv_dtype, str) and kv_dtype.strip().lower() in _NAMES:
        return _NAMES[kv_dtype.strip().lower()]
    raise ValueError(f"kv_dtype must be None (the model's dtype), {', '.join(repr(n) for n in _NAMES)} or one of "
                     f"{', '.join(str(d) for d in _QMAX)}, got {kv_dtype!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a storage dtype: ``"int8"``, ``"fp8_e4m3"``."""
    return "int8" if dtype == torch.int8 else "fp8_e4m3" if dtype in _QMAX else str(dtype).replace("torch.", "")


def quantize(x: Tensor, dtype: torch.dtype = torch.int8) -> tuple[Tensor, Tensor]:
    """Rows of ``x`` (..., D), any float dtype, to (data (..., D) of ``dtype``, scale (...) fp32).

    ``dtype`` is a storage dtype (:data:`QUANTIZED_DTYPES`, or a ``kv_dtype`` spelling)."""
    dtype = kv_storage_dtype(dtype)
    if dtype is None:
        raise ValueError("quantize needs a storage dtype (int8 or fp8_e4m3), got None")
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise TypeError(f"quantize: x must be a floating tensor with a last dim to quantize over, got "
                        f"{getattr(x, 'dtype', type(x).__name__)} of shape {tuple(getattr(x, 'shape', ()))}")
    if _native_applies(x):
        return native.load().quantize_kv_rows(x.detach().contiguous(), 0 if dtype == torch.int8 else 1)
    qmax = _QMAX[dtype]
    xf = x.detach().float()
    # amax propagates NaN: a row with NaN gets a NaN scale (and inf a scale of inf).
    absmax = xf.abs().amax(-1) if x.shape[-1] else xf.new_zeros(x.shape[:-1])
    scale = absmax / qmax
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))  # zero rows: data 0
    y = (xf * inv.unsqueeze(-1)).clamp(-qmax, qmax)
    y = torch.nan_to_num(y, nan=0.0)  # the NaN lives in the scale; int8 has no NaN
    data = y.round().to(dtype) if dtype == torch.int8 else y.to(dtype)
    return data, scale


_NATIVE_INPUTS = (torch.float32, torch.bfloat16, torch.float16)
#: The most rows the compiled quantizer takes: a decode step's (batch x KV heads x new tokens),
#: whose cost is the torch ops' dispatch. A prompt's thousands of rows go to torch's vectorized
#: ops, which the compiled loop does not always beat there (it converts to fp8 element by element:
#: ``benchmarks/results/quantized.md``, cache write).
NATIVE_MAX_ROWS = 256


def _native_applies(x: Tensor) -> bool:
    """The compiled one-pass quantizer (``native/kvquant.cpp``: the same arithmetic, the same bits)
    takes x: a CPU fp32 / bf16 / fp16 tensor of 1 to NATIVE_MAX_ROWS non-empty rows, outside
    torch.compile (which traces the torch ops), the native library built here. A cache step's
    write calls this for K and for V of every layer."""
    n, D = x.numel(), x.shape[-1]
    return (x.is_cpu and x.dtype in _NATIVE_INPUTS and 0 < n <= NATIVE_MAX_ROWS * D
            and not torch.compiler.is_compiling() and native.load() is not None)


def finite_or_nan(scale: Tensor) -> Tensor:
    """Row scales as every path uses them: fp32, a scale of inf or NaN replaced by NaN (a NaN row;
    an infinite scale times a row's zeros and signs would make some scores -inf, which masks a
    key, and others +inf)."""
    scale = scale.float()
    return torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan")))


def dequantize(data: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``data * scale`` (computed in fp32, then cast to ``dtype``): data (..., D), scale (...);
    a row whose scale is inf or NaN is NaN."""
    return (data.float() * finite_or_nan(scale).unsqueeze(-1)).to(dtype)


#: How many times its head's median channel absmax a key channel must reach to be scaled
#: (:func:`channel_scale`).
OUTLIER_RATIO = 2.0


def channel_scale(k: Tensor) -> Tensor:
    """Per (KV head, channel) scales of keys ``k`` (B, Hkv, S, D) (pools (N, bs, Hkv, D): pass
    ``k.transpose(1, 2)``), to divide K by before it is quantized. Returns (Hkv, D) fp32.

    Each channel's absmax over the batch and the tokens, divided by its head's median channel
    absmax: a channel at least ``OUTLIER_RATIO`` (2) times the median (an outlier) gets that
    ratio, so it is scaled down to the head's typical range; every other channel keeps 1. Why
    only outliers: a scaled channel's rounding step grows by its scale, which pays off only when
    the channel would otherwise set its token's absmax (and so every other channel's step); on a
    model without outlier channels, scaling every channel above the median makes int8's attention
    output worse, not better (``benchmarks/bench_quantized_quality.py``). Never < 1, so a channel that happened to be quiet in the keys measured (a cache's short
    first write) is never blown up for the keys that come later. A channel
    whose ratio is not finite or not positive (all zero, NaN, inf, a head whose median is 0)
    gets 1, as does every channel of an empty ``k``.

    Equivalent PyTorch code (finite, non-empty k whose heads' medians are > 0)::

        a = k.float().abs().amax(dim=(0, 2))                         # (Hkv, D)
        c = a / a.median(-1, keepdim=True).values
        c = torch.where(c >= OUTLIER_RATIO, c, 1)
    """
    if not isinstance(k, Tensor) or k.dim() != 4 or not k.is_floating_point():
        raise ValueError(f"channel_scale: k must be a floating (B, Hkv, S, D) tensor, got "
                         f"{getattr(k, 'dtype', type(k).__name__)} of shape {tuple(getattr(k, 'shape', ()))}")
    H, D = k.shape[1], k.shape[3]
    if k.shape[0] * k.shape[2] == 0 or D == 0:
        return torch.ones(H, D, dtype=torch.float32, device=k.device)
    a = k.detach().float().abs().amax(dim=(0, 2))  # (Hkv, D); NaN propagates
    # The median of the finite channels: a NaN or inf channel must not move the others' scale.
    med = torch.where(torch.isfinite(a), a, torch.full_like(a, float("nan"))).nanmedian(-1, keepdim=True).values
    c = a / med
    return torch.where(torch.isfinite(c) & (c >= OUTLIER_RATIO), c, torch.ones_like(c))
