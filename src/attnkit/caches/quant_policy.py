"""How a cache stores K/V quantized: the int8 / fp8 rows with their fp32 scales, and the K
channel scale.

``kv_dtype="int8"`` / ``"fp8_e4m3"`` stores K and V quantized (:mod:`attnkit.kvquant`: symmetric
absmax per row, one fp32 scale per token per KV head, kept in a scale buffer beside each data
buffer; the latent cache has one scale per token since V is read from K). A step quantizes its
own tokens when it writes them (nothing already cached is rescaled); ``view`` returns an
:class:`attnkit.QuantizedKV` (``dense=True``: the dequantized K/V in the cache's ``dtype``).
``dtype`` stays the compute dtype: what ``write`` takes and what a dense view returns.

``k_channel_scale`` (quantized caches) divides K by a fixed scale per (KV head, channel) before it
is quantized (:func:`attnkit.kvquant.channel_scale`: keys have outlier channels, which per-row
int8 otherwise pays for in every other channel). None (default): on for int8, off for fp8 (its
per-element exponent gains nothing from it); True / False force it; an (Hkv, D) tensor (e.g.
calibrated offline) is used as given. When on and not given, it is computed from the K rows of
the cache's first write (every batch row and token of it, before quantizing) and then fixed, so
every stored row shares it; an aborted first step unsets it again, and ``reset()`` unsets it so
the next first write measures it afresh (a paged cache: once its pool holds nothing a later
sequence could reuse). Views hand attention ``QuantizedKV(..., k_channel_scale=scale)``; dense
views multiply it back. It is one (Hkv, D) fp32 tensor per layer, not per token:
``bytes_per_token`` does not count it, ``nbytes`` does once it is set.

Notation: B batch, Hkv key/value heads, S new tokens this step, D key head dim.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .._checks import shape_of
from ..kvquant import channel_scale, dtype_name, quantize

__all__ = ["QuantizedStorage", "as_bytes"]


def as_bytes(t: Tensor) -> Tensor:
    """An fp8 tensor as a uint8 view of its bytes (writes go through to it), other tensors as
    they are. Workaround: torch's CPU scatter_, gather, index_copy_, index_fill_ and masked_fill
    have no fp8 kernels (torch 2.x: "not implemented for 'Float8_e4m3fn'"); moving bytes is the
    same operation, so the caches move fp8 rows as bytes on every device."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


class QuantizedStorage:
    """The quantized-storage policy of a :class:`~attnkit.caches.KVCache` (a mixin of it):
    ``storage_dtype``, quantizing a step's rows, and setting / unsetting the K channel scale.

    Reads the cache's ``kv_dtype`` (the quantized storage dtype or None), ``num_kv_heads``,
    ``head_dim`` and ``lengths``, and a step's (:class:`~attnkit.caches.CacheStep`) ``num_new``
    and ``channel_scale_set``; keeps ``channel_scaled`` (whether K is divided by a channel
    scale) and the ``k_channel_scale`` buffer ((Hkv, D) fp32, or None before the first write or
    when off)."""

    kv_dtype: torch.dtype | None
    dtype: torch.dtype
    num_kv_heads: int
    head_dim: int
    lengths: Tensor

    def _init_channel_scale(self, c, device: torch.device) -> None:
        """Resolve the ``k_channel_scale`` argument: ``channel_scaled``, whether it was given, and
        the ``k_channel_scale`` buffer (the given tensor, validated, in fp32 on ``device``)."""
        given = None
        if self.kv_dtype is None:
            if c is not None and c is not False:
                what = f"a tensor of shape {shape_of(c)}" if isinstance(c, Tensor) else repr(c)
                raise ValueError(f"k_channel_scale ({what}) divides quantized keys by channel scales; it needs "
                                 f"kv_dtype='int8' or 'fp8_e4m3', got kv_dtype=None")
            on = False
        elif c is None:
            on = self.kv_dtype == torch.int8  # fp8 keeps an exponent per element: no measured gain
        elif isinstance(c, bool):
            on = c
        elif isinstance(c, Tensor):
            want = (self.num_kv_heads, self.head_dim)
            if not c.is_floating_point() or tuple(c.shape) != want:
                raise ValueError(f"k_channel_scale must be a floating (Hkv, D) = {want} tensor, got {c.dtype} of "
                                 f"shape {shape_of(c)}")
            given = c.detach().to(device=device, dtype=torch.float32).clone()
            bad = ~(torch.isfinite(given) & (given > 0))
            if bool(bad.any()):
                raise ValueError(f"k_channel_scale (Hkv, D) = {want} must be finite and > 0 (in fp32) everywhere, "
                                 f"got {given[bad].tolist()[:8]} at {bad.nonzero().tolist()[:8]}")
            on = True
        else:
            raise TypeError(f"k_channel_scale must be None, a bool or an (Hkv, D) = "
                            f"{(self.num_kv_heads, self.head_dim)} tensor, got {type(c).__name__}")
        #: Whether K is divided by a channel scale before it is quantized.
        self.channel_scaled = on
        self._channel_scale_given = given is not None
        self.register_buffer("k_channel_scale", given, persistent=False)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype the K/V data buffers hold: ``kv_dtype``, or ``dtype`` when not quantized."""
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    def _quantize(self, step, rows: Sequence[Tensor]) -> list[Tensor]:
        """Quantized storage of a step's K/V rows (K first, (B, Hkv, S, ·)): ``[data of each...,
        scale of each...]``, the order of the buffers ``_stored`` / ``_pools`` list; K divided by
        the channel scale first (:meth:`_channel_scale_for`). Unquantized caches store them as given."""
        if self.kv_dtype is None:
            return list(rows)
        c = self._channel_scale_for(step, rows[0])
        if c is not None:
            rows = [rows[0].float() / c[:, None, :], *rows[1:]]
        pairs = [quantize(t, self.kv_dtype) for t in rows]
        return [d for d, _ in pairs] + [s for _, s in pairs]

    def _channel_scale_for(self, step, k: Tensor) -> Tensor | None:
        """The K channel scale (Hkv, D) this step writes with, None when off. Unset (the cache's
        first write): :func:`~attnkit.kvquant.channel_scale` of the step's K, the padding tokens of
        rows with ``num_new < S`` left out; kept from now on, and recorded in ``step`` so that an
        abort unsets it (:meth:`_unset_channel_scale`). A step holding no token sets nothing."""
        if not self.channel_scaled or self.k_channel_scale is not None:
            return self.k_channel_scale
        n_host, S = step.num_new_host, k.shape[2]
        if n_host is not None and not any(n_host):
            return None  # nothing stored (padding only): the first real write measures it
        if n_host is None or any(n != S for n in n_host):
            n = step.num_new if n_host is None else torch.tensor(n_host, device=k.device)
            pad = torch.arange(S, device=k.device)[None] >= n.to(k.device)[:, None]  # (B, S)
            k = k.masked_fill(pad[:, None, :, None], 0)  # |0| never sets a channel's absmax
        self.k_channel_scale = channel_scale(k)
        step.channel_scale_set.add(id(self))
        return self.k_channel_scale

    def _unset_channel_scale(self, step) -> None:
        """Unset the channel scale if ``step`` (being aborted) set it."""
        if id(self) in step.channel_scale_set:
            step.channel_scale_set.discard(id(self))
            self.k_channel_scale = None

    def forget_channel_scale(self) -> None:
        """Unset a computed K channel scale, so that the next write measures it again (what
        ``reset()`` does; a given scale stays). Only while the cache holds no row written with it:
        a RuntimeError otherwise (those rows would be read with another scale)."""
        if self._holds_rows():
            raise RuntimeError("forget_channel_scale() on a cache that still holds tokens written with its channel "
                               "scale; reset() it first")
        if not self._channel_scale_given:
            self.k_channel_scale = None

    def _holds_rows(self) -> bool:
        """Whether some sequence holds tokens (rows written with the channel scale)."""
        return bool((self.lengths > 0).any())

    def _kv_repr(self) -> str:
        if self.kv_dtype is None:
            return ""
        if not self.channel_scaled:
            c = "off"
        elif self.k_channel_scale is None:
            c = "first write"
        else:
            c = (f"{'given' if self._channel_scale_given else 'set'} {shape_of(self.k_channel_scale)}, "
                 f"max {float(self.k_channel_scale.max()):.3g}")
        return f", kv_dtype={dtype_name(self.kv_dtype)!r}, k_channel_scale={c}"
