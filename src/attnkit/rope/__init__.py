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

from .config import ROPE_TYPES, RopeConfig
from .embedding import RotaryAngles, RotaryEmbedding
from .frequencies import rope_inv_freq
from .mscale import yarn_get_mscale, yarn_softmax_scale_multiplier
from .rotate import apply_rotary

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
