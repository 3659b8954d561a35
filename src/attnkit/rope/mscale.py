"""YaRN's magnitude corrections: the cos/sin factor's ``mscale`` (read by
:attr:`attnkit.rope.RopeConfig.attention_scaling`) and DeepSeek's softmax-scale multiplier. See
:mod:`attnkit.rope` for the formulas."""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["yarn_get_mscale", "yarn_softmax_scale_multiplier"]


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
