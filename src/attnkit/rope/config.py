"""What a rotary embedding is: :class:`RopeConfig`, validated from arguments or read from a
Hugging Face config (``rope_parameters`` / legacy ``rope_scaling``); the rope types and the keys
each one reads. See :mod:`attnkit.rope` for the notation and the meaning of each rope type."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from .mscale import yarn_get_mscale

__all__ = ["ROPE_TYPES", "RopeConfig", "rope_config_from_hf"]

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



def rope_config_from_hf(config, *, layer_type: str | None = None, interleaved: bool | None = None) -> RopeConfig:
    """The :class:`RopeConfig` of a Hugging Face model with ``config`` (a ``PretrainedConfig``);
    the rules are :meth:`attnkit.rope.RotaryEmbedding.from_hf_config`'s. The config is not modified."""
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
    return RopeConfig(head_dim, rotary_dim=rotary_dim, base=float(base), max_position_embeddings=mpe,
                      scaling=scaling, interleaved=interleaved)
