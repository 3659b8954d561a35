"""Rotary frequency math: the inverse frequencies of every rope type (``default``, ``linear``,
``dynamic`` NTK, ``llama3``, ``yarn``; bit for bit ``transformers.modeling_rope_utils``) and
YaRN's magnitude corrections. See :mod:`attnkit.rope` for the formulas."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .config import RopeConfig

__all__ = ["rope_inv_freq", "dynamic_inv_freq", "yarn_get_mscale", "yarn_softmax_scale_multiplier"]


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1.0 when ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale_multiplier(scaling: Mapping[str, Any] | None) -> float:
    """What DeepSeek-V2/V3 multiply the softmax scale ``qk_head_dim ** -0.5`` by.

    ``mscale(factor, mscale_all_dim) ** 2`` when ``scaling`` is a non-default rope type with a
    non-zero ``mscale_all_dim``, else 1.0: the same rule as Hugging Face's DeepSeek-V3
    ``yarn_apply_mscale`` (which, like DeepSeek's official ``inference/model.py``, applies it for
    YaRN configs; Hugging Face checks only ``rope_type != "default"``). The cos/sin factor is
    separate: :attr:`RopeConfig.attention_scaling` (1.0 for DeepSeek-V3, whose ``mscale`` equals
    ``mscale_all_dim``).

    Hugging Face computes ``scale * m * m``; ``scale * yarn_softmax_scale_multiplier(...)`` may
    differ from it in the last bit of a float64.
    """
    if scaling is None:
        return 1.0
    if not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be a dict or None, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    mscale_all_dim = scaling.get("mscale_all_dim") or 0
    if rope_type == "default" or not mscale_all_dim:
        return 1.0
    factor = scaling.get("factor")
    if not _is_number(factor):
        raise ValueError(f"scaling['factor'] must be a number when mscale_all_dim is set, got {factor!r}")
    m = yarn_get_mscale(factor, mscale_all_dim)
    return m * m


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

