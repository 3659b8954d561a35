"""``DecoderConfig``: the frozen, self-validating description of a :class:`attnkit.models.Decoder`.

``attention`` picks the variant; everything else (embedding, RMSNorm, SwiGLU MLP, head) is shared:

=========  =====================================================================================
``"mha"``  ``num_kv_heads == num_heads`` (default): every query head has its own K/V head.
``"gqa"``  ``1 < num_kv_heads < num_heads`` (required), groups of query heads share a K/V head.
``"mqa"``  ``num_kv_heads == 1`` (default): one K/V head for all query heads.
``"mla"``  DeepSeek's multi-head latent attention: the cache holds one ``kv_lora_rank`` latent
           plus one shared ``qk_rope_head_dim`` rotary key per token. With ``index_topk`` set,
           DeepSeek-V3.2's sparse attention: a lightning indexer picks ``index_topk`` keys per
           query (:mod:`attnkit.models.indexer`).
=========  =====================================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from .._checks import positive_int

__all__ = ["DecoderConfig", "ATTENTION_VARIANTS", "HIDDEN_ACTS", "LAYER_TYPES", "NORM_STYLES", "NORM_PLACEMENTS"]

ATTENTION_VARIANTS = ("mha", "gqa", "mqa", "mla")
#: Per-layer attention kinds (Hugging Face's ``layer_types`` names).
LAYER_TYPES = ("full_attention", "sliding_attention")
#: RMSNorm conventions: "llama" (cast, then scale), "olmo2" (scale in fp32), "gemma" (1 + weight, in fp32).
NORM_STYLES = ("llama", "olmo2", "gemma")
#: Where a layer's norms sit: "pre" (Llama: input_layernorm, post_attention_layernorm before the MLP),
#: "sandwich" (Gemma 2/3: also post_attention_layernorm after attention and pre/post_feedforward_layernorm),
#: "post" (OLMo 2: post_attention_layernorm and post_feedforward_layernorm on the sublayer outputs only).
NORM_PLACEMENTS = ("pre", "sandwich", "post")
#: MLP activations (Hugging Face ``hidden_act`` names) of the gated MLP.
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh", "gelu")
_MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_INDEX_FIELDS = ("index_topk", "index_n_heads", "index_head_dim")


def default_intermediate_size(hidden_size: int) -> int:
    """SwiGLU width with the parameters of a 4x GELU MLP: 8/3 * hidden, rounded up to 8."""
    return 8 * math.ceil(8 * hidden_size / 3 / 8)


@dataclass(frozen=True)
class DecoderConfig:
    """A Llama-style decoder: token embedding, ``num_layers`` x (RMSNorm, attention, RMSNorm,
    SwiGLU MLP) with residuals, final RMSNorm, LM head (tied to the embedding or not).

    Args:
        vocab_size, hidden_size, num_layers, num_heads: the usual sizes (E = hidden_size).
        attention: "mha" | "gqa" | "mqa" | "mla" (see the module docstring).
        num_kv_heads: K/V heads (mha: num_heads, mqa: 1 by default; gqa: required).
        head_dim: per-head width (default hidden_size // num_heads, which must then divide).
            For "mla" it is the default of ``qk_nope_head_dim`` and ``v_head_dim``.
        intermediate_size: SwiGLU width (default :func:`default_intermediate_size`).
        tie_word_embeddings: the LM head reuses the embedding matrix.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta, rope_scaling, max_position_embeddings: RoPE base, Hugging Face's scaling
            dict (``{"rope_type": "llama3", ...}``; None = default RoPE) and context length.
        attention_bias: bias on the q/k/v projections (Qwen2: True); ``attention_out_bias``
            on o_proj (default: ``attention_bias``, Llama's single flag).
        mlp_bias: bias on the MLP projections.
        hidden_act: the gated MLP's activation, one of :data:`HIDDEN_ACTS` ("silu": SwiGLU).
        fused_projections: one ``qkv_proj`` per attention (MHA/GQA/MQA) and one ``gate_up_proj``
            per MLP (Phi-3's names) instead of separate Linears, for one matrix product each;
            checkpoints of either layout load (see :mod:`attnkit.models.decoder`).
        layer_types: per layer "full_attention" or "sliding_attention" (Hugging Face's names);
            default: every layer sliding if ``sliding_window`` is set, else every layer full.
        sliding_window: W, the tokens a sliding layer's query sees, itself included (Mistral's
            convention: the mask ``SlidingWindow(W - 1)``).
        local_rope_theta, local_rope_scaling: RoPE of the sliding layers when it differs from the
            full layers' (Gemma 3's local base); default: the same RoPE everywhere.
        query_scale: the softmax scale (default head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5).
        attn_softcap: attention scores soft-capped at this value (Gemma 2).
        final_softcap: final logits soft-capped, ``c * tanh(logits / c)`` (Gemma 2).
        qk_norm: None, "head" (RMSNorm of each q/k head, Qwen3 / Gemma 3) or "full" (of the
            whole projected q/k width, OLMo 2).
        norm_style: one of :data:`NORM_STYLES` (every RMSNorm of the model).
        norm_placement: one of :data:`NORM_PLACEMENTS`.
        embedding_multiplier: the token embeddings are multiplied by this (rounded to the model's
            dtype, as Gemma's ``sqrt(hidden_size)``); None: not scaled.
        attention_sinks: a learned per-head sink logit in every attention layer (gpt-oss).
        kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
            rope_interleave: MLA only. Defaults: ``kv_lora_rank = 4 * head_dim``, no q
            compression, ``qk_nope_head_dim = v_head_dim = head_dim``, ``qk_rope_head_dim =
            head_dim // 2`` (DeepSeek-V3's proportions), interleaved RoPE pairs.
        index_topk, index_n_heads, index_head_dim: MLA only: DeepSeek-V3.2's lightning indexer
            (None: dense MLA). ``index_topk`` keys per query; defaults ``index_n_heads =
            num_heads``, ``index_head_dim = qk_nope_head_dim + qk_rope_head_dim``; needs
            ``q_lora_rank`` and full-attention layers.

    Derived values never overwrite given ones; the resolved values are the fields themselves
    (``DecoderConfig(attention="mqa", ...).num_kv_heads == 1``).
    """

    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    attention: str = "mha"
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    attention_out_bias: bool | None = None
    mlp_bias: bool = False
    hidden_act: str = "silu"
    fused_projections: bool = True
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_interleave: bool | None = None
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    local_rope_theta: float | None = None
    local_rope_scaling: Mapping[str, Any] | None = None
    query_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    qk_norm: str | None = None
    norm_style: str = "llama"
    norm_placement: str = "pre"
    embedding_multiplier: float | None = None
    attention_sinks: bool = False
    index_topk: int | None = None
    index_n_heads: int | None = None
    index_head_dim: int | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        self._check_variants(set_)
        if self.attention not in ATTENTION_VARIANTS:
            raise ValueError(f"attention must be one of {ATTENTION_VARIANTS}, got {self.attention!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_position_embeddings"):
            positive_int(name, getattr(self, name))
        for name in ("num_kv_heads", "head_dim", "intermediate_size", *_MLA_FIELDS, *_INDEX_FIELDS):
            positive_int(name, getattr(self, name), allow_none=True)
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias", "fused_projections"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.attention_out_bias is None:
            set_("attention_out_bias", self.attention_bias)
        elif not isinstance(self.attention_out_bias, bool):
            raise TypeError(f"attention_out_bias must be a bool or None, got {self.attention_out_bias!r}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and not isinstance(self.rms_norm_eps, bool)
                and 0 < self.rms_norm_eps < 1):
            raise ValueError(f"rms_norm_eps must be a float in (0, 1), got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, (int, float)) and not isinstance(self.rope_theta, bool)
                and math.isfinite(self.rope_theta) and self.rope_theta > 1):
            raise ValueError(f"rope_theta must be a finite number > 1, got {self.rope_theta!r}")
        set_("rope_theta", float(self.rope_theta))
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, Mapping):
                raise TypeError(f"rope_scaling must be a dict (Hugging Face rope_scaling) or None, "
                                f"got {type(self.rope_scaling).__name__}")
            set_("rope_scaling", MappingProxyType(dict(self.rope_scaling)))

        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads "
                                 f"({self.num_heads}) unless head_dim is given")
            set_("head_dim", self.hidden_size // self.num_heads)
        if self.intermediate_size is None:
            set_("intermediate_size", default_intermediate_size(self.hidden_size))

        H, kv = self.num_heads, self.num_kv_heads
        if self.attention == "mla":
            if kv is not None and kv != H:
                raise ValueError(f"attention='mla' has one latent shared by all heads; num_kv_heads "
                                 f"({kv}) must be None or num_heads ({H})")
            set_("num_kv_heads", H)
            defaults = {"kv_lora_rank": 4 * self.head_dim, "qk_nope_head_dim": self.head_dim,
                        "qk_rope_head_dim": max(2, self.head_dim // 2), "v_head_dim": self.head_dim}
            for name, val in defaults.items():
                if getattr(self, name) is None:
                    set_(name, val)
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even (RoPE rotates pairs)")
            if self.rope_interleave is None:
                set_("rope_interleave", True)
            self._check_indexer(set_)
        else:
            given = [n for n in (*_MLA_FIELDS, *_INDEX_FIELDS) if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} only apply to attention='mla', got attention={self.attention!r}")
            if self.head_dim % 2:
                raise ValueError(f"head_dim ({self.head_dim}) must be even (RoPE rotates pairs)")
            if self.rope_interleave is None:
                set_("rope_interleave", False)
            want = {"mha": H, "mqa": 1}.get(self.attention)
            if kv is None:
                if want is None:
                    raise ValueError(f"attention='gqa' needs num_kv_heads (1 < num_kv_heads < num_heads={H})")
                set_("num_kv_heads", want)
            elif want is not None and kv != want:
                raise ValueError(f"attention={self.attention!r} means num_kv_heads={want}, got {kv}; "
                                 f"use attention='gqa' for {kv} K/V heads")
            elif want is None and not 1 < kv < H:
                raise ValueError(f"attention='gqa' needs 1 < num_kv_heads < num_heads ({H}), got {kv} "
                                 f"({'mqa' if kv == 1 else 'mha'} otherwise)")
            if H % self.num_kv_heads:
                raise ValueError(f"num_heads ({H}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if not isinstance(self.rope_interleave, bool):
            raise TypeError(f"rope_interleave must be a bool or None, got {self.rope_interleave!r}")

    def _check_indexer(self, set_) -> None:
        """DeepSeek-V3.2's indexer fields (MLA only): defaults, and what the indexer needs."""
        if self.index_topk is None:
            given = [n for n in _INDEX_FIELDS if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} describe the lightning indexer, which needs index_topk")
            return
        if self.q_lora_rank is None:
            raise ValueError("index_topk (DeepSeek-V3.2's indexer) needs q_lora_rank: the indexer reads MLA's query "
                             "latent")
        if "sliding_attention" in self.layer_types:
            raise ValueError("index_topk (DeepSeek-V3.2's indexer) applies to full-attention layers only, got "
                             "sliding_attention layers")
        if self.index_n_heads is None:
            set_("index_n_heads", self.num_heads)
        if self.index_head_dim is None:
            set_("index_head_dim", self.qk_nope_head_dim + self.qk_rope_head_dim)
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim "
                             f"({self.qk_rope_head_dim}), the channels RoPE rotates in each indexer head")

    def _check_variants(self, set_) -> None:
        positive_int("num_layers", self.num_layers)
        positive_int("sliding_window", self.sliding_window, allow_none=True)
        lt = self.layer_types
        if lt is None:
            lt = (LAYER_TYPES[1] if self.sliding_window is not None else LAYER_TYPES[0],) * self.num_layers
        elif isinstance(lt, (str, bytes)) or not isinstance(lt, Sequence):
            raise TypeError(f"layer_types must be a sequence of {LAYER_TYPES}, got {lt!r}")
        lt = tuple(lt)
        if len(lt) != self.num_layers:
            raise ValueError(f"layer_types has {len(lt)} entries but num_layers is {self.num_layers}")
        bad = sorted({t for t in lt if t not in LAYER_TYPES}, key=str)
        if bad:
            raise ValueError(f"layer_types entries must be one of {LAYER_TYPES}, got {bad}")
        if LAYER_TYPES[1] in lt and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        set_("layer_types", lt)
        for name in ("local_rope_theta", "query_scale", "attn_softcap", "final_softcap", "embedding_multiplier"):
            val = getattr(self, name)
            if val is not None:
                if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val) or val <= 0:
                    raise ValueError(f"{name} must be a finite number > 0 or None, got {val!r}")
                set_(name, float(val))
        if self.local_rope_scaling is not None:
            if not isinstance(self.local_rope_scaling, Mapping):
                raise TypeError(f"local_rope_scaling must be a dict or None, got {type(self.local_rope_scaling).__name__}")
            if self.local_rope_theta is None:
                raise ValueError("local_rope_scaling needs local_rope_theta (the sliding layers' own RoPE)")
            set_("local_rope_scaling", MappingProxyType(dict(self.local_rope_scaling)))
        if self.qk_norm not in (None, "head", "full"):
            raise ValueError(f"qk_norm must be None, 'head' or 'full', got {self.qk_norm!r}")
        if self.qk_norm is not None and self.attention == "mla":
            raise ValueError("qk_norm applies to mha/gqa/mqa attention (MLA normalises its latents)")
        if self.norm_style not in NORM_STYLES:
            raise ValueError(f"norm_style must be one of {NORM_STYLES}, got {self.norm_style!r}")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"norm_placement must be one of {NORM_PLACEMENTS}, got {self.norm_placement!r}")
        if not isinstance(self.attention_sinks, bool):
            raise TypeError(f"attention_sinks must be a bool, got {self.attention_sinks!r}")

    # ------------------------------------------------------------------ helpers

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("rope_scaling", "local_rope_scaling"):
            d[name] = None if d[name] is None else dict(d[name])
        d["layer_types"] = list(self.layer_types)
        return d

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of each query/key head."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim
