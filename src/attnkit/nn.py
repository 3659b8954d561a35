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

Float masks mean what they mean in torch, which adds them to the scores in floating point: a
very negative *finite* value (``-1e30``, ``finfo.min``) is a value, not "masked", so a row of
them everywhere gives uniform weights as in torch; NaN or ``+inf`` in a row gives a NaN row.

The one deliberate difference from torch: a query whose every key is masked gets an output of
exactly 0 and a weights row of 0 (torch returns NaN there). Everything else (including
``is_causal``, which torch treats as a hint that ``attn_mask`` is causal) follows
``torch.nn.functional.multi_head_attention_forward``, down to the exception types: a wrong
shape raises :class:`InputAssertionError` (a ``ValueError`` and an ``AssertionError``) where
torch asserts, :class:`InputRuntimeError` (``ValueError`` and ``RuntimeError``) where torch
raises ``RuntimeError``, and :class:`MaskDtypeError` (``TypeError`` and ``AssertionError``) for
a mask that is neither bool nor floating. Each message starts with torch's own text for that
error (code that matches torch's messages keeps working) and then names the arguments and the
shapes.

Notation: N batch, L target (query) length, S source (key) length, E embed_dim, H num_heads,
D = E // H head dim.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from ._checks import shape_of
from .functional import attention
from .masks import Additive, Causal, Dense, Mask

__all__ = ["MultiheadAttention", "replace_multihead_attention", "InputAssertionError", "InputRuntimeError",
           "MaskDtypeError"]


# torch.nn.MultiheadAttention rejects bad arguments with AssertionError (F._mha_shape_check and the
# asserts of F.multi_head_attention_forward) or RuntimeError (mask shapes, the is_causal hint),
# attnkit with ValueError / TypeError. Each error below is both, so code written against either
# catches it.


class InputAssertionError(ValueError, AssertionError):
    """A shape or argument that ``torch.nn.MultiheadAttention`` rejects with ``AssertionError``:
    query not 2-D / 3-D, key or value of another rank, a mask of the wrong rank, an unbatched 3-D
    ``attn_mask`` or a ``key_padding_mask`` of the wrong shape, ``embed_dim``, key vs value, the
    separate ``kdim`` / ``vdim`` projections, NestedTensor inputs it cannot take."""


class InputRuntimeError(ValueError, RuntimeError):
    """Where torch raises ``RuntimeError`` instead: a 2-D ``attn_mask`` or a batched 3-D one of the
    wrong shape, query and key batch sizes that differ, key / value channels that do not fit the
    packed projection, ``is_causal=True`` without ``attn_mask``."""


class MaskDtypeError(TypeError, AssertionError):
    """A mask that is neither bool nor floating (torch: ``AssertionError`` from
    ``F._canonical_mask``)."""


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

    Raises:
        InputAssertionError / InputRuntimeError / MaskDtypeError: wrong shapes, ranks or mask
            dtypes, each an instance of what torch raises there (``AssertionError`` or
            ``RuntimeError``) and of ``ValueError`` / ``TypeError``.

    Float masks follow torch's floating-point sum: a row of ``-1e30`` or ``finfo.min`` everywhere
    gives uniform weights, NaN or ``+inf`` gives a NaN row (see :func:`_as_torch_adds`).

    NestedTensor inputs (what ``TransformerEncoder``'s inference fast path hands its layers) are
    padded, attended with a key padding mask and returned nested, in the input's layout.
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
        if not isinstance(module, MultiheadAttention):  # an attnkit module's copied hooks route already
            new.register_forward_pre_hook(_route_through_forward)
        return new

    # ------------------------------------------------------------------ forward

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        if isinstance(query, Tensor) and query.is_nested:
            return self._forward_nested(query, key, value, key_padding_mask, need_weights, attn_mask,
                                        average_attn_weights, is_causal)
        batched = self._check_ranks(query, key, value, key_padding_mask, attn_mask, is_causal)
        if batched and self.batch_first:
            query, key, value = _same_op(lambda x: x.transpose(0, 1), query, key, value)
        if not batched:
            query, key, value = _same_op(lambda x: x.unsqueeze(1), query, key, value)
            if key_padding_mask is not None:
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

    def _check_ranks(self, query, key, value, key_padding_mask, attn_mask, is_causal) -> bool:
        """The checks torch makes before projecting (mask dtypes, ``F._mha_shape_check``, the
        ``is_causal`` hint), in its order, with its exception types; returns whether batched."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        for name, m in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if m is None:
                continue
            if not isinstance(m, Tensor):
                raise TypeError(f"{name} must be a tensor or None, got {type(m).__name__}")
            if m.dtype != torch.bool and not m.dtype.is_floating_point:
                raise MaskDtypeError(f"only bool and floating types of {name} are supported: {name} must be bool "
                                     f"(True = not allowed) or floating (added to the scores), got {m.dtype} of "
                                     f"shape {shape_of(m)}")
        if query.dim() not in (2, 3):
            raise InputAssertionError(f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D "
                                      f"query tensor: query must be (L, E) unbatched or 3-D batched, got shape "
                                      f"{shape_of(query)}")
        batched = query.dim() == 3
        which = "For batched (3-D) `query`" if batched else "For unbatched (2-D) `query`"
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise InputAssertionError(f"{which}, expected `key` and `value` to be {query.dim()}-D but found "
                                      f"{key.dim()}-D and {value.dim()}-D tensors respectively (query, key and "
                                      f"value must all be {query.dim()}-D: query {shape_of(query)}, key "
                                      f"{shape_of(key)}, value {shape_of(value)})")
        if key_padding_mask is not None and key_padding_mask.dim() != query.dim() - 1:
            want = "(N, S) for batched" if batched else "(S,) for unbatched"
            raise InputAssertionError(f"{which}, expected `key_padding_mask` to be `None` or {query.dim() - 1}-D but "
                                      f"found {key_padding_mask.dim()}-D tensor instead: key_padding_mask must be "
                                      f"{want} inputs, got shape {shape_of(key_padding_mask)} with query "
                                      f"{shape_of(query)}")
        if attn_mask is not None and attn_mask.dim() not in (2, 3):
            raise InputAssertionError(f"{which}, expected `attn_mask` to be `None`, 2-D or 3-D but found "
                                      f"{attn_mask.dim()}-D tensor instead: attn_mask must be 2-D (L, S) or 3-D "
                                      f"{'(N * num_heads, L, S)' if batched else '(num_heads, L, S)'}, got shape "
                                      f"{shape_of(attn_mask)}")
        if not batched and attn_mask is not None and attn_mask.dim() == 3:
            want = (self.num_heads, query.shape[0], key.shape[0])
            if attn_mask.shape != want:
                raise InputAssertionError(f"Expected `attn_mask` shape to be {want} but got {attn_mask.shape} (3-D "
                                          f"attn_mask must be (num_heads, L, S) = {want}, got shape "
                                          f"{shape_of(attn_mask)})")
        if is_causal and attn_mask is None:
            raise InputRuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                                    "module method `generate_square_subsequent_mask` to create this mask. "
                                    "(is_causal=True needs attn_mask: torch.nn.MultiheadAttention treats is_causal "
                                    "as a hint that attn_mask is causal; pass attn_mask="
                                    "nn.Transformer.generate_square_subsequent_mask(L))")
        return batched

    def _attend(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                is_causal, batched):
        L, N, E = query.shape
        S = key.shape[0]
        H, D = self.num_heads, self.head_dim
        self._check_shapes(query, key, value)
        # torch: the hint replaces attn_mask (top-left causal) unless a padding mask or weights are
        # needed, and then never reads attn_mask's shape (F._mha_shape_check has only asserted the
        # shape of an unbatched 3-D one). torch checks attn_mask's shape before key_padding_mask's.
        use_hint = is_causal and key_padding_mask is None and not need_weights
        if use_hint and (batched or attn_mask.dim() == 2):
            am = None
        else:
            am = self._check_attn_mask(attn_mask, L, S, N)
        kpm = self._check_key_padding_mask(key_padding_mask, N, S)
        if kpm is not None and am is not None and kpm.dtype != am.dtype:
            warnings.warn("Support for mismatched key_padding_mask and attn_mask is deprecated. Use same type "
                          "for both instead.", stacklevel=3)

        q, k, v = self._project(query, key, value)  # (L, N, E), (S, N, E), (S, N, E)
        extra = 0
        if self.bias_k is not None or self.bias_v is not None:
            if self.bias_k is None or self.bias_v is None:
                which = "bias_k is set but bias_v" if self.bias_v is None else "bias_v is set but bias_k"
                raise InputAssertionError(f"{which} is None: bias_k and bias_v must be set together")
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

        mask: Mask | None
        if use_hint:
            mask = Causal("top_left")
        elif (am is not None and am.dtype != torch.bool) or (kpm is not None and kpm.dtype != torch.bool):
            bias = self._torch_float_mask(am, kpm, N, L, S, extra, q.dtype)
            q, bias = _as_torch_adds(q, k, bias)
            mask = Additive(bias)
        else:
            mask = self._bool_mask(am, kpm, N, L, S, extra)
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

    def _check_shapes(self, query, key, value) -> None:
        """query (L, N, E), key (S, N, kdim), value (S, N, vdim), with torch's exception types."""
        L, N, E = query.shape
        if E != self.embed_dim:
            raise InputAssertionError(f"was expecting embedding dimension of {self.embed_dim}, but got {E} (query "
                                      f"has {E} channels but embed_dim is {self.embed_dim}: query {shape_of(query)})")
        # torch compares all of key's and value's shapes with the packed projection, the leading two
        # with separate ones; a batch that differs from query's fails its reshape (RuntimeError).
        if self._qkv_same_embed_dim and key.shape != value.shape:
            raise InputAssertionError(f"key shape {key.shape} does not match value shape {value.shape}: key "
                                      f"(S, N, kdim) = {shape_of(key)} and value (S, N, vdim) = {shape_of(value)} "
                                      f"disagree on source length or batch")
        if not self._qkv_same_embed_dim and key.shape[:2] != value.shape[:2]:
            raise InputAssertionError(f"key's sequence and batch dims {key.shape[:2]} do not match value's "
                                      f"{value.shape[:2]}: key (S, N, kdim) = {shape_of(key)} and value (S, N, vdim) = "
                                      f"{shape_of(value)} disagree on source length or batch")
        if key.shape[1] != N:
            raise InputRuntimeError(f"query and key disagree on the batch size: query (L, N, E) = {shape_of(query)}, "
                                    f"key (S, N, kdim) = {shape_of(key)}")
        if key.shape[2] != self.kdim or value.shape[2] != self.vdim:
            err = InputRuntimeError if self._qkv_same_embed_dim else InputAssertionError
            raise err(f"key must have kdim={self.kdim} and value vdim={self.vdim} channels, got key {shape_of(key)}, "
                      f"value {shape_of(value)}")

    def _check_attn_mask(self, m, L, S, N):
        """attn_mask's shape (its rank and dtype, and an unbatched 3-D one's shape, are checked in
        :meth:`_check_ranks`): (L, S) or (N * num_heads, L, S)."""
        if m is None:
            return None
        want = (L, S) if m.dim() == 2 else (N * self.num_heads, L, S)
        if m.shape != want:
            layout = "(L, S)" if m.dim() == 2 else "(N * num_heads, L, S)"
            raise InputRuntimeError(f"The shape of the {m.dim()}D attn_mask is {m.shape}, but should be {want}. "
                                    f"({m.dim()}-D attn_mask must be {layout} = {want}, got shape {shape_of(m)})")
        return m

    def _check_key_padding_mask(self, m, N, S):
        """key_padding_mask's shape, (N, S) (its rank and dtype are checked in :meth:`_check_ranks`).
        torch compares it after padding both it and S for the extra keys (bias_k, zero attention),
        so its message counts them."""
        if m is None:
            return None
        if m.shape != (N, S):
            extra = int(self.bias_k is not None) + int(self.add_zero_attn)
            dim, want, got = (0, N, m.shape[0]) if m.shape[0] != N else (1, S + extra, m.shape[1] + extra)
            raise InputAssertionError(f"Expected key_padded_mask.shape[{dim}] to be {want}, but got {got}: "
                                      f"key_padding_mask must be (N, S) = {(N, S)}, got shape {shape_of(m)}")
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

    def _attn_mask_4d(self, am: Tensor, L: int, S: int) -> Tensor:
        """attn_mask (L, S) -> (1, 1, L, S); (N * H, L, S) or unbatched (H, L, S) -> (N, H, L, S)."""
        return am.view(1, 1, L, S) if am.dim() == 2 else am.view(-1, self.num_heads, L, S)

    def _bool_mask(self, am, kpm, N, L, S, extra) -> Mask | None:
        """Bool masks (True = not allowed) as one attnkit mask over (N, H, L, S + extra); the
        extra keys (bias_k, zero attention) are always allowed, as torch pads its masks with 0."""
        allowed = []
        if am is not None:
            allowed.append(~self._attn_mask_4d(am, L, S))
        if kpm is not None:
            allowed.append(~kpm.view(N, 1, 1, S))
        parts = [Dense(nn.functional.pad(a, (0, extra), value=True) if extra else a) for a in allowed]
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else parts[0] & parts[1]

    def _torch_float_mask(self, am, kpm, N, L, S, extra, dtype) -> Tensor:
        """The one float mask torch adds to the scores: a bool mask becomes 0 / -inf in the query's
        dtype (``F._canonical_mask``), ``attn_mask + key_padding_mask`` in their dtypes, the extra
        keys padded with 0. Shape (N | 1, H | 1, L, S + extra)."""
        def as_float(m):
            return torch.zeros_like(m, dtype=dtype).masked_fill_(m, float("-inf")) if m.dtype == torch.bool else m

        total = None
        if am is not None:
            total = as_float(self._attn_mask_4d(am, L, S))
        if kpm is not None:
            k4 = as_float(kpm.view(N, 1, 1, S))
            total = k4 if total is None else total + k4
        return nn.functional.pad(total, (0, extra), value=0.0) if extra else total

    # ------------------------------------------------------------------ nested tensors

    def _forward_nested(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                        is_causal):
        # torch takes NestedTensors on its fused fast path only and asserts otherwise, saying why the
        # fast path was not taken; attnkit takes the ones that fast path could.
        refused = "MultiheadAttention does not support NestedTensor outside of its fast path."
        if query.dim() != 3:
            raise InputAssertionError(f"{refused} The fast path was not hit because input not batched; expected "
                                      f"query.dim() of 3 but got {query.dim()} (query should be a batched 3-D "
                                      f"NestedTensor (N, L_i, E))")
        if not (query is key and key is value):
            raise InputAssertionError(f"{refused} The fast path was not hit because non-self attention was used "
                                      f"(query, key, and value are not the same Tensor)")
        if not self.batch_first:
            raise InputAssertionError(f"{refused} The fast path was not hit because batch_first was not True")
        if key_padding_mask is not None or attn_mask is not None:
            raise InputAssertionError(f"{refused} NestedTensor inputs take no key_padding_mask or attn_mask (their "
                                      f"lengths are the padding)")
        lengths = [t.shape[0] for t in query.unbind()]
        x = torch.nested.to_padded_tensor(query, 0.0)  # (N, L, E)
        pad = torch.arange(x.shape[1], device=x.device)[None, :] >= torch.tensor(lengths, device=x.device)[:, None]
        out, w = self.forward(x, x, x, key_padding_mask=pad, need_weights=need_weights,
                              average_attn_weights=average_attn_weights)
        nested = torch.nested.nested_tensor([o[:n] for o, n in zip(out.unbind(0), lengths)],
                                            dtype=out.dtype, device=out.device, layout=query.layout)
        return nested, w


def _as_torch_adds(q: Tensor, k: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(q, bias) for :func:`attnkit.attention` so that a float mask means what it means in torch.

    torch adds the mask to the scores in floating point (``baddbmm`` / SDPA) and takes the softmax
    of the sum. attnkit's core first subtracts each row's largest bias
    (:func:`attnkit.masks.shifted_bias`): the same softmax in exact arithmetic, but not in the two
    cases where torch's sum is not the exact one:

    * a row whose every finite value is so large that adding any score to it rounds back to the
      value (``finfo.min`` or ``-1e30`` used as "masked"): torch's row is ``softmax(mask)``, the
      scores lost (uniform weights for a constant row), where the shifted bias would keep them.
      Those rows' queries become 0 in value, which gives the same ``softmax(mask)``. Their
      gradient still reaches q (``q - q.detach()``), as on torch's ``need_weights=True`` path,
      whose backward differentiates the sum its forward rounded away (its SDPA path gives another
      q gradient there; k gets nothing from those rows here): the same whenever the loss ignores
      those rows' outputs, as it does padding. The test is conservative: a score is at
      most ``scale * |q_i| * max_j |k_j|`` (Cauchy-Schwarz), and a row counts only when that is
      below a quarter of the spacing of floats below each of its finite values (then ``s + m``
      rounds to ``m`` even at a power of two), in fp32 (fp64 for fp64 inputs), the precision in
      which torch's CPU kernels and attnkit add. Rows rounded only in part (``-1e9`` against
      scores of 10 in fp32) get the exact sum: torch's answer there is the rounding itself.
    * NaN or ``+inf`` in a row: torch's row is NaN (softmax of a NaN, or of inf - inf). attnkit's
      :class:`~attnkit.masks.Additive` takes neither, so those entries become 0 and the row's
      queries NaN: NaN out, as torch, and as attnkit's own contract (NaN in, NaN out).

    q: (N, H, L, D); k: (N, H, S', D); bias: (N | 1, H | 1, L, S'). All tensor ops, no branch on
    values, so ``torch.compile(fullgraph=True)`` traces it.
    """
    bad = torch.isnan(bias) | torch.isposinf(bias)
    bad_row = bad.any(-1, keepdim=True)  # (N|1, H|1, L, 1)
    bias = bias.masked_fill(bad, 0.0)
    # added, not multiplied in a torch.where: the other branch's 0 gradient times NaN would be NaN
    q = q + torch.zeros_like(bad_row, dtype=q.dtype).masked_fill_(bad_row, float("nan"))
    if k.shape[2] == 0:  # no keys: nothing to round
        return q, bias
    ct = torch.promote_types(q.dtype, torch.float32)
    mag = bias.detach().to(ct).abs()
    gap = mag - torch.nextafter(mag, torch.zeros_like(mag))  # to the next float toward 0; inf for -inf
    row_gap = gap.amin(-1, keepdim=True)  # (N|1, H|1, L, 1)
    qn = q.detach().to(ct).norm(dim=-1, keepdim=True)  # (N, H, L, 1)
    kn = k.detach().to(ct).norm(dim=-1).amax(-1)[..., None, None]  # (N, H, 1, 1)
    bound = qn * kn * q.shape[-1] ** -0.5  # attention()'s default scale, 1 / sqrt(D)
    swallowed = 4 * bound <= row_gap  # NaN scores (NaN q or k) compare False: they stay NaN
    return torch.where(swallowed, q - q.detach(), q), bias


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
