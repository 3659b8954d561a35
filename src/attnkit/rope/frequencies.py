"""Rotary frequency math: the inverse frequencies of every rope type (``default``, ``linear``,
``dynamic`` NTK, ``llama3``, ``yarn``; bit for bit ``transformers.modeling_rope_utils``). YaRN's
magnitude corrections are in :mod:`attnkit.rope.mscale`. See :mod:`attnkit.rope` for the formulas."""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from .config import RopeConfig

__all__ = ["rope_inv_freq", "dynamic_inv_freq"]

_MOVED = ("yarn_get_mscale", "yarn_softmax_scale_multiplier")


def __getattr__(name: str):
    if name in _MOVED:  # deprecated path: the magnitude corrections live in attnkit.rope.mscale
        warnings.warn(f"attnkit.rope.frequencies.{name} is deprecated; import it from attnkit.rope "
                      f"(attnkit.rope.mscale.{name})", DeprecationWarning, stacklevel=2)
        from . import mscale
        return getattr(mscale, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _default_inv_freq(base: float, dim: int, device=None) -> Tensor:
    # The exact expression of transformers' rope init functions (bitwise parity).
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float32) / dim))


def dynamic_inv_freq(cfg: RopeConfig, seq_len: Tensor) -> Tensor:
    """Dynamic NTK frequencies (F,) for a 0-dim int64 ``seq_len`` tensor (no host sync)."""
    mpe, dim, factor = cfg.max_position_embeddings, cfg.rotary_dim, cfg.params["factor"]
    seq_len = torch.maximum(seq_len, torch.tensor(mpe, dtype=seq_len.dtype, device=seq_len.device))
    base = cfg.base * ((factor * seq_len / mpe) - (factor - 1)) ** (dim / (dim - 2))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=seq_len.device).to(torch.float32) / dim
    return (1.0 / (base ** exponent)).to(torch.float32)


def rope_inv_freq(config: RopeConfig, device: torch.device | str | None = None) -> Tensor:
    """Inverse frequencies (F,) in fp32 for ``config`` (``"dynamic"``: those for sequences up to
    ``max_position_embeddings``, i.e. the default ones; longer calls recompute them)."""
    dim, base, p = config.rotary_dim, config.base, config.params
    t = config.rope_type
    if t in ("default", "dynamic"):
        # Hugging Face builds dynamic's initial inv_freq with seq_len = max_position_embeddings in
        # Python floats: base * (factor - factor + 1) ** ..., which can round away from `base`.
        if t == "dynamic":
            f = p["factor"]
            mpe = config.max_position_embeddings
            base = base * ((f * mpe / mpe) - (f - 1)) ** (dim / (dim - 2))
        return _default_inv_freq(base, dim, device)
    if t == "linear":
        inv = _default_inv_freq(base, dim, device)
        inv /= p["factor"]
        return inv
    if t == "llama3":
        inv = _default_inv_freq(base, dim, device)
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_len = p["original_max_position_embeddings"]
        low_wl, high_wl = old_len / lo, old_len / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)  # long wavelengths: interpolate
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return torch.where(is_medium, smoothed, scaled)
    # yarn
    factor, ompe = p["factor"], p["original_max_position_embeddings"]

    def correction_dim(num_rotations):
        return (dim * math.log(ompe / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p["beta_fast"]), correction_dim(p["beta_slow"])
    if p["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # Hugging Face: prevent a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp.to(device=device, dtype=torch.float32)
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor

