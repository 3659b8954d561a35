"""Drop-ins for ``torch.nn`` modules whose numbers go through :func:`attnkit.attention`.

:class:`MultiheadAttention` is ``torch.nn.MultiheadAttention`` (a subclass: same constructor,
parameters, state-dict names, initialisation, call signature, mask polarity and return tuple)
whose forward runs the projections in torch and the attention in :func:`attnkit.attention`.
Assign it wherever torch's module sits (``layer.self_attn = ...``) or let
:func:`replace_multihead_attention` swap every one in a model, weights kept.

Mask polarity here is torch's, the opposite of attnkit's own ``mask`` argument:

* ``attn_mask`` (L, S) or (N * num_heads, L, S): bool True = NOT allowed to attend; float = added
  to the scores (``-inf`` = not allowed).
* ``key_padding_mask`` (N, S): bool True = padding, ignored; float = added per key.

The one deliberate difference from torch: a query whose every key is masked gets an output of
exactly 0 and a weights row of 0 (torch returns NaN there). Everything else (including
``is_causal``, which torch treats as a hint that ``attn_mask`` is causal) follows
``torch.nn.functional.multi_head_attention_forward``.

Notation: N batch, L target (query) length, S source (key) length, E embed_dim, H num_heads,
D = E // H head dim.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from .functional import attention
from .masks import Additive, Causal, Dense, Mask

__all__ = ["MultiheadAttention", "replace_multihead_attention"]


def _route_through_forward(module: nn.Module, args) -> None:
    """A no-op forward pre-hook. torch's ``TransformerEncoderLayer.forward`` (torch 2.x,
    ``torch/nn/modules/transformer.py``) skips its fused ``torch._transformer_encoder_layer_fwd``
    when any submodule carries a hook; without one, in eval mode, it would read this module's
    ``in_proj_weight`` and compute attention natively, never calling :meth:`forward`."""
    return None


def _same_op(fn, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``fn`` applied to each, keeping ``query is key`` / ``key is value`` (they pick the packed
    projection paths, as in torch)."""
    q = fn(query)
    k = q if key is query else fn(key)
    v = k if value is key else (q if value is query else fn(value))
    return q, k, v


def _shape(t) -> tuple:
    return tuple(t.shape) if isinstance(t, Tensor) else ()


class MultiheadAttention(nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` with the attention computed by :func:`attnkit.attention`.

    Constructor, parameters (``in_proj_weight`` or ``q_proj_weight`` / ``k_proj_weight`` /
    ``v_proj_weight``, ``in_proj_bias``, ``out_proj.weight`` / ``.bias``, ``bias_k`` / ``bias_v``)
    and their initialisation are torch's own, so the same seed gives the same weights and torch
    state dicts load with ``strict=True``.

    Args (forward):
        query: (L, N, E), or (N, L, E) with ``batch_first``, or (L, E) unbatched.
        key: (S, N, kdim) / (N, S, kdim) / (S, kdim).
        value: (S, N, vdim) / (N, S, vdim) / (S, vdim).
        key_padding_mask: (N, S) or (S,) unbatched; bool True = ignore this key, float = added.
        need_weights: also return the attention weights.
        attn_mask: (L, S) or (N * H, L, S) ((H, L, S) unbatched); bool True = NOT allowed,
            float = added to the scores.
        average_attn_weights: average the weights over heads ((N, L, S)) or not ((N, H, L, S)).
        is_causal: torch's hint that ``attn_mask`` is the causal mask; it needs ``attn_mask``.
            Without ``key_padding_mask`` and ``need_weights`` the top-left causal mask is used
            in place of ``attn_mask`` (as torch does); otherwise ``attn_mask`` is used.

    Returns:
        ``(attn_output, attn_weights)``: output shaped like ``query`` with E channels; weights
        (N, L, S) or (N, H, L, S) in the query's dtype ((L, S) / (H, L, S) unbatched), or None
        without ``need_weights``. ``S`` counts the extra ``bias_k`` / zero-attention key when
        those are on. A query with every key masked gets 0 (torch: NaN).

    NestedTensor inputs (what ``TransformerEncoder``'s inference fast path hands its layers) are
    padded, attended with a key padding mask and returned nested.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None) -> None:
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, add_bias_kv=add_bias_kv,
                         add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim, batch_first=batch_first,
                         device=device, dtype=dtype)
        self.register_forward_pre_hook(_route_through_forward)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> "MultiheadAttention":
        """An attnkit module that shares ``module``'s parameters (the same Parameter objects, so
        optimizers and tied weights keep working), submodules, training mode and hooks."""
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        state = dict(module.__dict__)
        for name, value in state.items():  # own containers (parameters, hooks, ...), same entries
            if isinstance(value, (dict, set)):
                state[name] = type(value)(value)
        new.__dict__.update(state)
        if _route_through_forward not in new._forward_pre_hooks.values():
            new.register_forward_pre_hook(_route_through_forward)
        return new

    # ------------------------------------------------------------------ forward

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        if isinstance(query, Tensor) and query.is_nested:
            return self._forward_nested(query, key, value, key_padding_mask, need_weights, attn_mask,
                                        average_attn_weights, is_causal)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if query.dim() not in (2, 3):
            raise ValueError(f"query must be (L, E) unbatched or 3-D batched, got shape {_shape(query)}")
        batched = query.dim() == 3
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"query, key and value must all be {3 if batched else 2}-D: query "
                             f"{_shape(query)}, key {_shape(key)}, value {_shape(value)}")
        if batched and self.batch_first:
            query, key, value = _same_op(lambda x: x.transpose(0, 1), query, key, value)
        if not batched:
            query, key, value = _same_op(lambda x: x.unsqueeze(1), query, key, value)
            if key_padding_mask is not None:
                if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dim() != 1:
                    raise ValueError(f"key_padding_mask must be (S,) for unbatched inputs, got shape "
                                     f"{_shape(key_padding_mask)}")
                key_padding_mask = key_padding_mask.unsqueeze(0)
        # (L, N, E) from here on.
        out, weights = self._attend(query, key, value, key_padding_mask, need_weights, attn_mask,
                                    average_attn_weights, is_causal, batched)
        if batched and self.batch_first:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(1)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    def _attend(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                is_causal, batched):
        L, N, E = query.shape
        S = key.shape[0]
        H, D = self.num_heads, self.head_dim
        if E != self.embed_dim:
            raise ValueError(f"query has {E} channels but embed_dim is {self.embed_dim}: query {_shape(query)}")
        if key.shape[1] != N or value.shape[1] != N or value.shape[0] != S:
            raise ValueError(f"query, key and value disagree on batch or source length: query (L, N, E) = "
                             f"{_shape(query)}, key (S, N, kdim) = {_shape(key)}, value (S, N, vdim) = "
                             f"{_shape(value)}")
        if key.shape[2] != self.kdim or value.shape[2] != self.vdim:
            raise ValueError(f"key must have kdim={self.kdim} and value vdim={self.vdim} channels, got key "
                             f"{_shape(key)}, value {_shape(value)}")
        kpm = self._check_mask(key_padding_mask, "key_padding_mask", (N, S), batched)
        am = self._check_mask(attn_mask, "attn_mask", None, batched, L=L, S=S, N=N)
        if kpm is not None and am is not None and kpm.dtype != am.dtype:
            warnings.warn("Support for mismatched key_padding_mask and attn_mask is deprecated. Use same type "
                          "for both instead.", stacklevel=3)
        if is_causal and am is None:
            raise ValueError("is_causal=True needs attn_mask (torch.nn.MultiheadAttention treats is_causal as a hint "
                             "that attn_mask is causal); pass attn_mask=nn.Transformer.generate_square_subsequent_mask(L)")
        # torch: the hint replaces attn_mask (top-left causal) unless a padding mask or weights are needed.
        use_hint = is_causal and kpm is None and not need_weights

        q, k, v = self._project(query, key, value)  # (L, N, E), (S, N, E), (S, N, E)
        extra = 0
        if self.bias_k is not None or self.bias_v is not None:
            if self.bias_k is None or self.bias_v is None:
                raise ValueError("bias_k and bias_v must be set together")
            k = torch.cat([k, self.bias_k.expand(1, N, E).to(k.dtype)])
            v = torch.cat([v, self.bias_v.expand(1, N, E).to(v.dtype)])
            extra += 1
        q = q.reshape(L, N, H, D).permute(1, 2, 0, 3)  # (N, H, L, D)
        k = k.reshape(k.shape[0], N, H, D).permute(1, 2, 0, 3)  # (N, H, S', D)
        v = v.reshape(v.shape[0], N, H, D).permute(1, 2, 0, 3)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(N, H, 1, D)], dim=2)
            v = torch.cat([v, v.new_zeros(N, H, 1, D)], dim=2)
            extra += 1

        if use_hint:
            mask: Mask | None = Causal("top_left")
        else:
            mask = self._merged_mask(am, kpm, N, L, S, extra)
        dropout_p = self.dropout if self.training else 0.0
        res = attention(q, k, v, mask, dropout_p=dropout_p, return_weights=bool(need_weights))
        out, weights = res if need_weights else (res, None)
        out = out.permute(2, 0, 1, 3).reshape(L * N, E)  # (L, N, H, D) -> (L*N, E)
        out = nn.functional.linear(out, self.out_proj.weight, self.out_proj.bias).view(L, N, E)
        if weights is not None:
            weights = weights.to(query.dtype)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        return out, weights

    def _check_mask(self, m, name, shape, batched, *, L=None, S=None, N=None):
        if m is None:
            return None
        if not isinstance(m, Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(m).__name__}")
        if m.dtype != torch.bool and not m.dtype.is_floating_point:
            raise TypeError(f"{name} must be bool (True = not allowed) or floating (added to the scores), got "
                            f"{m.dtype} of shape {_shape(m)}")
        if name == "key_padding_mask":
            if tuple(m.shape) != shape:
                raise ValueError(f"key_padding_mask must be (N, S) = {shape}, got shape {_shape(m)}")
            return m
        H = self.num_heads
        if m.dim() == 2:
            if tuple(m.shape) != (L, S):
                raise ValueError(f"2-D attn_mask must be (L, S) = {(L, S)}, got shape {_shape(m)}")
        elif m.dim() == 3:
            want = (N * H, L, S) if batched else (H, L, S)
            if tuple(m.shape) != want:
                raise ValueError(f"3-D attn_mask must be {'(N * num_heads, L, S)' if batched else '(num_heads, L, S)'}"
                                 f" = {want}, got shape {_shape(m)}")
        else:
            raise ValueError(f"attn_mask must be 2-D (L, S) or 3-D (N * num_heads, L, S), got shape {_shape(m)}")
        return m

    def _project(self, query, key, value):
        """The input projections, as torch's ``_in_projection_packed`` / ``_in_projection``."""
        E = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            if key is value and query is key:
                return nn.functional.linear(query, w, b).unflatten(-1, (3, E)).unbind(-2)
            wq, wkv = w.split([E, 2 * E])
            if key is value:
                bkv = None if b is None else b.split([E, 2 * E])[1]
                k, v = nn.functional.linear(key, wkv, bkv).unflatten(-1, (2, E)).unbind(-2)
                return nn.functional.linear(query, wq, bq), k, v
            wq, wk, wv = w.chunk(3)
            return (nn.functional.linear(query, wq, bq), nn.functional.linear(key, wk, bk),
                    nn.functional.linear(value, wv, bv))
        return (nn.functional.linear(query, self.q_proj_weight, bq), nn.functional.linear(key, self.k_proj_weight, bk),
                nn.functional.linear(value, self.v_proj_weight, bv))

    def _merged_mask(self, am, kpm, N, L, S, extra) -> Mask | None:
        """torch's masks (True / -inf = not allowed) as one attnkit mask over (N, H, L, S + extra)."""
        parts: list[Mask] = []
        if am is not None:
            am4 = am.view(1, 1, L, S) if am.dim() == 2 else am.view(-1, self.num_heads, L, S)
            parts.append(self._as_attnkit(am4, extra))
        if kpm is not None:
            parts.append(self._as_attnkit(kpm.view(N, 1, 1, S), extra))
        if not parts:
            return None
        mask = parts[0]
        for p in parts[1:]:
            mask = mask & p
        return mask

    @staticmethod
    def _as_attnkit(m: Tensor, extra: int) -> Mask:
        """A torch-polarity mask (bool True = not allowed; float added) -> attnkit's; the extra
        keys (bias_k, zero attention) are always allowed, as torch pads its masks with 0."""
        if m.dtype == torch.bool:
            allowed = ~m
            if extra:
                allowed = nn.functional.pad(allowed, (0, extra), value=True)
            return Dense(allowed)
        if extra:
            m = nn.functional.pad(m, (0, extra), value=0.0)
        return Additive(m)

    # ------------------------------------------------------------------ nested tensors

    def _forward_nested(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                        is_causal):
        if not (query is key and key is value):
            raise ValueError("NestedTensor inputs are supported for self-attention only (query is key is value)")
        if key_padding_mask is not None or attn_mask is not None:
            raise ValueError("NestedTensor inputs take no key_padding_mask or attn_mask (their lengths are the padding)")
        if not self.batch_first:
            raise ValueError("NestedTensor inputs need batch_first=True")
        lengths = [t.shape[0] for t in query.unbind()]
        x = torch.nested.to_padded_tensor(query, 0.0)  # (N, L, E)
        pad = torch.arange(x.shape[1], device=x.device)[None, :] >= torch.tensor(lengths, device=x.device)[:, None]
        out, w = self.forward(x, x, x, key_padding_mask=pad, need_weights=need_weights,
                              average_attn_weights=average_attn_weights)
        nested = torch.nested.nested_tensor([o[:n] for o, n in zip(out.unbind(0), lengths)],
                                            dtype=out.dtype, device=out.device)
        return nested, w


def replace_multihead_attention(model: nn.Module) -> nn.Module:
    """Swap every ``torch.nn.MultiheadAttention`` inside ``model`` (``model`` itself included
    only as a child of something; pass its parent) for :class:`MultiheadAttention`, sharing the
    same parameters (optimizers built before the swap keep working).

    Returns ``model`` (changed in place)::

        model = attnkit.nn.replace_multihead_attention(nn.Transformer(d_model=64, nhead=4))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if type(model) is nn.MultiheadAttention:
        raise TypeError("model is itself an nn.MultiheadAttention: use attnkit.nn.MultiheadAttention.from_torch(model)")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.MultiheadAttention) and not isinstance(child, MultiheadAttention):
                setattr(parent, name, MultiheadAttention.from_torch(child))
    return model
