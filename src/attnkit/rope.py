"""Rotary position embeddings (RoPE) for q and k, with Hugging Face's scaling variants.

RoPE rotates each pair of dims of a query/key head by an angle ``position * inv_freq[i]``, so the
dot product of a query at position m and a key at position n depends on m - n only. Values are
never rotated.

Notation: B batch, H heads (Hq for queries, Hkv for keys), S sequence length, D head_dim,
R rotary_dim (the first R dims of every head are rotated, the other D - R pass through unchanged;
R = D unless partial rotary), F = R // 2 frequencies.

Frequencies (``rope_type``, Hugging Face's ``rope_parameters`` / legacy ``rope_scaling`` dict,
matching ``transformers.modeling_rope_utils`` bit for bit):

* ``"default"``   ``inv_freq[i] = base ** (-2i / R)``.
* ``"linear"``    position interpolation: ``inv_freq / factor``.
* ``"dynamic"``   dynamic NTK: for a call whose largest position is ``P``, ``L = max(P + 1,
  max_position_embeddings)`` and ``base' = base * (factor * L / max_position_embeddings -
  (factor - 1)) ** (R / (R - 2))``. Up to ``max_position_embeddings`` this is the default RoPE.
  ``L`` is taken over the whole call (every sequence of the batch), as Hugging Face does. It is a
  pure function of the call: nothing is cached between calls (see :meth:`RotaryEmbedding.cos_sin`).
* ``"llama3"``    Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth
  ramp between ``original_max_position_embeddings / high_freq_factor`` and ``/ low_freq_factor``.
* ``"yarn"``      YaRN: interpolation for low frequencies, extrapolation for high ones, a linear
  ramp between the correction dims from ``beta_fast``/``beta_slow`` (floored/ceiled unless
  ``truncate=False``), and cos/sin multiplied by ``attention_factor`` (default
  ``0.1 * ln(factor) + 1``, or ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both
  are set). DeepSeek-V2/V3 also multiply the softmax scale by ``mscale(factor, mscale_all_dim) ** 2``:
  :func:`yarn_softmax_scale_multiplier`.

Layouts (``interleaved``):

* ``False``: rotate-half (GPT-NeoX, Hugging Face Llama): dim ``i`` pairs with ``i + F``.
* ``True``: pairs ``(x0, x1), (x2, x3), ...`` (Meta's original Llama, DeepSeek's official code).
  The output stays interleaved. Hugging Face's DeepSeek-V3 ``apply_rotary_pos_emb_interleave``
  returns the same rotation *de-interleaved* (evens then odds); both q and k get the same fixed
  permutation, so attention scores are identical.

Example::

    >>> import torch
    >>> from attnkit.rope import RotaryEmbedding
    >>> rope = RotaryEmbedding(8, scaling={"rope_type": "linear", "factor": 2.0})
    >>> q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 1, 3, 8)
    >>> positions = torch.tensor([[0, 1, 2], [5, 6, 7]])   # sequence 1 has 5 cached tokens
    >>> q_rot, k_rot = rope(q, k, positions)
    >>> q_rot.shape, k_rot.shape
    (torch.Size([2, 4, 3, 8]), torch.Size([2, 1, 3, 8]))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from .backends import native

__all__ = [
    "ROPE_TYPES",
    "RopeConfig",
    "RotaryAngles",
    "RotaryEmbedding",
    "apply_rotary",
    "rope_inv_freq",
    "yarn_get_mscale",
    "yarn_softmax_scale_multiplier",
]

#: The rope types attnkit implements (keys of Hugging Face's ``ROPE_INIT_FUNCTIONS`` plus "default").
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

_DEFAULT_BASE = 10000.0
# Keys any scaling dict may carry (Hugging Face v5 keeps rope_theta / partial_rotary_factor there).
_COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
# Keys each type reads; "required" ones must be present (original_max_position_embeddings falls
# back to max_position_embeddings, as Hugging Face's standardize_rope_params does).
_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_OPTIONAL_KEYS = {
    "default": (),
    "linear": (),
    "dynamic": (),
    "llama3": (),
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
}


# --------------------------------------------------------------------------- config


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _resolve_type(scaling: Mapping[str, Any]) -> str:
    rope_type = scaling.get("rope_type")
    legacy = scaling.get("type")
    if rope_type is not None and legacy is not None and rope_type != legacy:
        raise ValueError(f"scaling has both rope_type={rope_type!r} and legacy type={legacy!r}; keep one")
    rope_type = rope_type if rope_type is not None else legacy if legacy is not None else "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"scaling rope_type {rope_type!r} is not supported; known rope types: "
                         f"{', '.join(map(repr, ROPE_TYPES))}")
    return rope_type


@dataclass(frozen=True)
class RopeConfig:
    """Validated, immutable description of a rotary embedding.

    Args:
        head_dim: D, the size of each q/k head this embedding rotates.
        rotary_dim: R, rotate only the first R dims of each head (partial rotary, GPT-NeoX /
            Phi ``partial_rotary_factor``); the rest pass through. Default ``head_dim``, or
            ``int(head_dim * scaling["partial_rotary_factor"])`` when the dict carries one.
        base: ``rope_theta``. Default 10000.0, or ``scaling["rope_theta"]`` when the dict carries
            one; giving both with different values is an error.
        max_position_embeddings: the model's context length. Needed by ``"dynamic"`` (its
            threshold) and used as ``original_max_position_embeddings`` for ``"llama3"``/``"yarn"``
            when the dict has none (as Hugging Face does); for ``"yarn"`` with ``factor=None`` the
            factor is ``max_position_embeddings / original_max_position_embeddings``.
        scaling: Hugging Face's ``rope_parameters`` / ``rope_scaling`` dict, or None (default RoPE).
            Keys: ``rope_type`` (or legacy ``type``) in :data:`ROPE_TYPES` and that type's
            parameters; unknown keys are an error (a typo must not silently do nothing).
        interleaved: rotate pairs ``(x0, x1), (x2, x3), ...`` instead of rotate-half.

    Resolved after validation (read-only): ``rope_type``, ``params`` (the type's parameters with
    Hugging Face's defaults filled in), ``attention_scaling`` (YaRN's cos/sin factor, else 1.0).
    """

    head_dim: int
    rotary_dim: int | None = None
    base: float | None = None
    max_position_embeddings: int | None = None
    scaling: Mapping[str, Any] | None = None
    interleaved: bool = False
    rope_type: str = field(init=False)
    params: Mapping[str, Any] = field(init=False, repr=False)
    attention_scaling: float = field(init=False)

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if not _is_int(self.head_dim) or self.head_dim <= 0:
            raise ValueError(f"head_dim must be a positive int, got {self.head_dim!r}")
        if not isinstance(self.interleaved, bool):
            raise TypeError(f"interleaved must be a bool, got {type(self.interleaved).__name__}")
        mpe = self.max_position_embeddings
        if mpe is not None and (not _is_int(mpe) or mpe <= 0):
            raise ValueError(f"max_position_embeddings must be a positive int or None, got {mpe!r}")
        if self.scaling is not None and not isinstance(self.scaling, Mapping):
            raise TypeError(f"scaling must be a dict (Hugging Face rope_parameters) or None, "
                            f"got {type(self.scaling).__name__}")
        scaling = dict(self.scaling or {})
        set_("scaling", None if self.scaling is None else MappingProxyType(scaling))
        rope_type = _resolve_type(scaling)
        set_("rope_type", rope_type)

        allowed = set(_COMMON_KEYS) | set(_REQUIRED_KEYS[rope_type]) | set(_OPTIONAL_KEYS[rope_type])
        unknown = sorted(set(scaling) - allowed)
        if unknown:
            raise ValueError(f"scaling has keys {unknown} that rope_type {rope_type!r} does not use; "
                             f"allowed keys: {sorted(allowed)}")

        # base / rope_theta: never overwrite a value the user gave.
        theta = scaling.get("rope_theta")
        if theta is not None and self.base is not None and float(theta) != float(self.base):
            raise ValueError(f"base ({self.base}) and scaling['rope_theta'] ({theta}) disagree; give one")
        base = self.base if self.base is not None else theta if theta is not None else _DEFAULT_BASE
        if not _is_number(base) or base <= 1:
            raise ValueError(f"base (rope_theta) must be a finite number > 1, got {base!r}")
        set_("base", float(base))

        # rotary_dim / partial_rotary_factor.
        prf = scaling.get("partial_rotary_factor")
        if prf is not None and (not _is_number(prf) or not 0 < prf <= 1):
            raise ValueError(f"scaling['partial_rotary_factor'] must be in (0, 1], got {prf!r}")
        derived = None if prf is None else int(self.head_dim * prf)
        if self.rotary_dim is not None and derived is not None and derived != self.rotary_dim:
            raise ValueError(f"rotary_dim ({self.rotary_dim}) disagrees with int(head_dim * "
                             f"partial_rotary_factor) = int({self.head_dim} * {prf}) = {derived}; give one")
        rdim = self.rotary_dim if self.rotary_dim is not None else derived if derived is not None else self.head_dim
        if not _is_int(rdim) or rdim <= 0:
            raise ValueError(f"rotary_dim must be a positive int, got {rdim!r}")
        if rdim > self.head_dim:
            raise ValueError(f"rotary_dim ({rdim}) must be <= head_dim ({self.head_dim})")
        if rdim % 2:
            raise ValueError(f"rotary_dim ({rdim}) must be even (dims are rotated in pairs); "
                             f"head_dim={self.head_dim}")
        set_("rotary_dim", rdim)

        set_("params", MappingProxyType(self._resolve_params(rope_type, scaling)))
        set_("attention_scaling", self._attention_scaling())

    # .................................................................. per-type parameters

    def _resolve_params(self, rope_type: str, scaling: dict) -> dict:
        mpe = self.max_position_embeddings
        missing = [k for k in _REQUIRED_KEYS[rope_type] if k not in scaling
                   and not (k == "original_max_position_embeddings" and mpe is not None)]
        if missing:
            hint = (" (original_max_position_embeddings may instead come from max_position_embeddings, "
                    "which is None)" if "original_max_position_embeddings" in missing else "")
            raise ValueError(f"scaling for rope_type {rope_type!r} is missing required keys {missing}; "
                             f"got keys {sorted(scaling)}{hint}")
        p: dict[str, Any] = {}
        if "original_max_position_embeddings" in _REQUIRED_KEYS[rope_type]:
            ompe = scaling.get("original_max_position_embeddings", mpe)
            if not _is_int(ompe) or ompe <= 0:
                raise ValueError(f"scaling['original_max_position_embeddings'] must be a positive int, "
                                 f"got {ompe!r}")
            p["original_max_position_embeddings"] = ompe
        if "factor" in _REQUIRED_KEYS[rope_type]:
            factor = scaling["factor"]
            if factor is None and rope_type == "yarn":
                # Hugging Face (DeepSeek-style configs): the factor is the context-length ratio.
                if mpe is None:
                    raise ValueError("scaling['factor'] is None for rope_type 'yarn', which means "
                                     "max_position_embeddings / original_max_position_embeddings, "
                                     "but max_position_embeddings is None")
                factor = mpe / p["original_max_position_embeddings"]
            if not _is_number(factor) or factor <= 0:
                raise ValueError(f"scaling['factor'] must be a finite number > 0 for rope_type "
                                 f"{rope_type!r}, got {factor!r}")
            p["factor"] = float(factor)
        if rope_type == "dynamic":
            if mpe is None:
                raise ValueError("rope_type 'dynamic' needs max_position_embeddings (the length beyond "
                                 "which the base grows), got None")
            if self.rotary_dim == 2:
                raise ValueError("rope_type 'dynamic' needs rotary_dim > 2 (its exponent is "
                                 "rotary_dim / (rotary_dim - 2)), got rotary_dim=2")
        if rope_type == "llama3":
            lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
            if not (_is_number(lo) and _is_number(hi) and 0 < lo < hi):
                raise ValueError(f"scaling needs 0 < low_freq_factor < high_freq_factor for rope_type "
                                 f"'llama3', got low_freq_factor={lo!r}, high_freq_factor={hi!r}")
            p["low_freq_factor"], p["high_freq_factor"] = lo, hi
        if rope_type == "yarn":
            for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
                val = scaling.get(key)
                if val is not None and not _is_number(val):
                    raise ValueError(f"scaling[{key!r}] must be a number or None, got {val!r}")
            truncate = scaling.get("truncate", True)
            if not isinstance(truncate, bool):
                raise TypeError(f"scaling['truncate'] must be a bool, got {truncate!r}")
            # Hugging Face: `get("beta_fast") or 32`, `get("beta_slow") or 1` (0 means the default too).
            p.update(beta_fast=scaling.get("beta_fast") or 32, beta_slow=scaling.get("beta_slow") or 1,
                     attention_factor=scaling.get("attention_factor"), mscale=scaling.get("mscale"),
                     mscale_all_dim=scaling.get("mscale_all_dim"), truncate=truncate)
        return p

    def __reduce__(self):
        # The read-only MappingProxyType fields cannot be pickled or deep-copied (which
        # copy.deepcopy(model) and torch.save(model) need); rebuild from the resolved arguments.
        scaling = None if self.scaling is None else dict(self.scaling)
        return (type(self), (self.head_dim, self.rotary_dim, self.base, self.max_position_embeddings, scaling,
                             self.interleaved))

    def _attention_scaling(self) -> float:
        if self.rope_type != "yarn":
            return 1.0
        p = self.params
        if p["attention_factor"] is not None:
            return float(p["attention_factor"])
        if p["mscale"] and p["mscale_all_dim"]:
            return float(yarn_get_mscale(p["factor"], p["mscale"]) / yarn_get_mscale(p["factor"], p["mscale_all_dim"]))
        return yarn_get_mscale(p["factor"])


# --------------------------------------------------------------------------- frequencies


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


def _dynamic_inv_freq(cfg: RopeConfig, seq_len: Tensor) -> Tensor:
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


# --------------------------------------------------------------------------- applying


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


def _sign(rotary_dim: int, interleaved: bool, device=None) -> Tensor:
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


def _rotate_signed(x: Tensor, cos: Tensor, sin_signed: Tensor, interleaved: bool) -> Tensor:
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


class RotaryAngles:
    """cos and sin of one call's positions for one rotary embedding, computed once per forward by
    :meth:`RotaryEmbedding.angles` and passed as ``positions`` to every layer that uses an
    embedding of the same config (the positions are then validated and looked up once).

    Attributes:
        cos: (B, S, R) or (1, S, R) fp32, the layout of :meth:`RotaryEmbedding.cos_sin`.
        sin_signed: the same shape: ``sin`` with the rotation's minus sign folded in (negated on
            the first half for rotate-half, on the first of each pair for interleaved), so that
            ``x_rot = x * cos + partner(x) * sin_signed``.
        config: the :class:`RopeConfig` they were computed for.
    """

    __slots__ = ("cos", "sin_signed", "config", "_views")

    def __init__(self, cos: Tensor, sin_signed: Tensor, config: "RopeConfig"):
        self.cos, self.sin_signed, self.config = cos, sin_signed, config
        self._views: dict = {}

    def broadcast(self, layout: str, device: torch.device) -> tuple[Tensor, Tensor]:
        """(cos, sin_signed) shaped to broadcast against x of ``layout`` ("bhsd": (B, 1, S, R),
        "bshd": (B, S, 1, R)) on ``device``; computed once per angles object and reused by every
        layer."""
        key = (layout, device)
        hit = self._views.get(key)
        if hit is None:
            dim = 1 if layout == "bhsd" else 2
            hit = tuple(t.to(device).unsqueeze(dim) for t in (self.cos, self.sin_signed))
            self._views[key] = hit
        return hit

    @property
    def shape(self) -> tuple[int, int]:
        """(B or 1, S) of the positions."""
        return tuple(self.cos.shape[:2])

    def __repr__(self) -> str:
        return f"RotaryAngles(shape={self.shape}, rope_type={self.config.rope_type!r})"


class RotaryEmbedding(nn.Module):
    """Rotary position embedding for q and k at explicit per-sequence positions.

    Args:
        head_dim, rotary_dim, base, max_position_embeddings, scaling, interleaved: see
            :class:`RopeConfig` (built and validated here, kept as ``self.config``).

    Buffers, all non-persistent (``.to()`` moves them; the state dict stays empty, so Hugging
    Face checkpoints load with ``strict=True``): ``inv_freq`` (F,) fp32, and the cos/sin table
    ``cos_table`` / ``sin_table`` (N, R) fp32 of positions ``0 .. N - 1`` (``sin_table`` holds
    :class:`RotaryAngles`' ``sin_signed``). The table starts empty and grows (doubling) to the
    largest position an eager call has used, so it costs what the work needs; every rope type
    reads it except ``"dynamic"``, whose frequencies depend on the call and are recomputed. A
    traced (``torch.compile``) call computes cos/sin from ``inv_freq`` instead (a graph cannot
    grow a table). If a cast such as ``model.to(torch.bfloat16)`` changes the buffers' dtype,
    they are rebuilt in fp32 from the config on next use, so cos/sin never lose precision.

    Use ``rope(q, k, positions)`` (``forward``) per layer; a model computes ``angles =
    rope.angles(positions)`` once per forward and passes ``angles`` as every layer's
    ``positions`` (the checks and the table lookup then run once). There is no ``apply`` method:
    ``nn.Module.apply(fn)`` is the recursive initialiser every parent module relies on.
    """

    inv_freq: Tensor
    cos_table: Tensor
    sin_table: Tensor

    def __init__(self, head_dim: int, *, rotary_dim: int | None = None, base: float | None = None,
                 max_position_embeddings: int | None = None, scaling: Mapping[str, Any] | None = None,
                 interleaved: bool = False):
        super().__init__()
        self.config = RopeConfig(head_dim, rotary_dim=rotary_dim, base=base,
                                 max_position_embeddings=max_position_embeddings, scaling=scaling,
                                 interleaved=interleaved)
        self.register_buffer("inv_freq", rope_inv_freq(self.config), persistent=False)
        R = self.config.rotary_dim
        self.register_buffer("cos_table", torch.zeros(0, R), persistent=False)
        self.register_buffer("sin_table", torch.zeros(0, R), persistent=False)

    # .................................................................. construction

    @classmethod
    def from_config(cls, config: RopeConfig) -> "RotaryEmbedding":
        """Build from a :class:`RopeConfig`."""
        if not isinstance(config, RopeConfig):
            raise TypeError(f"config must be a RopeConfig, got {type(config).__name__}")
        c = config
        return cls(c.head_dim, rotary_dim=c.rotary_dim, base=c.base, max_position_embeddings=c.max_position_embeddings,
                   scaling=None if c.scaling is None else dict(c.scaling), interleaved=c.interleaved)

    @classmethod
    def from_hf_config(cls, config, *, layer_type: str | None = None,
                       interleaved: bool | None = None) -> "RotaryEmbedding":
        """Build the embedding a Hugging Face model with ``config`` (a ``PretrainedConfig``) uses.

        Reads ``head_dim`` (else ``hidden_size // num_attention_heads``; DeepSeek-V3 sets it to
        ``qk_rope_head_dim``), ``rope_parameters`` (v5; or ``rope_scaling`` + ``rope_theta``, v4),
        ``partial_rotary_factor`` (rotary_dim = ``int(head_dim * factor)``) and
        ``max_position_embeddings``. For ``"llama3"``/``"yarn"`` the config attribute
        ``original_max_position_embeddings`` wins over the dict's (Phi-3's rule in Hugging Face),
        else the dict's, else ``max_position_embeddings``. Keys the rope type does not use are
        dropped (Hugging Face only warns about them). ``layer_type`` picks one entry of per-layer
        ``rope_parameters`` (Gemma-3 style). ``interleaved`` defaults to the config's
        ``rope_interleave`` (DeepSeek-V3), else False. The config is not modified.
        """
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        params = dict(params)
        labels = getattr(config, "_rope_type_labels", None) or getattr(config, "layer_types", None) or ()
        nested = [k for k in params if k in labels]
        if nested:
            if layer_type not in nested:
                raise ValueError(f"config has per-layer rope_parameters for {nested}; pass layer_type= one "
                                 f"of them, got {layer_type!r}")
            params = dict(params[layer_type])
        elif layer_type is not None:
            raise ValueError(f"layer_type={layer_type!r} given, but the config's rope_parameters are not "
                             "per layer")
        rope_type = _resolve_type(params)
        base = params.get("rope_theta") or getattr(config, "rope_theta", None) or getattr(
            config, "default_theta", _DEFAULT_BASE)
        prf = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
        rotary_dim = head_dim if prf is None else int(head_dim * prf)
        mpe = getattr(config, "max_position_embeddings", None)
        keep = set(_REQUIRED_KEYS[rope_type]) | set(_OPTIONAL_KEYS[rope_type])
        scaling = {"rope_type": rope_type, **{k: v for k, v in params.items() if k in keep}}
        if rope_type in ("llama3", "yarn"):
            ompe = getattr(config, "original_max_position_embeddings", None)
            if ompe is not None:
                scaling["original_max_position_embeddings"] = ompe
        if interleaved is None:
            interleaved = bool(getattr(config, "rope_interleave", False))
        return cls(head_dim, rotary_dim=rotary_dim, base=float(base), max_position_embeddings=mpe,
                   scaling=scaling, interleaved=interleaved)

    # .................................................................. properties

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def rotary_dim(self) -> int:
        return self.config.rotary_dim

    @property
    def rope_type(self) -> str:
        return self.config.rope_type

    @property
    def interleaved(self) -> bool:
        return self.config.interleaved

    @property
    def attention_scaling(self) -> float:
        """Factor multiplied into cos/sin (YaRN's ``attention_factor``; 1.0 for other types)."""
        return self.config.attention_scaling

    @property
    def softmax_scale_multiplier(self) -> float:
        """DeepSeek-style softmax-scale multiplier, :func:`yarn_softmax_scale_multiplier`."""
        return yarn_softmax_scale_multiplier(self.config.scaling)

    def extra_repr(self) -> str:
        c = self.config
        return (f"head_dim={c.head_dim}, rotary_dim={c.rotary_dim}, base={c.base}, rope_type={c.rope_type!r}, "
                f"interleaved={c.interleaved}")

    # .................................................................. compute

    def _check_positions(self, positions) -> Tensor:
        self._positions_range(positions)
        return positions

    def _positions_range(self, positions) -> tuple[int, int] | None:
        """Validate ``positions``; their (min, max) (one host sync), None while compiling or empty."""
        if not isinstance(positions, Tensor):
            raise TypeError(f"positions must be an integer tensor (B, S), got {type(positions).__name__}")
        if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
            raise TypeError(f"positions must hold integers, got dtype {positions.dtype}")
        if positions.dim() != 2:
            raise ValueError(f"positions must be (B, S), got shape {tuple(positions.shape)}")
        # A data-dependent check (a host sync on GPU); skipped while compiling.
        if torch.compiler.is_compiling() or not positions.numel():
            return None
        lo, hi = (int(v) for v in positions.aminmax())
        if lo < 0:
            raise ValueError(f"positions must be >= 0, got min {lo}")
        return lo, hi

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin for ``positions``, each (B, S, R) fp32, ``attention_scaling`` multiplied in.

        Args:
            positions: (B, S) integer tensor, the position of every token of every sequence
                (ragged batches, left padding, cache offsets: any non-negative values).

        Layout follows ``interleaved``: rotate-half gives ``cat(c, c)`` (Hugging Face's cos),
        interleaved gives each angle twice in a row.

        ``"dynamic"``: the frequencies are recomputed from ``L = max(positions) + 1`` over the whole
        call (all sequences), and are the default ones while ``L <= max_position_embeddings``. This
        is a pure function of ``positions``: the module holds no per-call state, so the same call
        always gives the same bits. Hugging Face's module instead keeps the largest ``L`` it has
        seen until a call drops below ``max_position_embeddings``; the two agree for a fresh
        module and whenever ``L`` never shrinks (prefill then decode), and differ when a long call
        is followed by a shorter one that still exceeds ``max_position_embeddings`` (here it
        uses its own ``L``). Keys already in a cache keep the frequencies they were rotated with,
        in both.
        """
        return self._cos_sin(self._check_positions(positions))

    def _fp32_inv_freq(self) -> Tensor:
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:  # the module was cast (model.to(bf16)): rebuild exactly
            inv_freq = rope_inv_freq(self.config, inv_freq.device)
            if not torch.compiler.is_compiling():
                self.inv_freq = inv_freq
        return inv_freq

    def _cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        positions = positions.to(self.inv_freq.device)
        inv_freq = self._fp32_inv_freq()
        if self.config.rope_type == "dynamic" and positions.numel():
            seq_len = positions.max().long() + 1
            grown = _dynamic_inv_freq(self.config, seq_len)
            inv_freq = torch.where(seq_len > self.config.max_position_embeddings, grown, inv_freq)
        freqs = positions[..., None].float() * inv_freq  # (B, S, F)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        if self.config.interleaved:
            return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    @property
    def uses_table(self) -> bool:
        """Whether eager calls read cos/sin from the table (every rope type but "dynamic")."""
        return self.config.rope_type != "dynamic"

    def reserve(self, n: int) -> None:
        """Make the table cover positions ``0 .. n - 1`` now (it otherwise grows on demand;
        growth doubles, so it is amortised). A no-op for "dynamic"."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if not self.uses_table:
            return
        table = self.cos_table
        have = table.shape[0] if table.dtype == torch.float32 and self.sin_table.dtype == torch.float32 else 0
        if n <= have:
            return
        n = max(n, 2 * have, 64)
        cos, sin = self._cos_sin(torch.arange(n, device=self.inv_freq.device)[None])
        self.cos_table = cos[0]
        self.sin_table = sin[0] * _sign(self.rotary_dim, self.interleaved, sin.device)

    def angles(self, positions: Tensor) -> RotaryAngles:
        """Validate ``positions`` (B, S) (or (1, S)) and look up their cos / sin once, for every
        layer of a forward that rotates with this config (see :class:`RotaryAngles`)."""
        if isinstance(positions, RotaryAngles):
            self._check_angles(positions)
            return positions
        span = self._positions_range(positions)
        if not self.uses_table or torch.compiler.is_compiling():
            cos, sin = self._cos_sin(positions)
            return RotaryAngles(cos, sin * _sign(self.rotary_dim, self.interleaved, sin.device), self.config)
        if span is not None and span[1] >= self.cos_table.shape[0]:
            self.reserve(span[1] + 1)
        elif self.cos_table.dtype != torch.float32 or self.sin_table.dtype != torch.float32:
            self.reserve(self.cos_table.shape[0])  # cast by model.to(dtype): rebuilt in fp32
        table = self.cos_table
        if positions.device != table.device:
            positions = positions.to(table.device)
        return RotaryAngles(table[positions], self.sin_table[positions], self.config)

    def _check_angles(self, angles: RotaryAngles) -> None:
        c = angles.config
        if c is not self.config and c != self.config:
            raise ValueError(f"these RotaryAngles were computed for another rotary config ({c}); this "
                             f"embedding is {self.config}")

    def _angles_for(self, name: str, x: Tensor, positions, seq_dim: int) -> RotaryAngles:
        """Validated angles matching x's batch and sequence dims."""
        a = self.angles(positions)
        B, S = x.shape[0], x.shape[seq_dim]
        if a.cos.shape[1] != S or a.cos.shape[0] not in (1, B):
            raise ValueError(f"positions of shape {a.shape} do not match (B, S) = ({B}, {S}) of {name} "
                             f"{tuple(x.shape)} (or (1, {S}) shared by the batch)")
        return a

    def _check_heads(self, name: str, x) -> None:
        if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be (B, H, S, D), got shape {tuple(x.shape)}")
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"{name} has head dim {x.shape[-1]} (shape {tuple(x.shape)}), but this "
                             f"RotaryEmbedding has head_dim={self.head_dim}")

    def _check_match(self, name: str, x: Tensor, positions: Tensor) -> None:
        B, S = x.shape[0], x.shape[2]
        if positions.shape[1] != S or positions.shape[0] not in (1, B):
            raise ValueError(f"positions of shape {tuple(positions.shape)} do not match (B, S) = ({B}, {S}) "
                             f"of {name} {tuple(x.shape)} (or (1, {S}) shared by the batch)")

    def rotate(self, x: Tensor, positions, *, layout: str = "bhsd") -> Tensor:
        """Rotate one tensor at ``positions`` ((B, S) or (1, S) integers, or :class:`RotaryAngles`).

        ``layout="bhsd"``: x (B, H, S, D) (the attention layout); ``"bshd"``: x (B, S, H, D) (a
        projection's output before the head transpose; e.g. q and k heads side by side, rotated in
        one go). Returns x's shape and dtype, computed in fp32 and cast back."""
        if layout not in ("bhsd", "bshd"):
            raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
        self._check_heads("x", x)
        a = self._angles_for("x", x, positions, 1 if layout == "bshd" else 2)
        cos, sin = a.broadcast(layout, x.device)
        return _rotate_signed(x, cos, sin, self.interleaved)

    def forward(self, q: Tensor, k: Tensor, positions) -> tuple[Tensor, Tensor]:
        """Rotate queries and keys that sit at the same positions.

        Args:
            q: (B, Hq, S, D).
            k: (B, Hkv, S, D).
            positions: (B, S) integer positions (or (1, S) shared by the batch), or the
                :class:`RotaryAngles` of :meth:`angles` (computed once for several layers).

        Returns:
            ``(q_rot, k_rot)``, the shapes and dtypes of q and k, computed in fp32 and cast back.
        """
        self._check_heads("q", q)
        self._check_heads("k", k)
        if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
            raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share B and S; rotate keys at "
                             "other positions with RotaryEmbedding.rotate(k, k_positions)")
        a = self._angles_for("q", q, positions, 2)
        return (_rotate_signed(q, *a.broadcast("bhsd", q.device), self.interleaved),
                _rotate_signed(k, *a.broadcast("bhsd", k.device), self.interleaved))
