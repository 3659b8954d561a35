"""``Decoder``: a small Llama-style language model built from attnkit's attention modules.

Notation: B batch, S new tokens this call, Sk keys attended to (cached + new), E hidden size,
V vocabulary, L layers.

One forward path: ``Decoder.forward`` -> every ``DecoderLayer`` -> its attention module ->
``cache.attend`` -> :func:`attnkit.attention`, for prefill, decode and training alike. With caches,
a forward is one explicit step of every layer's cache (:func:`attnkit.caches.step`): committed
in every layer when the forward returns, in none when it raises. RoPE cos/sin are looked up once
per forward (:meth:`attnkit.RotaryEmbedding.angles`) and shared by the layers.

Parameter names are Hugging Face's (``model.embed_tokens``, ``model.layers.{i}.self_attn.o_proj``,
``...mlp.down_proj``, ``...input_layernorm``, ``model.norm``, ``lm_head``). Fusion is explicit
(``DecoderConfig.fused_projections``, default True): the attention holds one ``qkv_proj`` and the
MLP one ``gate_up_proj`` (Phi-3's names); checkpoints with separate ``q_proj/k_proj/v_proj`` and
``gate_proj/up_proj`` load into them with ``strict=True`` through ``load_state_dict`` pre-hooks,
so Llama-family, Phi-3 and dense DeepSeek-V3 checkpoints load without renaming
(:func:`attnkit.models.load_pretrained`). ``state_dict()`` emits the model's own names.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import shape_of
from ..caches import DynamicCache, KVCache, PagedKVCache, StaticCache
from ..caches import step as cache_step
from ..modules import FusedLoadHook, MultiHeadAttention, RMSNorm
from ..modules.linear import Linear
from ..modules.mla import MLAConfig, MultiHeadLatentAttention
from ..rope import RotaryEmbedding
from .checkpoints import read_pretrained
from .config import DecoderConfig
from .generation import GenerationMixin
from .indexer import IndexedLatentAttention, IndexedLatentCache, IndexerConfig

__all__ = ["Decoder", "RMSNorm", "GatedMLP", "SwiGLU", "DecoderLayer", "CACHE_KINDS", "ACTIVATIONS", "make_cache",
           "layer_cache_kind", "paged_allocator"]

#: Cache kinds :meth:`Decoder.new_caches` builds (one cache per layer; see :func:`layer_cache_kind`
#: for what each means per layer).
CACHE_KINDS = ("dynamic", "sliding", "static", "paged")


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: (B, S, E) -> (B, S, E), SwiGLU with
    ``activation="silu"`` (Llama, Mistral, Qwen, DeepSeek, Phi-3, OLMo 2), GeGLU with
    ``"gelu_pytorch_tanh"`` (Gemma).

    ``fused=True`` holds one ``gate_up_proj`` Linear (Phi-3's name; rows gate | up) and reads both
    weights in one matrix product; a ``load_state_dict`` pre-hook turns separate ``gate_proj`` /
    ``up_proj`` entries into it (and, unfused, a ``gate_up_proj`` entry into the two), so either
    checkpoint layout loads with ``strict=True``. ``state_dict()`` emits the module's own names.
    """

    def __init__(self, hidden: int, intermediate: int, *, bias: bool = False, activation: str = "silu",
                 fused: bool = False, device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {fused!r}")
        self.activation, self.fused, self.intermediate = activation, fused, intermediate
        self._act = ACTIVATIONS[activation]
        kw = {"bias": bias, "device": device, "dtype": dtype}
        if fused:
            self.gate_up_proj = Linear(hidden, 2 * intermediate, **kw)
        else:
            self.gate_proj = Linear(hidden, intermediate, **kw)
            self.up_proj = Linear(hidden, intermediate, **kw)
        self.down_proj = Linear(intermediate, hidden, **kw)
        self.register_load_state_dict_pre_hook(
            FusedLoadHook("gate_up_proj", ("gate_proj", "up_proj"), (intermediate, intermediate), to_fused=fused))

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self._act(gate) * up)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, fused={self.fused}"


#: MLP activations by Hugging Face's ``hidden_act`` names.
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}

#: The SwiGLU MLP of Llama-style decoders (a :class:`GatedMLP` with ``activation="silu"``).
SwiGLU = GatedMLP


def _norm(cfg: DecoderConfig, dim: int, device=None, dtype=None) -> RMSNorm:
    """An RMSNorm in the config's ``norm_style``."""
    return RMSNorm(dim, cfg.rms_norm_eps, unit_offset=cfg.norm_style == "gemma",
                   scale_in_fp32=cfg.norm_style == "olmo2", device=device, dtype=dtype)


def _build_attention(cfg: DecoderConfig, layer_type: str, rope: RotaryEmbedding | None, device, dtype) -> nn.Module:
    window = cfg.sliding_window if layer_type == "sliding_attention" else None
    variant = dict(scale=cfg.query_scale, softcap=cfg.attn_softcap, sinks=cfg.attention_sinks, window=window)
    if cfg.attention == "mla":
        mla_cfg = MLAConfig(
            hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank, rope_theta=cfg.rope_theta,
            rope_scaling=None if cfg.rope_scaling is None else dict(cfg.rope_scaling),
            rope_interleave=cfg.rope_interleave, max_position_embeddings=cfg.max_position_embeddings,
            attention_bias=cfg.attention_bias)  # its norms keep eps 1e-6, as in HF and DeepSeek code
        if cfg.index_topk is not None:  # DeepSeek-V3.2: full layers only (the config checks it)
            index_cfg = IndexerConfig(cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk)
            return IndexedLatentAttention(mla_cfg, index_cfg, device=device, dtype=dtype, scale=cfg.query_scale,
                                          softcap=cfg.attn_softcap, sinks=cfg.attention_sinks)
        return MultiHeadLatentAttention(mla_cfg, device=device, dtype=dtype, **variant)
    qk_norm_kw = None if cfg.qk_norm is None else dict(
        eps=cfg.rms_norm_eps, unit_offset=cfg.norm_style == "gemma", scale_in_fp32=cfg.norm_style == "olmo2")
    return MultiHeadAttention(cfg.hidden_size, cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                              head_dim=cfg.head_dim, bias=cfg.attention_bias, out_bias=cfg.attention_out_bias,
                              causal=True, rope=rope, fused_qkv=cfg.fused_projections, qk_norm=cfg.qk_norm or False,
                              qk_norm_kw=qk_norm_kw, device=device, dtype=dtype, **variant)


def paged_allocator(max_batch: int, max_len: int, block_size: int = 16):
    """A :class:`attnkit.caches.BlockAllocator` with room for ``max_batch`` sequences of
    ``max_len`` tokens, for the layers of one model to share."""
    from ..caches import BlockAllocator
    for name, v in (("max_batch", max_batch), ("max_len", max_len), ("block_size", block_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"a paged cache needs a positive int {name}, got {v!r}")
    return BlockAllocator(max_batch * -(-max_len // block_size), block_size)


def layer_cache_kind(attn: nn.Module, kind: str) -> str:
    """The cache one layer with attention module ``attn`` gets for the model-wide ``kind`` (the one
    place cache kinds are resolved; ``attn.new_cache`` of the result builds it):

    ============  ======================================  =========================================
    ``kind``      full-attention layer                    sliding-window layer (``attn.window``)
    ============  ======================================  =========================================
    "dynamic"     :class:`~attnkit.caches.DynamicCache`   DynamicCache: keeps every position, the
                                                          module masks the window
    "sliding"     DynamicCache                            :class:`~attnkit.caches.SlidingWindowCache`
                                                          of the layer's window (needs max_batch);
                                                          an MLA layer: its DynamicCache (latent
                                                          caches keep every position)
    "static"      :class:`~attnkit.caches.StaticCache`    StaticCache: keeps every position, masked
    "paged"       :class:`~attnkit.caches.PagedKVCache`   PagedKVCache: keeps every position, masked
    ============  ======================================  =========================================
    """
    if kind not in CACHE_KINDS:
        raise ValueError(f"cache must be one of {CACHE_KINDS} (or None for no cache), got {kind!r}")
    if kind == "sliding":
        return "sliding" if isinstance(attn, MultiHeadAttention) and attn.window else "dynamic"
    return kind


def make_cache(attn: nn.Module, kind: str, *, max_batch: int | None = None, max_len: int | None = None,
               dtype: torch.dtype | None = None, device=None, allocator=None, kv_dtype=None,
               k_channel_scale=None) -> KVCache:
    """One layer's empty cache of ``kind`` for the attention module ``attn`` (the one place the
    decoder creates caches; :func:`layer_cache_kind` says which cache each kind gives a layer).
    "dynamic" grows; "sliding" is "dynamic" except that a layer with a sliding window keeps a
    ring of just its window (:class:`attnkit.caches.SlidingWindowCache`, needs ``max_batch``);
    "static" preallocates (max_batch, max_len) and compiles without recompiles; "paged" keeps
    blocks of a pool managed by ``allocator`` (shared by the layers of a model; default: a
    private one sized by max_batch and max_len). ``kv_dtype`` ("int8", "fp8_e4m3") quantizes
    what the cache stores, ``k_channel_scale`` its K channel scale policy (:class:`attnkit.caches.KVCache`)."""
    kind = layer_cache_kind(attn, kind)
    if kind != "paged" and allocator is not None:
        raise TypeError(f"allocator= applies to paged caches, not to a {kind} cache")
    if kind == "paged" and allocator is None:
        allocator = paged_allocator(max_batch, max_len)
    if kind == "sliding":  # the module's own window (a ring of it)
        return attn.new_cache("sliding", max_batch=max_batch, dtype=dtype, device=device, kv_dtype=kv_dtype,
                              k_channel_scale=k_channel_scale)
    return attn.new_cache(kind, max_batch=max_batch, max_len=max_len, allocator=allocator, dtype=dtype,
                          device=device, kv_dtype=kv_dtype, k_channel_scale=k_channel_scale)


class DecoderLayer(nn.Module):
    """One block; where its RMSNorms sit is ``cfg.norm_placement``:

    * "pre" (Llama): ``h = x + attn(input_layernorm(x))``, ``h + mlp(post_attention_layernorm(h))``.
    * "sandwich" (Gemma 2 / 3): ``h = x + post_attention_layernorm(attn(input_layernorm(x)))``,
      ``h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``.
    * "post" (OLMo 2): ``h = x + post_attention_layernorm(attn(x))``,
      ``h + post_feedforward_layernorm(mlp(h))``.

    ``layer_type`` ("full_attention" / "sliding_attention") picks the attention's window.
    ``positions`` is what the attention module takes: (B, S) integer positions or the
    :class:`attnkit.rope.RotaryAngles` the decoder computed once for every layer.
    """

    def __init__(self, cfg: DecoderConfig, rope: RotaryEmbedding | None, *, layer_type: str = "full_attention",
                 device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.layer_type = layer_type
        self.placement = cfg.norm_placement
        self.self_attn = _build_attention(cfg, layer_type, rope, device, dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, activation=cfg.hidden_act,
                            fused=cfg.fused_projections, **kw)
        E = cfg.hidden_size
        if self.placement != "post":
            self.input_layernorm = _norm(cfg, E, **kw)
        self.post_attention_layernorm = _norm(cfg, E, **kw)
        if self.placement == "sandwich":
            self.pre_feedforward_layernorm = _norm(cfg, E, **kw)
        if self.placement != "pre":
            self.post_feedforward_layernorm = _norm(cfg, E, **kw)

    @property
    def rope(self) -> RotaryEmbedding | None:
        """The rotary embedding this layer's attention rotates with."""
        return self.self_attn.rope

    def forward(self, x: Tensor, *, positions, key_padding_mask: Tensor | None, cache, need_weights: bool):
        """x (B, S, E) -> (B, S, E), and the attention weights (B, H, S, Sk) or None."""
        pre = self.placement != "post"
        a = self.self_attn(self.input_layernorm(x) if pre else x, key_padding_mask=key_padding_mask,
                           positions=positions, cache=cache, need_weights=need_weights)
        a, w = a if need_weights else (a, None)
        if self.placement == "pre":
            h = x + a
            return h + self.mlp(self.post_attention_layernorm(h)), w
        h = x + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(h) if pre else h)
        return h + self.post_feedforward_layernorm(m), w


class _Backbone(nn.Module):
    """Hugging Face's ``model.`` prefix: embeddings, layers, final norm. Holds the rotary
    embeddings (``rope``; ``rope_local`` for sliding layers with their own RoPE), shared by the
    layers' attention modules."""

    def __init__(self, cfg: DecoderConfig, *, device=None, dtype=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        if cfg.embedding_multiplier is not None:  # rounded to the model's dtype, as Gemma does
            self.register_buffer("embed_scale", torch.tensor(cfg.embedding_multiplier, device=device, dtype=dtype),
                                 persistent=False)
        else:
            self.embed_scale = None
        self.rope = self.rope_local = None
        if cfg.attention != "mla":  # MLA modules own their (decoupled) RoPE
            self.rope = self._rope(cfg, cfg.rope_theta, cfg.rope_scaling, device)
            if cfg.local_rope_theta is not None:
                self.rope_local = self._rope(cfg, cfg.local_rope_theta, cfg.local_rope_scaling, device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rope_local if t == "sliding_attention" and self.rope_local is not None else self.rope,
                         layer_type=t, device=device, dtype=dtype)
            for t in cfg.layer_types)
        self.norm = _norm(cfg, cfg.hidden_size, device=device, dtype=dtype)

    @staticmethod
    def _rope(cfg: DecoderConfig, theta, scaling, device) -> RotaryEmbedding:
        rope = RotaryEmbedding(cfg.head_dim, base=theta, max_position_embeddings=cfg.max_position_embeddings,
                               scaling=None if scaling is None else dict(scaling), interleaved=cfg.rope_interleave)
        return rope.to(device) if device is not None else rope

    def embed(self, input_ids: Tensor) -> Tensor:
        """(B, S) ids -> (B, S, E) embeddings (times ``embedding_multiplier``)."""
        h = self.embed_tokens(input_ids)
        return h if self.embed_scale is None else h * self.embed_scale.to(h.dtype)


def _key_length(cache, tokens: int, num_new=None) -> int | None:
    """Keys the attention of a step of ``tokens`` new tokens per row, row b keeping ``num_new[b]``
    of them (default all), sees over ``cache`` (what a ``key_padding_mask`` must cover): a static
    cache's ``max_len``; a dynamic or paged cache's view reaches the longest row after the step,
    ``max(lengths + num_new)`` (ragged rows gaining different counts included). None where the
    cache's layout has no such columns. Reads the cache only (called before the step begins)."""
    if isinstance(cache, IndexedLatentCache):  # its views are the latent's
        cache = cache.latent
    if isinstance(cache, StaticCache):
        return cache.max_len
    if not isinstance(cache, (DynamicCache, PagedKVCache)):
        return None
    lengths = cache.lengths
    gain = torch.as_tensor(tokens if num_new is None else num_new, device=lengths.device).long()
    if not lengths.numel():  # nothing cached yet: the rows start at 0
        return int(gain.max()) if gain.numel() else 0
    if gain.dim() and gain.shape[0] != lengths.shape[0]:  # a batch the cache will refuse itself
        return int(lengths.max()) + tokens
    return int((lengths + gain).max())


def _key_rule(cache) -> str:
    """How :func:`_key_length` counts ``cache``'s keys (for the error message)."""
    base = cache.latent if isinstance(cache, IndexedLatentCache) else cache
    return "max_len" if isinstance(base, StaticCache) else "longest row after this step, max(lengths + num_new)"


class Decoder(nn.Module, GenerationMixin):
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
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype)
        if init_std is not None:
            self.init_weights(init_std)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Layers whose embeddings share a config share one lookup per forward: (rope, layer indices).
        groups: list[tuple[RotaryEmbedding, list[int]]] = []
        for i, layer in enumerate(self.model.layers):
            rope = layer.rope
            for g in groups:
                if rope is not None and (g[0] is rope or g[0].config == rope.config):
                    g[1].append(i)
                    break
            else:
                if rope is not None:
                    groups.append((rope, [i]))
        self._rope_of_layer = [None] * len(self.model.layers)
        for slot, (_, idx) in enumerate(groups):
            for i in idx:
                self._rope_of_layer[i] = slot

    def init_weights(self, std: float = 0.02) -> None:
        """Llama's initialisation: N(0, std) for projections and embeddings, zero biases, unit
        norms (Gemma-style ``1 + weight`` norms: zero weights). (Modules of the attention variant
        keep their own norms' initialisation.)"""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight.normal_(0.0, std)
                    if getattr(m, "bias", None) is not None:
                        m.bias.zero_()
                elif isinstance(m, RMSNorm):
                    m.reset_parameters()

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

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None, kv_dtype=None) -> int:
        """KV-cache bytes one token of one sequence takes across all layers (in ``dtype``,
        default the weights' dtype; quantized with ``kv_dtype`` "int8" / "fp8_e4m3": data plus
        fp32 scales), read from the caches themselves."""
        return sum(make_cache(layer.self_attn, "dynamic", dtype=dtype or self.dtype, device="cpu",
                              kv_dtype=kv_dtype).bytes_per_token
                   for layer in self.model.layers)

    # ------------------------------------------------------------------ caches

    def new_caches(self, kind: str = "dynamic", *, max_batch: int | None = None, max_len: int | None = None,
                   dtype: torch.dtype | None = None, device=None, block_size: int = 16,
                   kv_dtype=None, k_channel_scale=None) -> list[KVCache]:
        """One empty cache per layer (what each ``kind`` gives each layer: :func:`layer_cache_kind`),
        in the weights' dtype and device. "dynamic" is a :class:`~attnkit.caches.DynamicCache` in
        every layer; "sliding" gives sliding-window layers a ring of just their window
        (:class:`~attnkit.caches.SlidingWindowCache`, needs ``max_batch``) and the others a
        DynamicCache; "static" and "paged" need ``max_batch`` and ``max_len``; paged layers share
        one block allocator (one block table for the model) of ``block_size``-token blocks.
        ``kv_dtype`` ("int8", "fp8_e4m3"; None: the caches' dtype) quantizes every layer's cache.
        ``k_channel_scale``: the quantized caches' K channel scales (:class:`~attnkit.caches.KVCache`):
        None (on for int8, off for fp8), True, False or one (Hkv, D) tensor for every layer, or a
        list with one entry per layer (None, a bool, or that layer's calibrated tensor)."""
        dtype, device = dtype or self.dtype, device or self.device
        layers = self.model.layers
        if isinstance(k_channel_scale, (list, tuple)):
            if len(k_channel_scale) != len(layers):
                raise ValueError(f"k_channel_scale has {len(k_channel_scale)} entries for {len(layers)} layers "
                                 f"(give one per layer, or one None / bool for all)")
            per_layer = list(k_channel_scale)
        else:
            per_layer = [k_channel_scale] * len(layers)
        alloc = paged_allocator(max_batch, max_len, block_size) if kind == "paged" else None
        return [make_cache(layer.self_attn, kind, max_batch=max_batch, max_len=max_len, dtype=dtype,
                           device=device, allocator=alloc, kv_dtype=kv_dtype, k_channel_scale=c)
                for layer, c in zip(layers, per_layer)]

    # ------------------------------------------------------------------ forward

    def forward(self, input_ids: Tensor, *, positions: Tensor | None = None,
                key_padding_mask: Tensor | None = None, caches: Sequence[KVCache] | None = None,
                num_new=None, need_weights: bool = False, logits_to_keep: int = 0):
        """Logits for ``input_ids``.

        Args:
            input_ids: (B, S) token ids.
            positions: (B, S) (or (1, S)) positions for RoPE; default: after what ``caches``
                hold (each row at its own length), else 0..S-1.
            key_padding_mask: (B, Sk) bool, True = a padding key to ignore, over every key
                attended to (for a static cache: its whole capacity; a dynamic or paged one: its
                longest row after this call, ``max(lengths + num_new)``; no cache: S).
            caches: one cache per layer (:meth:`new_caches`). The call is one step of all of
                them: committed in every layer when it returns, in none if it raises.
            num_new: (B,) ints (or an int): row b's real tokens are its first ``num_new[b]``
                of the S (the rest is right padding): its caches gain ``num_new[b]`` tokens, and
                ``logits_to_keep`` counts back from its last real token. Default: all S.
            need_weights: also return each layer's attention weights (B, H, S, Sk), fp32.
            logits_to_keep: compute logits for the last n positions of each row only (0: all).

        Returns:
            logits (B, S', V) in the model's dtype (S' = S or ``logits_to_keep``), and the list
            of per-layer weights with ``need_weights``.

        Everything that can be checked before the first layer runs is (ids, positions, masks,
        ``num_new``, ``logits_to_keep``, the caches), so a bad call raises before any cache is
        touched; a failure inside a layer aborts the step in every layer.
        """
        B, S = self._check_forward(input_ids, positions, key_padding_mask, caches, num_new, logits_to_keep)
        layers = self.model.layers
        if positions is None:
            positions = caches[0].positions(S) if caches is not None else \
                torch.arange(S, device=input_ids.device)[None]
        angles = self._angles(positions)  # validates the positions once, before any cache changes
        if caches is None:
            h, weights = self._layers(input_ids, angles, positions, key_padding_mask, [None] * len(layers),
                                      need_weights)
        else:
            with cache_step(caches, batch=B, tokens=S, num_new=num_new) as bound:
                h, weights = self._layers(input_ids, angles, positions, key_padding_mask, bound, need_weights)
        h = self._keep(h, num_new, logits_to_keep)
        logits = self.lm_head(self.model.norm(h))
        cap = self.config.final_softcap
        if cap is not None:  # Gemma 2: c * tanh(logits / c)
            logits = torch.tanh(logits / cap) * cap
        return (logits, weights) if need_weights else logits

    def _layers(self, input_ids, angles, positions, key_padding_mask, caches, need_weights):
        h = self.model.embed(input_ids)
        weights = []
        for layer, slot, cache in zip(self.model.layers, self._rope_of_layer, caches):
            h, w = layer(h, positions=positions if slot is None else angles[slot],
                         key_padding_mask=key_padding_mask, cache=cache, need_weights=need_weights)
            weights.append(w)
        return h, weights

    def _angles(self, positions: Tensor) -> list:
        """The :class:`RotaryAngles` of ``positions`` for each rope group (validated here, once)."""
        out: list = []
        for layer, slot in zip(self.model.layers, self._rope_of_layer):
            if slot is not None and slot == len(out):
                out.append(layer.rope.angles(positions))
        return out

    @staticmethod
    def _keep(h: Tensor, num_new, n: int) -> Tensor:
        """The last ``n`` positions of each row (of its real tokens with ``num_new``); n = 0: all."""
        if not n:
            return h
        if num_new is None:
            return h[:, -n:]
        B, S, _ = h.shape
        last = torch.as_tensor(num_new, device=h.device).long().expand(B)  # (B,)
        cols = (last[:, None] - n + torch.arange(n, device=h.device)).clamp(0, max(S - 1, 0))  # (B, n)
        return h.gather(1, cols[..., None].expand(B, n, h.shape[-1]))

    def _check_forward(self, input_ids, positions, key_padding_mask, caches, num_new, logits_to_keep):
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point \
                or input_ids.dtype == torch.bool or input_ids.is_complex():
            raise ValueError(f"input_ids must be a (B, S) integer tensor, got "
                             f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} of shape "
                             f"{shape_of(input_ids)}")
        B, S = input_ids.shape
        V = self.config.vocab_size
        if input_ids.numel() and not torch.compiler.is_compiling():
            lo, hi = (int(v) for v in input_ids.aminmax())  # one host sync
            if lo < 0 or hi >= V:
                raise ValueError(f"input_ids must be in [0, vocab_size={V}), got values from {lo} to {hi}")
        if positions is not None and (not isinstance(positions, Tensor) or positions.dim() != 2
                                      or positions.shape[0] not in (1, B) or positions.shape[1] != S):
            raise ValueError(f"positions must be (B, S) = ({B}, {S}) or (1, {S}) like input_ids, got "
                             f"shape {shape_of(positions)}")
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0, got {logits_to_keep!r}")
        layers = self.model.layers
        if caches is not None:
            if isinstance(caches, (KVCache, Tensor)) or not isinstance(caches, Sequence):
                raise TypeError(f"caches must be a list with one cache per layer (Decoder.new_caches()), got "
                                f"{type(caches).__name__}")
            if len(caches) != len(layers):
                raise ValueError(f"caches has {len(caches)} entries, the model has {len(layers)} layers")
            bad = [i for i, c in enumerate(caches) if not isinstance(c, KVCache)]
            if bad:
                raise TypeError(f"caches[{bad[0]}] is a {type(caches[bad[0]]).__name__}, not an attnkit KVCache")
        if num_new is not None and not torch.compiler.is_compiling():
            n = torch.as_tensor(num_new)
            if n.dtype.is_floating_point or n.dtype == torch.bool or n.is_complex() or n.shape not in ((), (B,)):
                raise ValueError(f"num_new must be an int or a (B,) = ({B},) integer tensor, got {n.dtype} of "
                                 f"shape {tuple(n.shape)}")
            if n.numel() and (int(n.min()) < 0 or int(n.max()) > S):
                raise ValueError(f"num_new must be in [0, S={S}], got {n.tolist()}")
        if key_padding_mask is not None:
            kpm = key_padding_mask
            if not isinstance(kpm, Tensor) or kpm.dim() != 2 or kpm.shape[0] != B:
                raise ValueError(f"key_padding_mask must be a (B, Sk) tensor with B={B}, got shape "
                                 f"{shape_of(kpm)}")
            if kpm.dtype != torch.bool and not kpm.dtype.is_floating_point:
                raise TypeError(f"key_padding_mask must be bool (True = padding) or float (added), got {kpm.dtype}")
            if torch.compiler.is_compiling():
                return B, S
            for i, c in enumerate([None] if caches is None else caches):
                want = S if c is None else _key_length(c, S, num_new)
                if c is not None and want is None:
                    raise ValueError(f"key_padding_mask cannot apply to caches[{i}] ({type(c).__name__}), whose "
                                     f"keys are not positions 0..Sk-1; pass num_new= for right-padded rows instead")
                if kpm.shape[1] != want:
                    where = "S (no caches)" if c is None else \
                        f"caches[{i}]'s key length ({type(c).__name__}: {_key_rule(c)})"
                    raise ValueError(f"key_padding_mask has {kpm.shape[1]} columns, but this call attends over "
                                     f"{want} keys ({where})")
        return B, S

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path, *, dtype: torch.dtype | None = None, device=None) -> "Decoder":
        """See :func:`attnkit.models.load_pretrained`."""
        ckpt = read_pretrained(path, dtype=dtype)
        model = cls(ckpt.config, dtype=ckpt.dtype, device=device, init_std=None)
        try:
            model.load_state_dict(ckpt.state_dict, strict=True)
        except RuntimeError as e:
            kind = ckpt.hf_config["model_type"]
            raise ValueError(f"{ckpt.path}: the checkpoint does not match attnkit's {kind} decoder (strict name and "
                             f"shape matching):\n{e}") from None
        model.hf_config = ckpt.hf_config
        return model.eval()
