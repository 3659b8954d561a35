"""``MultiHeadAttention``: one module for MHA, GQA and MQA, self- and cross-attention.

Notation: B batch, Sq / Sk query / key lengths, E embed dim, H query heads, Hkv key/value heads
(H = Hkv: MHA; Hkv = 1: MQA; otherwise GQA), hd head dim, hdv value head dim.

The module owns the projections and the wiring (RoPE, cache); the numbers come from
:func:`attnkit.attention`. Parameter names are Hugging Face's (``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``) so Llama / Mistral / Qwen2-family attention state dicts load with ``strict=True``.

Fusion is explicit: ``fused_qkv=True`` holds one ``qkv_proj`` Linear (Phi-3's name) whose rows are
q | k | v, so self-attention reads the weights in one matrix product and rotates q and k in one
go. A ``load_state_dict`` pre-hook turns separate ``q_proj / k_proj / v_proj`` entries (weights
and biases) into ``qkv_proj`` and, on an unfused module, a ``qkv_proj`` entry into the three, so
both checkpoint layouts load with ``strict=True`` into either module; so do BLOOM / GPT-NeoX
attention state dicts (``query_key_value`` with rows ordered per head, ``dense``). ``state_dict()``
emits the module's own names (see :mod:`attnkit.modules._fused` for why).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._checks import positive_int, shape_of
from ..caches import KVCache, new_cache
from ..functional import attention
from ..masks import alibi_slopes, as_mask
from ..rope import RotaryEmbedding
from ._fused import FusedLoadHook, HeadInterleavedLoadHook
from .linear import Linear
from .norm import RMSNorm
from .options import (alibi_mask, and_masks, attention_kwargs, check_flag, check_variant_options, torch_key_padding,
                      window_mask)

__all__ = ["MultiHeadAttention", "GroupedQueryAttention", "MultiQueryAttention"]


class MultiHeadAttention(nn.Module):
    """Multi-head attention with ``num_kv_heads`` key/value heads shared by groups of query heads.

    Args:
        embed_dim: E, width of the query input.
        num_heads: H query heads.
        num_kv_heads: Hkv (default H). Must divide H. 1 is MQA.
        head_dim: hd (default E // H; must then divide evenly).
        kdim, vdim: widths of the key / value inputs for cross-attention (default E).
        v_head_dim: hdv (default hd).
        out_dim: width of the output (default E).
        bias: bias on q/k/v projections (Qwen2 has them, Llama does not).
        out_bias: bias on o_proj (default: ``bias``).
        fused_qkv: one ``qkv_proj`` Linear (rows q | k | v) instead of three; self-attention
            only (kdim = vdim = embed_dim). Checkpoints in either layout load (see the module
            docstring).
        scale: the softmax scale (default 1 / sqrt(hd); Gemma: ``query_pre_attn_scalar ** -0.5``).
        softcap: scores become ``softcap * tanh(scores / softcap)`` after scaling (Gemma 2).
        sinks: a learned ``sinks`` parameter (H,): per-head logits that join each row's softmax
            denominator and carry no value (gpt-oss).
        qk_norm: RMSNorm of q and k before RoPE, parameters ``q_norm`` / ``k_norm``: True or
            "head" normalises each head's hd values (Qwen3, Gemma 3), "full" the whole projected
            width, H * hd and Hkv * hd (OLMo 2).
        qk_norm_kw: keyword arguments of those :class:`attnkit.modules.RMSNorm` (``eps``,
            ``unit_offset`` for Gemma, ``scale_in_fp32`` for OLMo 2).
        window: a sliding window of ``window`` tokens, the query itself included (Mistral's
            ``sliding_window``; the mask ``SlidingWindow(window - 1)``), honoured with every
            cache; with a sliding cache (``new_cache("sliding", window=window)``) only the
            window is kept.
        alibi: ALiBi position bias with the standard slopes of H heads (BLOOM), usually with
            ``rope=None``.
        dropout: attention-probability dropout, applied in training mode only.
        causal: bottom-right causal self-attention (decoders).
        rope: an :class:`attnkit.RotaryEmbedding` (or None), applied to q and k at ``positions``.
        batch_first: inputs (B, S, E) if True, (S, B, E) like ``nn.MultiheadAttention`` if False.
        backend: the :func:`attnkit.attention` backend ("auto" by default).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, kdim: int | None = None, vdim: int | None = None,
                 v_head_dim: int | None = None, out_dim: int | None = None, bias: bool = False,
                 out_bias: bool | None = None, dropout: float = 0.0, causal: bool = False,
                 rope: RotaryEmbedding | None = None, batch_first: bool = True, backend: str = "auto",
                 fused_qkv: bool = False, scale: float | None = None, softcap: float | None = None,
                 sinks: bool = False, qk_norm: bool | str = False, qk_norm_kw: dict | None = None,
                 window: int | None = None, alibi: bool = False, device=None, dtype=None):
        super().__init__()
        self.embed_dim = positive_int("embed_dim", embed_dim)
        self.num_heads = positive_int("num_heads", num_heads)
        self.num_kv_heads = positive_int("num_kv_heads", num_heads if num_kv_heads is None else num_kv_heads)
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}) "
                                 f"unless head_dim is given")
            head_dim = embed_dim // num_heads
        self.head_dim = positive_int("head_dim", head_dim)
        self.v_head_dim = positive_int("v_head_dim", head_dim if v_head_dim is None else v_head_dim)
        self.kdim = positive_int("kdim", embed_dim if kdim is None else kdim)
        self.vdim = positive_int("vdim", embed_dim if vdim is None else vdim)
        self.out_dim = positive_int("out_dim", embed_dim if out_dim is None else out_dim)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.dropout, self.causal, self.batch_first, self.backend = float(dropout), causal, batch_first, backend
        if rope is not None and not isinstance(rope, RotaryEmbedding):
            raise TypeError(f"rope must be an attnkit.RotaryEmbedding or None, got {type(rope).__name__}")
        if rope is not None and rope.head_dim != self.head_dim:
            raise ValueError(f"rope has head_dim={rope.head_dim} but this module's head_dim is {self.head_dim}")
        self.rope = rope
        if not isinstance(fused_qkv, bool):
            raise TypeError(f"fused_qkv must be a bool, got {fused_qkv!r}")
        if fused_qkv and (self.kdim != embed_dim or self.vdim != embed_dim):
            raise ValueError(f"fused_qkv=True projects one input (self-attention): kdim ({self.kdim}) and vdim "
                             f"({self.vdim}) must equal embed_dim ({embed_dim})")
        self.fused_qkv = fused_qkv
        kw = {"device": device, "dtype": dtype}
        sizes = (num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.v_head_dim)
        self._qkv_sizes = sizes
        if fused_qkv:
            self.qkv_proj = Linear(embed_dim, sum(sizes), bias=bias, **kw)
        else:
            self.q_proj = Linear(embed_dim, sizes[0], bias=bias, **kw)
            self.k_proj = Linear(self.kdim, sizes[1], bias=bias, **kw)
            self.v_proj = Linear(self.vdim, sizes[2], bias=bias, **kw)
        self.o_proj = Linear(num_heads * self.v_head_dim, self.out_dim,
                             bias=bias if out_bias is None else out_bias, **kw)
        if self.num_kv_heads == num_heads and self.v_head_dim == self.head_dim:  # BLOOM / GPT-NeoX names
            self.register_load_state_dict_pre_hook(HeadInterleavedLoadHook(num_heads, self.head_dim))
        self.register_load_state_dict_pre_hook(
            FusedLoadHook("qkv_proj", ("q_proj", "k_proj", "v_proj"), sizes, to_fused=fused_qkv))

        self.scale, self.softcap, self.window = check_variant_options(scale, softcap, window)
        check_flag("sinks", sinks)
        check_flag("alibi", alibi)
        if qk_norm not in (False, True, "head", "full"):
            raise ValueError(f"qk_norm must be False, True / 'head' (per head) or 'full' (whole width), got {qk_norm!r}")
        if window is not None and not causal:
            raise ValueError("window= is a causal sliding window: it needs causal=True")
        self.qk_norm = {False: None, True: "head"}.get(qk_norm, qk_norm)
        if self.qk_norm is not None:
            widths = (self.head_dim, self.head_dim) if self.qk_norm == "head" else sizes[:2]
            nkw = dict(qk_norm_kw or {})
            self.q_norm = RMSNorm(widths[0], **nkw, **kw)
            self.k_norm = RMSNorm(widths[1], **nkw, **kw)
        elif qk_norm_kw is not None:
            raise ValueError("qk_norm_kw applies with qk_norm")
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads, **kw))
        else:
            self.sinks = None
        self.alibi = alibi
        if alibi:
            self.register_buffer("alibi_slopes", alibi_slopes(num_heads).to(device=device, dtype=torch.float32),
                                 persistent=False)

    def extra_repr(self) -> str:
        opts = [f"heads={self.num_heads}", f"kv_heads={self.num_kv_heads}", f"head_dim={self.head_dim}"]
        for name in ("scale", "softcap", "window", "qk_norm"):
            if getattr(self, name) is not None:
                opts.append(f"{name}={getattr(self, name)!r}")
        opts += [n for n in ("alibi",) if getattr(self, n)] + (["sinks"] if self.sinks is not None else [])
        return ", ".join(opts)

    def _check_input(self, name: str, x: Tensor, width: int) -> None:
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor ({'B, S' if self.batch_first else 'S, B'}, "
                             f"{width}), got shape {shape_of(x)}")
        if x.shape[-1] != width:
            raise ValueError(f"{name} has width {x.shape[-1]} (shape {tuple(x.shape)}), expected {width}")

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                mask=None, key_padding_mask: Tensor | None = None, positions=None,
                cache: KVCache | None = None, need_weights: bool = False):
        """Self-attention ``forward(x)`` or cross-attention ``forward(query, key, value)``.

        Args:
            query: (B, Sq, E) ((Sq, B, E) when ``batch_first=False``).
            key, value: (B, Sk, kdim), (B, Sk, vdim); default: ``query`` (self-attention).
            mask: as in :func:`attnkit.attention` (True = attend), over (B, H, Sq, Sk_total).
            key_padding_mask: (B, Sk) with ``nn.MultiheadAttention``'s meaning: True (or -inf)
                marks padding to ignore.
            positions: (B, Sq) (or (1, Sq)) int positions for RoPE, or the
                :class:`attnkit.rope.RotaryAngles` a model computed once for every layer
                (``rope.angles(positions)``); default: the cache's next positions, or 0..Sq-1.
            cache: a :class:`attnkit.caches.KVCache`; this step's K/V are appended and the
                attention runs over everything cached (causal modules only).
            need_weights: also return the per-head weights (B, H, Sq, Sk_total) in fp32.

        Returns:
            out (B, Sq, out_dim) (or (Sq, B, out_dim)), and the weights with ``need_weights``.
        """
        self_attn = (key is None and value is None) or (key is query and value is query)
        if self_attn:
            key = value = query
        elif key is None or value is None:
            raise ValueError("pass both key and value for cross-attention, or neither for self-attention")
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) if isinstance(t, Tensor) and t.dim() == 3 else t
                                 for t in (query, key, value))
        self._check_input("query", query, self.embed_dim)
        if not self_attn:
            self._check_input("key", key, self.kdim)
            self._check_input("value", value, self.vdim)
        B, Sq, _ = query.shape
        if key.shape[:2] != value.shape[:2] or key.shape[0] != B:
            raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                             f"{tuple(value.shape)} must share the batch, and key/value the length")
        if cache is not None and not self.causal:
            raise ValueError("cache= needs a causal module (causal=True): a cache attends to the past")
        if self.rope is not None and not self_attn:
            raise ValueError("rope applies to self-attention (query and key share positions)")
        if self.fused_qkv and not self_attn:
            raise ValueError("this module has a fused qkv_proj (fused_qkv=True): it runs self-attention only; "
                             "call it with the query alone")
        angles = None
        if self.rope is not None:
            if positions is None:
                positions = cache.positions(Sq) if cache is not None else \
                    torch.arange(Sq, device=query.device)[None]
            angles = self.rope.angles(positions)  # validates once for q and k
        q, k, v = self.project(query, key, value, angles)  # (B, H, Sq, hd), (B, Hkv, Sk, hd), (B, Hkv, Sk, hdv)
        user_mask = as_mask(mask)
        if key_padding_mask is not None:
            # With a cache, the key length is the cache's; the mask's own check names it.
            kv_len = k.shape[2] if cache is None else None
            user_mask = and_masks(user_mask, torch_key_padding(key_padding_mask, B, kv_len))
        user_mask = and_masks(user_mask, window_mask(self.window, cache, B, q.device),
                              alibi_mask(self.alibi_slopes, cache, B, q.device) if self.alibi else None)
        kw = dict(dropout_p=self.dropout if self.training else 0.0, backend=self.backend,
                  return_weights=need_weights,
                  **attention_kwargs(scale=self.scale, softcap=self.softcap, sinks=self.sinks))
        if cache is None:
            res = attention(q, k, v, user_mask, causal=self.causal, **kw)
        else:  # the cache's own mask places each query after its sequence's past
            res = cache.attend(q, k, v, user_mask, **kw)
        out, weights = res if need_weights else (res, None)
        out = self.o_proj(out.transpose(1, 2).flatten(2))  # (B, Sq, H * hdv) -> (B, Sq, out_dim)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return (out, weights) if need_weights else out

    def project(self, query: Tensor, key: Tensor, value: Tensor, angles=None) -> tuple[Tensor, Tensor, Tensor]:
        """The heads this module attends with: q (B, H, Sq, hd), k (B, Hkv, Sk, hd), v (B, Hkv,
        Sk, hdv) from query (B, Sq, E), key (B, Sk, kdim), value (B, Sk, vdim) (batch first;
        the same tensor three times for self-attention, which a fused module requires),
        normalised (``qk_norm``) and rotated at ``angles`` (:class:`attnkit.rope.RotaryAngles`
        of this module's ``rope``; None: no rotation). What :meth:`forward` does before
        attention; wrappers that run the attention themselves (context parallelism) call it.

        Heads are split from the (B, S, heads * dim) projections as (B, S, heads, dim) views and
        normalised and rotated there; fused without QK-norm, q and k sit side by side and rotate
        in one call."""
        H, Hkv, hd, hdv = self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim
        if self.fused_qkv:
            nq, nk, nv = self._qkv_sizes
            qk, v = self.qkv_proj(query).split([nq + nk, nv], dim=-1)  # of (B, S, (H + Hkv) hd + Hkv hdv)
            v = v.unflatten(-1, (Hkv, hdv))
            if self.qk_norm is None:
                qk = qk.unflatten(-1, (H + Hkv, hd))  # (B, S, H + Hkv, hd)
                if angles is not None:
                    qk = self.rope.rotate(qk, angles, layout="bshd")
                q, k = qk.split([H, Hkv], dim=2)
                return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = qk.split([nq, nk], dim=-1)
        else:
            q, k = self.q_proj(query), self.k_proj(key)
            v = self.v_proj(value).unflatten(-1, (Hkv, hdv))
        if self.qk_norm == "full":  # OLMo 2: over the whole projected width
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.unflatten(-1, (H, hd)), k.unflatten(-1, (Hkv, hd))
        if self.qk_norm == "head":  # Qwen3, Gemma 3: over each head
            q, k = self.q_norm(q), self.k_norm(k)
        if angles is not None:
            q = self.rope.rotate(q, angles, layout="bshd")
            k = self.rope.rotate(k, angles, layout="bshd")
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def new_cache(self, kind: str = "dynamic", *, max_batch: int | None = None, max_len: int | None = None,
                  window: int | None = None, allocator=None, dtype: torch.dtype | None = None,
                  device=None, kv_dtype=None, k_channel_scale=None) -> KVCache:
        """An empty cache shaped for this module (Hkv heads, hd / hdv), in the weights' dtype and
        device unless given: "dynamic", "static" (needs max_batch, max_len), "sliding" (needs
        max_batch; window defaults to the module's) or "paged" (needs the :class:`~attnkit.caches.BlockAllocator` that
        all layers of a model share). ``kv_dtype`` ("int8", "fp8_e4m3") stores K/V quantized;
        ``k_channel_scale`` (None: on for int8; True / False; an (Hkv, hd) tensor) divides K by a
        fixed per-channel scale first (:class:`~attnkit.caches.KVCache`)."""
        w = self.o_proj.weight
        if window is None and kind == "sliding":
            window = self.window  # the module's own window
        return new_cache(kind, (self.num_kv_heads, self.head_dim, self.v_head_dim), max_batch=max_batch,
                         max_len=max_len, window=window, allocator=allocator, dtype=dtype or w.dtype,
                         device=device or w.device, kv_dtype=kv_dtype, k_channel_scale=k_channel_scale)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention) -> "MultiHeadAttention":
        """The same attention as a ``torch.nn.MultiheadAttention``, weights copied.

        Masks keep attnkit's meaning: torch's bool ``attn_mask`` (True = *not* allowed) becomes
        ``mask=~attn_mask``; float masks are the same; ``key_padding_mask`` keeps torch's meaning.
        """
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("nn.MultiheadAttention with add_bias_kv or add_zero_attn has no attnkit equivalent")
        p = mha.out_proj.weight
        m = cls(mha.embed_dim, mha.num_heads, kdim=mha.kdim, vdim=mha.vdim, bias=mha.in_proj_bias is not None,
                out_bias=mha.out_proj.bias is not None, dropout=mha.dropout, batch_first=mha.batch_first,
                device=p.device, dtype=p.dtype)
        with torch.no_grad():
            if mha.in_proj_weight is not None:
                wq, wk, wv = mha.in_proj_weight.chunk(3)
            else:
                wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
            for lin, w in ((m.q_proj, wq), (m.k_proj, wk), (m.v_proj, wv)):
                lin.weight.copy_(w)
            if mha.in_proj_bias is not None:
                for lin, b in zip((m.q_proj, m.k_proj, m.v_proj), mha.in_proj_bias.chunk(3)):
                    lin.bias.copy_(b)
            m.o_proj.weight.copy_(mha.out_proj.weight)
            if mha.out_proj.bias is not None:
                m.o_proj.bias.copy_(mha.out_proj.bias)
        return m


class GroupedQueryAttention(MultiHeadAttention):
    """:class:`MultiHeadAttention` with ``num_kv_heads`` required (GQA)."""

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int, **kwargs):
        super().__init__(embed_dim, num_heads, num_kv_heads=num_kv_heads, **kwargs)


class MultiQueryAttention(MultiHeadAttention):
    """:class:`MultiHeadAttention` with one key/value head (MQA)."""

    def __init__(self, embed_dim: int, num_heads: int, **kwargs):
        super().__init__(embed_dim, num_heads, num_kv_heads=1, **kwargs)
