"""``Decoder``: a small Llama-style language model built from attnkit's attention modules.

Notation: B batch, S new tokens this call, Sk keys attended to (cached + new), E hidden size,
V vocabulary, L layers.

Parameter names are Hugging Face's (``model.embed_tokens``, ``model.layers.{i}.self_attn.q_proj``,
``...mlp.gate_proj``, ``...input_layernorm``, ``model.norm``, ``lm_head``), so Llama-family and
dense DeepSeek-V3 checkpoints load with ``strict=True`` and no renaming
(:func:`attnkit.models.load_pretrained`).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..caches import KVCache
from ..caches import step as cache_step
from ..functional import attention
from ..masks import KeyPadding
from ..modules import MultiHeadAttention
from ..rope import RotaryEmbedding, _apply_rotary
from .config import DecoderConfig

__all__ = ["Decoder", "RMSNorm", "SwiGLU", "DecoderLayer", "CACHE_KINDS", "make_cache", "paged_allocator"]

#: Cache kinds :meth:`Decoder.new_caches` builds (one cache per layer).
CACHE_KINDS = ("dynamic", "static", "paged")


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in fp32 and cast back, then scaled
    (Hugging Face's ``LlamaRMSNorm`` / ``DeepseekV3RMSNorm``)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:  # skip two no-op casts (they cost dispatches every step)
            return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``: (B, S, E) -> (B, S, E)."""

    def __init__(self, hidden: int, intermediate: int, *, bias: bool = False, device=None, dtype=None):
        super().__init__()
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden, intermediate, **kw)
        self.up_proj = nn.Linear(hidden, intermediate, **kw)
        self.down_proj = nn.Linear(intermediate, hidden, **kw)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _TableRotary(RotaryEmbedding):
    """A :class:`RotaryEmbedding` that reads cos/sin from a table of positions ``0..n-1``
    (grown on demand) instead of recomputing them in every layer of every step.

    The decoder calls :meth:`prepare` once per forward: the positions are validated once and
    their cos/sin gathered once; every layer's ``rope(q, k, positions)`` with that same
    positions tensor reuses them. Other calls take the validated path. Dynamic NTK (whose
    frequencies depend on the call's longest position) always computes directly.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        R = self.rotary_dim
        self.register_buffer("cos_table", torch.zeros(0, R), persistent=False)
        self.register_buffer("sin_table", torch.zeros(0, R), persistent=False)
        # sin with the sign of each pair's partner folded in (see _rotate_signed).
        self.register_buffer("sin_signed_table", torch.zeros(0, R), persistent=False)
        self._prepared: tuple[Tensor, Tensor, Tensor] | None = None
        # Cover the usual lengths up front, so a compiled forward (which cannot grow the table)
        # works out of the box; generation reserves what it needs before compiling.
        self.reserve(min(self.config.max_position_embeddings or 256, 4096))

    @property
    def uses_table(self) -> bool:
        return self.rope_type != "dynamic"

    def reserve(self, n: int) -> None:
        """Make the table cover positions ``0 .. n - 1`` (doubling, so growth is amortised)."""
        if self.cos_table.dtype != torch.float32:  # the module was cast (model.to(bf16)): rebuild in fp32
            self.cos_table = self.sin_table = self.sin_signed_table = torch.zeros(
                0, self.rotary_dim, device=self.cos_table.device)
        have = self.cos_table.shape[0]
        if n <= have or not self.uses_table:
            return
        n = max(n, 2 * have, 256)
        pos = torch.arange(n, device=self.inv_freq.device)[None]
        cos, sin = self._cos_sin(pos)
        self.cos_table, self.sin_table = cos[0], sin[0]
        sign = torch.ones(self.rotary_dim, device=sin.device)
        if self.interleaved:
            sign[0::2] = -1.0
        else:
            sign[: self.rotary_dim // 2] = -1.0
        self.sin_signed_table = sin[0] * sign

    def signed_lookup(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and signed sin (B, S, R) for trusted positions the table covers (fast decode)."""
        return self.cos_table[positions], self.sin_signed_table[positions]

    def _lookup(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin (B, S, R) fp32 for positions already validated and covered by the table."""
        if not self.uses_table:
            return self._cos_sin(positions)
        positions = positions.to(self.cos_table.device)
        return self.cos_table[positions], self.sin_table[positions]

    def prepare(self, positions: Tensor) -> None:
        """Validate ``positions`` (B|1, S) once and gather their cos/sin for every layer.
        Under ``torch.compile`` nothing is stashed: each layer gathers from the table (which the
        caller has reserved) and the compiler merges the identical lookups."""
        if torch.compiler.is_compiling():
            return
        positions = self._check_positions(positions)
        self.reserve(int(positions.max()) + 1 if positions.numel() else 0)
        self._prepared = (positions, *self._lookup(positions))

    def release(self) -> None:
        self._prepared = None

    def forward(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        if torch.compiler.is_compiling() and self.uses_table:
            cos, sin = self._lookup(positions)
        else:
            prep = self._prepared
            if prep is None or prep[0] is not positions:
                return super().forward(q, k, positions)
            _, cos, sin = prep
        cos, sin = cos.to(q.device), sin.to(q.device)
        return _apply_rotary(q, cos, sin, self.interleaved), _apply_rotary(k, cos, sin, self.interleaved)


def _rotate_signed(x: Tensor, cos: Tensor, sin_signed: Tensor, interleaved: bool) -> Tensor:
    """RoPE as ``x * cos + partner(x) * sin_signed`` (fp32 for low-precision x, cast back).

    ``partner`` swaps the two halves (rotate-half) or the two members of each pair
    (interleaved); the minus sign of the rotation lives in ``sin_signed``. One roll/flip instead
    of slicing, negating and concatenating; the products are the same floats as
    :func:`attnkit.rope.apply_rotary`'s (``-a * b == a * -b`` exactly)."""
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    partner = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) if interleaved else xf.roll(x.shape[-1] // 2, -1)
    out = xf * cos + partner * sin_signed
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _packed(owner: nn.Module, key: str, linears: tuple[nn.Linear, ...]) -> tuple[Tensor, Tensor | None]:
    """See :meth:`DecoderLayer.packed_weights`."""
    cache = owner.__dict__.setdefault("_packs", {})
    names = ("weight", "bias") if linears[0].bias is not None else ("weight",)
    params = [[getattr(lin, n) for lin in linears] for n in names]
    ptrs = tuple(p.data_ptr() for group in params for p in group)
    hit = cache.get(key)
    if hit is not None and hit[0] == ptrs:
        return hit[1], hit[2]
    first = params[0][0]
    plain = all(type(p) is nn.Parameter and p.layout == torch.strided and p.is_contiguous()
                and p.dtype == first.dtype and p.device == first.device for group in params for p in group)
    if not plain:  # e.g. tensor subclasses: no storage tricks, just concatenate
        cat = [torch.cat([p.detach() for p in group]) for group in params]
        return cat[0], (cat[1] if len(cat) > 1 else None)
    fused = []
    with torch.inference_mode(False), torch.no_grad():  # normal tensors: they become parameters' storage
        for group in params:
            whole = torch.cat([p.detach() for p in group])
            for p, part in zip(group, whole.split([p.shape[0] for p in group])):
                p.data = part
            fused.append(whole)
    w, b = fused[0], (fused[1] if len(fused) > 1 else None)
    cache[key] = (tuple(p.data_ptr() for group in params for p in group), w, b)
    return w, b


def _mla_classes():
    try:
        from ..modules.mla import MLAConfig, MultiHeadLatentAttention
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(f"attention='mla' needs attnkit.modules.mla (MultiHeadLatentAttention, "
                          f"MLAConfig), which failed to import: {e}") from e
    return MLAConfig, MultiHeadLatentAttention


def _build_attention(cfg: DecoderConfig, rope: RotaryEmbedding | None, device, dtype) -> nn.Module:
    if cfg.attention == "mla":
        MLAConfig, MultiHeadLatentAttention = _mla_classes()
        mla_cfg = MLAConfig(
            hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank, rope_theta=cfg.rope_theta,
            rope_scaling=None if cfg.rope_scaling is None else dict(cfg.rope_scaling),
            rope_interleave=cfg.rope_interleave, max_position_embeddings=cfg.max_position_embeddings,
            attention_bias=cfg.attention_bias)  # its norms keep eps 1e-6, as in HF and DeepSeek code
        return MultiHeadLatentAttention(mla_cfg, device=device, dtype=dtype)
    return MultiHeadAttention(cfg.hidden_size, cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                              head_dim=cfg.head_dim, bias=cfg.attention_bias, out_bias=cfg.attention_out_bias,
                              causal=True, rope=rope, device=device, dtype=dtype)


def paged_allocator(max_batch: int, max_len: int, block_size: int = 16):
    """A :class:`attnkit.caches.paged.BlockAllocator` with room for ``max_batch`` sequences of
    ``max_len`` tokens, for the layers of one model to share."""
    from ..caches.paged import BlockAllocator
    for name, v in (("max_batch", max_batch), ("max_len", max_len), ("block_size", block_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"a paged cache needs a positive int {name}, got {v!r}")
    return BlockAllocator(max_batch * -(-max_len // block_size), block_size)


def make_cache(attn: nn.Module, kind: str, *, max_batch: int | None = None, max_len: int | None = None,
               dtype: torch.dtype | None = None, device=None, allocator=None) -> KVCache:
    """One layer's empty cache of ``kind`` for the attention module ``attn`` (the one place the
    decoder creates caches). "dynamic" grows; "static" preallocates (max_batch, max_len) and
    compiles without recompiles; "paged" keeps blocks of a pool managed by ``allocator``
    (shared by the layers of a model; default: a private one sized by max_batch and max_len)."""
    if kind not in CACHE_KINDS:
        raise ValueError(f"cache must be one of {CACHE_KINDS} (or None for no cache), got {kind!r}")
    if kind != "paged" and allocator is not None:
        raise TypeError(f"allocator= applies to paged caches, not to a {kind} cache")
    if kind == "paged" and allocator is None:
        allocator = paged_allocator(max_batch, max_len)
    return attn.new_cache(kind, max_batch=max_batch, max_len=max_len, allocator=allocator, dtype=dtype,
                          device=device)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``h + mlp(norm(h))``."""

    def __init__(self, cfg: DecoderConfig, rope: RotaryEmbedding | None, *, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.self_attn = _build_attention(cfg, rope, device, dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, **kw)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)

    def forward(self, x: Tensor, *, positions: Tensor, key_padding_mask: Tensor | None,
                cache: KVCache | None, need_weights: bool):
        a = self.self_attn(self.input_layernorm(x), key_padding_mask=key_padding_mask, positions=positions,
                           cache=cache, need_weights=need_weights)
        a, w = a if need_weights else (a, None)
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h)), w

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_packs"}  # rebuilt on first use

    def decode_step(self, x: Tensor, rope: tuple[Tensor, Tensor, bool], cache: KVCache, start: int,
                    key_valid: Tensor | None) -> Tensor:
        """One token per sequence through this layer, for uniform Dynamic/Static caches holding
        ``start`` tokens (the fast path of generation; :meth:`forward` is the general one).

        Args:
            x: (B, 1, E). rope: (cos, signed sin) (B, 1, 1, D) and the interleaved flag.
            key_valid: (B, start + 1) bool, False = padding key; None when nothing is padded.
        """
        attn: MultiHeadAttention = self.self_attn
        B = x.shape[0]
        H, Hkv, D, Dv = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.v_head_dim
        (w_qkv, b_qkv), (w_gu, b_gu) = self.packed_weights()
        h = self.input_layernorm(x)
        q, k, v = F.linear(h, w_qkv, b_qkv).split([H * D, Hkv * D, Hkv * Dv], -1)  # one weight stream
        cos, sin_signed, interleaved = rope
        q = _rotate_signed(q.view(B, 1, H, D), cos, sin_signed, interleaved).transpose(1, 2)  # (B, H, 1, D)
        k = _rotate_signed(k.view(B, 1, Hkv, D), cos, sin_signed, interleaved).transpose(1, 2)
        k_all, v_all = cache.append_uniform(k, v.view(B, 1, Hkv, Dv).transpose(1, 2), start)
        # One new query per sequence sees every cached key: no causal mask; padding keys masked.
        mask = None if key_valid is None else KeyPadding(valid=key_valid)
        o = attention(q, k_all, v_all, mask, backend=attn.backend)
        h = x + attn.o_proj(o.transpose(1, 2).reshape(B, 1, H * Dv))
        gate, up = F.linear(self.post_attention_layernorm(h), w_gu, b_gu).chunk(2, -1)
        return h + self.mlp.down_proj(F.silu(gate) * up)

    def packed_weights(self) -> tuple[tuple[Tensor, Tensor | None], tuple[Tensor, Tensor | None]]:
        """(W, b) of q|k|v and of gate|up as single matrices, for one matrix product each.

        The parameters themselves become row blocks of these matrices (``param.data`` is set to
        a view; the Parameter objects, their names, values and ``requires_grad`` stay), so nothing
        is stored twice and in-place updates (``load_state_dict``, optimizer steps) show in both.
        Packing happens on first use and again whenever a parameter was replaced (``.to()``);
        parameters that are not plain dense tensors are concatenated per call instead.
        """
        attn = self.self_attn
        return (_packed(self, "_qkv", (attn.q_proj, attn.k_proj, attn.v_proj)),
                _packed(self, "_gate_up", (self.mlp.gate_proj, self.mlp.up_proj)))


class _Backbone(nn.Module):
    """Hugging Face's ``model.`` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: DecoderConfig, *, device=None, dtype=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.rope = None
        if cfg.attention != "mla":  # MLA modules own their (decoupled) RoPE
            self.rope = _TableRotary(cfg.head_dim, base=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
                                     scaling=None if cfg.rope_scaling is None else dict(cfg.rope_scaling),
                                     interleaved=cfg.rope_interleave)
            if device is not None:
                self.rope.to(device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rope, device=device, dtype=dtype)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)


class Decoder(nn.Module):
    """A Llama-style decoder whose attention is any attnkit variant (:class:`DecoderConfig`).

    ``forward(input_ids, ...)`` gives logits; :meth:`generate` / :meth:`stream` generate with a
    KV cache; :meth:`from_pretrained` loads a Hugging Face checkpoint directory.

    Example::

        >>> import torch
        >>> from attnkit.models import Decoder, DecoderConfig
        >>> model = Decoder(DecoderConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
        ...                               attention="gqa", num_kv_heads=2)).eval()
        >>> model(torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 64])
        >>> out = model.generate([[1, 2, 3], [4, 5]], max_new_tokens=4)
        >>> [len(t) for t in out.tokens]
        [4, 4]
    """

    def __init__(self, config: DecoderConfig, *, device=None, dtype=None, init_std: float | None = 0.02):
        super().__init__()
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        self.config = config
        self.model = _Backbone(config, device=device, dtype=dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype)
        if init_std is not None:
            self.init_weights(init_std)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._compiled_steps: dict = {}

    def __getstate__(self):
        # Compiled decode steps and their cache pool are per-process helpers: never pickled or
        # deep-copied (copy.deepcopy(model), torch.save(model)).
        return {**self.__dict__, "_compiled_steps": {}}

    def init_weights(self, std: float = 0.02) -> None:
        """Llama's initialisation: N(0, std) for projections and embeddings, zero biases, unit
        norms. (Modules of the attention variant keep their own norms' initialisation.)"""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight.normal_(0.0, std)
                    if getattr(m, "bias", None) is not None:
                        m.bias.zero_()
                elif isinstance(m, RMSNorm):
                    m.weight.fill_(1.0)

    # ------------------------------------------------------------------ info

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        """Distinct parameters (a tied head counts once); optionally without embedding/head."""
        seen, total = set(), 0
        skip = {id(self.model.embed_tokens.weight), id(self.lm_head.weight)} if exclude_embeddings else set()
        for p in self.parameters():
            if id(p) not in seen and id(p) not in skip:
                seen.add(id(p))
                total += p.numel()
        return total

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """KV-cache bytes one token of one sequence takes across all layers (in ``dtype``,
        default the weights' dtype), read from the caches themselves."""
        return sum(make_cache(layer.self_attn, "dynamic", dtype=dtype or self.dtype, device="cpu").bytes_per_token
                   for layer in self.model.layers)

    # ------------------------------------------------------------------ caches

    def new_caches(self, kind: str = "dynamic", *, max_batch: int | None = None, max_len: int | None = None,
                   dtype: torch.dtype | None = None, device=None, block_size: int = 16) -> list[KVCache]:
        """One empty cache per layer (see :func:`make_cache`), in the weights' dtype and device.
        "static" and "paged" need ``max_batch`` and ``max_len``; paged layers share one block
        allocator (one block table for the model) of ``block_size``-token blocks."""
        dtype, device = dtype or self.dtype, device or self.device
        alloc = paged_allocator(max_batch, max_len, block_size) if kind == "paged" else None
        return [make_cache(layer.self_attn, kind, max_batch=max_batch, max_len=max_len, dtype=dtype,
                           device=device, allocator=alloc) for layer in self.model.layers]

    # ------------------------------------------------------------------ forward

    def forward(self, input_ids: Tensor, *, positions: Tensor | None = None,
                key_padding_mask: Tensor | None = None, caches: Sequence[KVCache] | None = None,
                need_weights: bool = False, logits_to_keep: int = 0):
        """Logits for ``input_ids``.

        Args:
            input_ids: (B, S) token ids.
            positions: (B, S) (or (1, S)) positions for RoPE; default: after what ``caches``
                hold, else 0..S-1. Left-padded batches pass positions that skip the padding.
            key_padding_mask: (B, Sk) bool, True = a padding key to ignore, over every key
                attended to (for a static cache: its whole capacity).
            caches: one cache per layer (:meth:`new_caches`); this call's keys are appended.
            need_weights: also return each layer's attention weights (B, H, S, Sk), fp32.
            logits_to_keep: compute logits for the last n positions only (0: all).

        Returns:
            logits (B, S', V) in the model's dtype (S' = S or ``logits_to_keep``), and the list
            of per-layer weights with ``need_weights``.
        """
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ValueError(f"input_ids must be a (B, S) integer tensor, got "
                             f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} of shape "
                             f"{tuple(getattr(input_ids, 'shape', ()))}")
        B, S = input_ids.shape
        V = self.config.vocab_size
        if input_ids.numel() and not torch.compiler.is_compiling() and \
                bool(((input_ids < 0) | (input_ids >= V)).any()):
            raise ValueError(f"input_ids must be in [0, vocab_size={V}), got values from "
                             f"{int(input_ids.min())} to {int(input_ids.max())}")
        if positions is not None and (not isinstance(positions, Tensor) or positions.dim() != 2
                                      or positions.shape[0] not in (1, B) or positions.shape[1] != S):
            raise ValueError(f"positions must be (B, S) = ({B}, {S}) or (1, {S}) like input_ids, got "
                             f"shape {tuple(getattr(positions, 'shape', ()))}")
        if isinstance(logits_to_keep, bool):
            raise ValueError(f"logits_to_keep must be an int >= 0, got {logits_to_keep!r}")
        layers = self.model.layers
        if caches is not None and len(caches) != len(layers):
            raise ValueError(f"caches has {len(caches)} entries, the model has {len(layers)} layers")
        if not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0, got {logits_to_keep!r}")
        if positions is None:
            positions = caches[0].positions(S) if caches is not None else \
                torch.arange(S, device=input_ids.device)[None]
        rope = self.model.rope
        if rope is not None:
            rope.prepare(positions)
        try:
            h = self.model.embed_tokens(input_ids)
            weights = []
            # One step for every layer's cache: committed in all of them, or (on any error) none.
            steps = contextlib.nullcontext([None] * len(layers)) if caches is None else \
                cache_step(caches, batch=B, tokens=S)
            with steps as bound:
                for i, layer in enumerate(layers):
                    h, w = layer(h, positions=positions, key_padding_mask=key_padding_mask, cache=bound[i],
                                 need_weights=need_weights)
                    weights.append(w)
        finally:
            if rope is not None:
                rope.release()
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(self.model.norm(h))
        return (logits, weights) if need_weights else logits

    def supports_fast_decode(self, caches: Sequence[KVCache] | None) -> bool:
        """True when :meth:`decode_step` applies: MHA/GQA/MQA layers (with the table RoPE)
        over DynamicCache / StaticCache caches."""
        return False  # the lean step is being replaced by the one forward path

    def decode_step(self, tokens: Tensor, positions: Tensor, caches: Sequence[KVCache], start: int,
                    key_valid: Tensor | None = None) -> Tensor:
        """Logits (B, V) of the next token after feeding one token per sequence, the eager fast
        path of generation: every cache holds ``start`` tokens for every sequence (uniform, as
        left-padded generation keeps them), ``positions`` (B, 1) are valid RoPE positions the
        table covers (see :meth:`supports_fast_decode`). Equal to ``forward(tokens,
        positions=positions, key_padding_mask=~key_valid, caches=caches)[:, -1]`` up to
        floating-point reassociation, with a fraction of the per-step Python and dispatch work.
        """
        rope = self.model.rope
        rope.reserve(start + 1)
        cos, sin_signed = rope.signed_lookup(positions)
        rope_args = (cos[:, :, None], sin_signed[:, :, None], rope.interleaved)  # (B, 1, 1, D)
        h = self.model.embed_tokens(tokens)
        for layer, cache in zip(self.model.layers, caches):
            h = layer.decode_step(h, rope_args, cache, start, key_valid)
        return self.lm_head(self.model.norm(h))[:, -1]

    # ------------------------------------------------------------------ generation & loading

    def generate(self, prompts, max_new_tokens: int = 32, **kwargs):
        """See :func:`attnkit.models.generate`."""
        from .generation import generate
        return generate(self, prompts, max_new_tokens, **kwargs)

    def stream(self, prompts, max_new_tokens: int = 32, **kwargs):
        """See :func:`attnkit.models.stream`."""
        from .generation import stream
        return stream(self, prompts, max_new_tokens, **kwargs)

    @classmethod
    def from_pretrained(cls, path, *, dtype: torch.dtype | None = None, device=None) -> "Decoder":
        """See :func:`attnkit.models.load_pretrained`."""
        from .loading import load_pretrained
        return load_pretrained(path, dtype=dtype, device=device)
