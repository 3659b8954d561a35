"""transformers' masks, translated: the mask-interface function :func:`make_mask` and the
:class:`AttnkitMask` it hands the attention layers.

The mask function recognises transformers' causal, sliding-window and bidirectional patterns and
keeps them typed: ``Causal`` / ``SlidingWindow`` (placed by the cache's ``q_start``) ``&
KeyPadding`` (from the 2-D ``attention_mask``: per-row lengths when it is left or right padding,
so the whole mask is one key interval per query); nothing (B, Sq, Sk)-sized is built for them.
Any other pattern (packed sequences, custom ``or``/``and`` mask functions, chunked attention) is
materialized exactly as transformers' SDPA mask would be. A model that reads the mask itself gets
the tensor SDPA's mask function would have returned (:meth:`AttnkitMask.materialize`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, eager_mask, sdpa_mask

from ...masks import And, Causal, Dense, KeyPadding, Mask, SlidingWindow

__all__ = ["AttnkitMask", "EAGER_MASK_MODEL_TYPES", "make_mask"]

#: Models that extend the mask themselves, only when it is a tensor of eager's additive float
#: bias: DeepSeek-V4's compressed layers append keys after the cache update and concatenate
#: their compressor's block bias (-inf / 0) to the mask. They get eager's mask, which the
#: attention function reads back as a bool mask (values at or below the dtype's minimum mean
#: masked).
EAGER_MASK_MODEL_TYPES = frozenset({"deepseek_v4"})


class AttnkitMask:
    """What the "attnkit" mask function hands the attention layers: one attnkit mask (or None:
    attend everywhere) for a (B, H, Sq, Sk) call, like FlexAttention's ``BlockMask`` is for
    "flex_attention". ``generate`` may call ``.contiguous()`` on it and give it back to the
    model as a prepared mask; both are no-ops here.

    Models that only pass the mask on never make it build anything. A model that reads it (slices
    it, asks its ``dtype``, adds it to something, hands it to a torch function) gets the tensor
    transformers' SDPA mask function would have returned: bool (B, 1, Sq, Sk), True = attend,
    built once on first use (:meth:`materialize`) and shared by every layer, as SDPA's is. Every
    model that runs on "sdpa" already reads masks of that form. It is not a ``torch.Tensor``
    subclass, so ``isinstance(mask, torch.Tensor)`` is False, as for ``BlockMask``.

    Attributes:
        mask: an :mod:`attnkit.masks` object (True = attend) or None.
        shape: torch.Size (B, 1, Sq, Sk), what the mask covers.
        dtype: torch.bool, the dtype of the materialized tensor.
        device: where the materialized tensor lives.
    """

    ndim = 4
    dtype = torch.bool

    def __init__(self, mask: Mask | None, batch: int, q_len: int, kv_len: int, device="cpu"):
        self.mask = mask
        self.shape = torch.Size((batch, 1, q_len, kv_len))
        self.device = torch.device(device)
        self._tensor: Tensor | None = None

    def materialize(self) -> Tensor:
        """The mask as transformers' SDPA mask: bool (B, 1, Sq, Sk), True = attend (cached)."""
        if self._tensor is None:
            B, _, Sq, Sk = self.shape
            if self.mask is None:
                t = torch.ones(self.shape, dtype=torch.bool, device=self.device)
            else:
                # contiguous: models may index or modify it like the tensor SDPA hands them
                t = self.mask.materialize(B, Sq, Sk, self.device).expand(self.shape).contiguous()
            self._tensor = t
        return self._tensor

    def contiguous(self) -> "AttnkitMask":
        return self

    def dim(self) -> int:
        return 4

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torch calls this for any torch function or tensor method that receives an AttnkitMask
        # (torch.where(mask, ...), scores + mask, scores.masked_fill(mask, ...)): run it on the
        # materialized tensor.
        return func(*_materialized(args), **_materialized(kwargs or {}))

    def __getattr__(self, name: str):
        # Only reached for names the class does not define: tensor methods and attributes
        # (masked_fill, to, bool, sum, ...) answer from the materialized tensor. Private and
        # special names are not forwarded (copy / pickle probe them before __init__ has run).
        if name.startswith("_") or name == "mask":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.materialize(), name)

    def __repr__(self) -> str:
        return f"AttnkitMask({self.mask!r}, shape={tuple(self.shape)})"


def _forward_to_tensor(name: str):
    def method(self, *args):
        return getattr(self.materialize(), name)(*args)
    method.__name__ = name
    return method


# Python looks operators up on the class, never through __getattr__: each one that a model may
# apply to a mask tensor (mask[:, 0], ~mask, mask & other, scores + mask, mask == 0) is forwarded.
for _op in ("__getitem__", "__invert__", "__neg__", "__and__", "__rand__", "__or__", "__ror__", "__xor__",
            "__rxor__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__eq__", "__ne__",
            "__lt__", "__le__", "__gt__", "__ge__"):
    setattr(AttnkitMask, _op, _forward_to_tensor(_op))
AttnkitMask.__hash__ = object.__hash__  # identity, as before __eq__ was forwarded


def _materialized(x):
    if isinstance(x, AttnkitMask):
        return x.materialize()
    if isinstance(x, (list, tuple)):
        return type(x)(_materialized(v) for v in x)
    if isinstance(x, dict):
        return {k: _materialized(v) for k, v in x.items()}
    return x


def _window_of(fn: Callable, local_size: int) -> bool:
    """True if the index-based mask function ``fn`` is transformers' sliding-window causal
    pattern of ``local_size`` tokens (``q - local_size < kv <= q``), checked on a few query
    rows around the window's edges (O(local_size) work)."""
    W = int(local_size)
    q = torch.tensor([0, 1, W - 1, W, W + 1, 2 * W + 1]).clamp_min(0).view(1, 1, -1, 1)
    kv = torch.arange(2 * W + 3).view(1, 1, 1, -1)
    b = h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    try:
        got = fn(b, h, q, kv)
    except Exception:  # not index-based after all: let the caller materialize it
        return False
    want = (kv <= q) & (kv > q - W)
    return isinstance(got, Tensor) and got.dtype == torch.bool and bool((got.expand_as(want) == want).all())


def _pattern(fn: Callable, local_size: int | None, use_vmap: bool):
    """"causal", "bidirectional", ("window", W) or None (not recognised: materialize)."""
    if use_vmap:
        return None
    if fn is causal_mask_function:
        return "causal"
    if fn is bidirectional_mask_function:
        return "bidirectional"
    # A window of no token (Qwen2-MoE's configs give sliding_window=0 to models that use no
    # windowed layer, and transformers still builds that mask) is left to sdpa_mask.
    if local_size is not None and local_size >= 1 and _window_of(fn, local_size):
        return ("window", int(local_size))
    return None


def _is_tracing() -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def make_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
              mask_function: Callable = causal_mask_function, attention_mask: Tensor | None = None,
              local_size: int | None = None, use_vmap: bool = False, device="cpu", **kwargs) -> AttnkitMask:
    """transformers' mask-interface signature (as ``sdpa_mask``): query row i sits at position
    ``q_offset + i``, key column j at ``kv_offset + j``; ``attention_mask`` (B, >= kv_offset +
    kv_length) is the 2-D padding mask (True / 1 = real token). Returns an :class:`AttnkitMask`."""
    if isinstance(attention_mask, AttnkitMask):  # prepared by generate() and handed back
        return attention_mask
    config = kwargs.get("config")
    if getattr(config, "model_type", None) in EAGER_MASK_MODEL_TYPES:
        return eager_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                          kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                          local_size=local_size, use_vmap=use_vmap, device=device,
                          dtype=kwargs.get("dtype") or torch.float32)
    pattern = _pattern(mask_function, local_size, use_vmap)
    if pattern is None:
        dense = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                          kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                          local_size=local_size, allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                          use_vmap=use_vmap, device=device)
        return AttnkitMask(Dense(dense), batch_size, q_length, kv_length, device)
    parts: list[Mask] = []
    reach = kv_length  # keys some query may see: padding beyond them does not matter
    if pattern != "bidirectional":
        # Query i sees key j iff kv_offset + j <= q_offset + i (and, windowed, > q_offset + i - W).
        q_start = q_offset - kv_offset
        if isinstance(q_start, Tensor):
            placed = {"q_start": q_start.to(device=device, dtype=torch.long).clone()}
        elif q_start == kv_length - q_length:
            placed = {}  # bottom-right: lets backends use their causal fast paths
        else:
            placed = {"q_start": torch.tensor(int(q_start), device=device)}
        parts.append(Causal(**placed) if pattern == "causal" else SlidingWindow(pattern[1] - 1, **placed))
        if not _is_tracing():
            reach = min(kv_length, q_length + int(q_start.max() if isinstance(q_start, Tensor) else q_start))
    if attention_mask is not None:
        valid = attention_mask.to(device=device, dtype=torch.bool)
        need = kv_offset + kv_length
        if valid.shape[-1] < need:  # positions not seen yet (static caches): padding
            valid = torch.nn.functional.pad(valid, (0, need - valid.shape[-1]), value=False)
        valid = valid[:, kv_offset:need]
        if _is_tracing():
            parts.append(KeyPadding(valid=valid))
        elif not bool(valid[:, :reach].all()):
            parts.append(_key_padding(valid, reach))
    mask = None if not parts else (parts[0] if len(parts) == 1 else And(*parts))
    return AttnkitMask(mask, batch_size, q_length, kv_length, device)


def _key_padding(valid: Tensor, reach: int) -> KeyPadding:
    """(B, Sk) bool (True = real key) as lengths when it is left or right padding over the first
    ``reach`` keys (the ones any query can see): ``KeyPadding(lengths, side=...)`` is one key
    interval per row, which kernels walk without a materialized mask; else ``valid=``."""
    B, Sk = valid.shape
    j = torch.arange(Sk, device=valid.device)[None]
    lead = (~valid).int().cumprod(-1).sum(-1)  # (B,) leading padding
    if torch.equal(valid[:, :reach], (j >= lead[:, None])[:, :reach]):
        return KeyPadding(Sk - lead, side="left")
    n = valid.sum(-1)
    if torch.equal(valid[:, :reach], (j < n[:, None])[:, :reach]):
        return KeyPadding(n, side="right")
    return KeyPadding(valid=valid)
