"""KV-cache sizing: how many bytes a token costs per layer and for a whole model.

MHA / GQA / MQA cache K and V for every key/value head: ``num_kv_heads * (head_dim +
v_head_dim)`` values per token per layer. Multi-head latent attention (DeepSeek-V2/V3) caches one
latent ``c_kv`` and one shared rope key: ``kv_lora_rank + qk_rope_head_dim`` values (576 at
DeepSeek-V3 dimensions), where expanding them per head would hold ``num_heads * (qk_nope +
qk_rope + v_head_dim)`` = 128 * (128 + 64 + 128) = 40,960: a 71x reduction. The DeepSeek-V2 paper
(section 2.1.4) puts it as "equal to GQA with only 2.25 groups": 576 = 2.25 * 2 * 128.

DeepSeek-V3.2's sparse attention (DSA, :class:`IndexedLatentDims`) caches MLA's latent and, beside
it, the lightning indexer's key: ``index_head_dim`` more values per token (576 + 128 = 704), in
the cache's compute dtype whatever ``kv_dtype`` quantizes (what
:class:`~attnkit.models.indexer.IndexedLatentCache` stores).

:func:`decode_read_bytes` is what one decode step needs from a layer's cache: every cached row,
or under a sparse selection of fewer keys per query (:class:`SelectionSpec`: DeepSeek sparse
attention's top 2048 keys, MiniMax-M3's blocks plus a local window) the selected rows only: K
and V of each KV head, or MLA's latent rows (V is read from them). A DSA layer's indexer reads
every cached key of its own each step, selection or not.

A quantized cache (``dtype=torch.int8`` or ``torch.float8_e4m3fn``, a cache's ``kv_dtype``) stores
one byte per value plus an fp32 scale per row (:mod:`attnkit.kvquant`): per token per layer,
one for K and one for V of each KV head, and one for MLA's latent (V is read from it).

Example::

    >>> import torch
    >>> from attnkit.sizing import PRESETS, kv_cache_bytes, values_per_token, expanded_dims
    >>> from attnkit.sizing import SelectionSpec, decode_read_bytes
    >>> v3 = PRESETS["deepseek-v3"].spec
    >>> values_per_token(v3), values_per_token(expanded_dims(v3))
    (576, 40960)
    >>> kv_cache_bytes(v3, context=1, layers=1, dtype=torch.bfloat16)
    1152
    >>> kv_cache_bytes(v3, context=1, layers=1, dtype=torch.int8)  # 576 values + one fp32 scale
    580
    >>> decode_read_bytes(v3, context=131072), decode_read_bytes(v3, context=131072, select=SelectionSpec(top_k=2048))
    (150994944, 2359296)
    >>> v32 = PRESETS["deepseek-v3.2"].spec  # + the indexer's 128-value key per token
    >>> values_per_token(v32), kv_cache_bytes(v32, context=1, layers=1, dtype=torch.int8)  # keys stay bf16
    (704, 836)
    >>> decode_read_bytes(v32, context=131072, select=SelectionSpec(top_k=2048))  # + every indexer key
    35913728
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

import torch

from ._checks import positive_int
from .kvquant import QUANTIZED_DTYPES
from .modules.attention import MultiHeadAttention
from .models.config import DecoderConfig
from .models.indexer import IndexedLatentAttention
from .modules.mla import MLAConfig, MultiHeadLatentAttention

__all__ = ["AttentionDims", "IndexedLatentDims", "Preset", "PRESETS", "SelectionSpec", "cache_spec", "values_per_token",
           "scales_per_token", "bytes_per_token", "kv_cache_bytes", "decode_read_bytes", "expanded_dims",
           "gqa_equivalent_groups", "kv_cache_table", "parse_spec", "parse_dtype", "parse_context", "parse_select",
           "add_kv_arguments", "run_kv"]


@dataclass(frozen=True)
class AttentionDims:
    """What an MHA / GQA / MQA layer caches per token: ``num_kv_heads`` heads of K (``head_dim``)
    and V (``v_head_dim``, default ``head_dim``). ``num_heads`` (query heads, optional) only names
    the kind and the reduction against full MHA."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    num_heads: int | None = None

    def __post_init__(self):
        positive_int("num_kv_heads", self.num_kv_heads)
        positive_int("head_dim", self.head_dim)
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        positive_int("v_head_dim", self.v_head_dim)
        if self.num_heads is not None:
            positive_int("num_heads", self.num_heads)
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                                 f"({self.num_kv_heads})")

    @property
    def kind(self) -> str:
        if self.num_heads is None:
            return "MQA" if self.num_kv_heads == 1 else f"{self.num_kv_heads} KV heads"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"


@dataclass(frozen=True)
class IndexedLatentDims:
    """What a DeepSeek-V3.2 sparse-attention (DSA) layer caches per token: MLA's latent and rope
    key (``mla``, its :class:`MLAConfig`) and the lightning indexer's key, ``index_head_dim``
    values (one head). :class:`~attnkit.models.indexer.IndexedLatentCache` holds the two; a
    quantized ``kv_dtype`` applies to the latent only, the indexer's keys stay in the cache's
    compute dtype (``index_dtype`` in :func:`bytes_per_token`)."""

    mla: MLAConfig
    index_head_dim: int

    def __post_init__(self):
        if not isinstance(self.mla, MLAConfig):
            raise TypeError(f"IndexedLatentDims mla must be an MLAConfig, got {type(self.mla).__name__}")
        positive_int("index_head_dim", self.index_head_dim)


Spec = MLAConfig | AttentionDims | IndexedLatentDims


class Preset(NamedTuple):
    spec: Spec
    layers: int
    note: str


def _mla(hidden, heads, q_lora_rank) -> MLAConfig:
    return MLAConfig(hidden_size=hidden, num_heads=heads, kv_lora_rank=512, qk_nope_head_dim=128,
                     qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=q_lora_rank)


#: Published attention dimensions of well-known models (their config.json files).
PRESETS: dict[str, Preset] = {
    "deepseek-v3": Preset(_mla(7168, 128, 1536), 61, "DeepSeek-V3 / R1, 671B"),
    "deepseek-v3.2": Preset(IndexedLatentDims(_mla(7168, 128, 1536), 128), 61,
                            "DeepSeek-V3.2, 671B: DSA, indexer 64 heads x 128, top 2048 keys"),
    "deepseek-v2": Preset(_mla(5120, 128, 1536), 60, "DeepSeek-V2, 236B"),
    "deepseek-v2-lite": Preset(_mla(2048, 16, None), 27, "DeepSeek-V2-Lite, 16B"),
    "llama-2-7b": Preset(AttentionDims(32, 128, num_heads=32), 32, "MHA"),
    "llama-3-8b": Preset(AttentionDims(8, 128, num_heads=32), 32, "GQA, 4 query heads per KV head"),
    "llama-3-70b": Preset(AttentionDims(8, 128, num_heads=64), 80, "GQA, 8 query heads per KV head"),
    "falcon-7b": Preset(AttentionDims(1, 64, num_heads=71), 32, "MQA"),
}


def cache_spec(obj: Any) -> Spec:
    """Normalise ``obj`` to an :class:`MLAConfig`, :class:`AttentionDims` or
    :class:`IndexedLatentDims`.

    Accepts those three, a preset name, a :class:`~attnkit.models.indexer.IndexedLatentAttention`,
    :class:`~attnkit.modules.mla.MultiHeadLatentAttention` or :class:`~attnkit.MultiHeadAttention`,
    a :class:`~attnkit.models.DecoderConfig` (its full-attention layers' cache), a mapping of
    :class:`AttentionDims` fields, or a Hugging Face config (``kv_lora_rank`` present: MLA, and
    with ``index_head_dim`` too, DeepSeek-V3.2's DSA; else ``num_key_value_heads`` / ``head_dim``).
    """
    if isinstance(obj, (MLAConfig, AttentionDims, IndexedLatentDims)):
        return obj
    if isinstance(obj, str):
        key = obj.lower()
        if key not in PRESETS:
            raise ValueError(f"unknown preset {obj!r}; presets: {', '.join(PRESETS)}")
        return PRESETS[key].spec
    if isinstance(obj, IndexedLatentAttention):  # before its base class, MLA
        return IndexedLatentDims(obj.config, obj.indexer.config.head_dim)
    if isinstance(obj, MultiHeadLatentAttention):
        return obj.config
    if isinstance(obj, DecoderConfig):
        return _decoder_spec(obj)
    if isinstance(obj, MultiHeadAttention):
        return AttentionDims(obj.num_kv_heads, obj.head_dim, obj.v_head_dim, obj.num_heads)
    if isinstance(obj, Mapping):
        try:
            return AttentionDims(**obj)
        except TypeError as e:
            raise TypeError(f"a mapping spec takes AttentionDims fields (num_kv_heads, head_dim, v_head_dim, "
                            f"num_heads): {e}") from None
    if getattr(obj, "kv_lora_rank", None) is not None:
        mla = MLAConfig.from_hf_config(obj)
        index_head_dim = getattr(obj, "index_head_dim", None)  # DeepseekV32Config
        return mla if index_head_dim is None else IndexedLatentDims(mla, index_head_dim)
    heads = getattr(obj, "num_attention_heads", None)
    if heads is not None:
        head_dim = getattr(obj, "head_dim", None) or obj.hidden_size // heads
        return AttentionDims(getattr(obj, "num_key_value_heads", None) or heads, head_dim, num_heads=heads)
    raise TypeError(f"cannot size the KV cache of a {type(obj).__name__}; pass an MLAConfig, AttentionDims, "
                    f"IndexedLatentDims, preset name, attnkit attention module, DecoderConfig or Hugging Face config")


def _decoder_spec(cfg: DecoderConfig) -> Spec:
    """The cache of one full-attention layer of a :class:`DecoderConfig` (the dims only)."""
    if cfg.attention != "mla":
        return AttentionDims(cfg.num_kv_heads, cfg.head_dim, num_heads=cfg.num_heads)
    mla = MLAConfig(hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, kv_lora_rank=cfg.kv_lora_rank,
                    qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                    v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank)
    return mla if cfg.index_topk is None else IndexedLatentDims(mla, cfg.index_head_dim)


def _index_values(s: Spec) -> int:
    """Values of the indexer's key a token stores (a DSA layer; 0 for any other)."""
    return s.index_head_dim if isinstance(s, IndexedLatentDims) else 0


def values_per_token(spec) -> int:
    """Values one token of one sequence stores in one layer's cache (a DSA layer: the latent's
    and the indexer key's)."""
    s = cache_spec(spec)
    if isinstance(s, IndexedLatentDims):
        return s.mla.latent_dim + s.index_head_dim
    if isinstance(s, MLAConfig):
        return s.latent_dim
    return s.num_kv_heads * (s.head_dim + s.v_head_dim)


def _element_size(dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def scales_per_token(spec, dtype: torch.dtype = torch.int8) -> int:
    """fp32 scales one token stores in one layer's cache in ``dtype``: for a quantized dtype (int8,
    fp8) one per row of K and one per row of V of each KV head, one for MLA's latent (V is read
    from the same row; a DSA layer's indexer keys are never quantized); 0 for a float dtype."""
    _element_size(dtype)
    if dtype not in QUANTIZED_DTYPES:
        return 0
    s = cache_spec(spec)
    return 1 if isinstance(s, (MLAConfig, IndexedLatentDims)) else 2 * s.num_kv_heads


def _index_dtype(dtype: torch.dtype, index_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a DSA layer's indexer keys are stored in: ``index_dtype``, else ``dtype`` when it
    is a float dtype, else (a quantized cache) bf16, the compute dtype DeepSeek-V3.2 runs in."""
    if index_dtype is not None:
        _element_size(index_dtype)
        if index_dtype in QUANTIZED_DTYPES:
            raise ValueError(f"index_dtype is the cache's compute dtype (the indexer's keys are never quantized), "
                             f"got {index_dtype}")
        return index_dtype
    return torch.bfloat16 if dtype in QUANTIZED_DTYPES else dtype


def _row_bytes(spec, dtype: torch.dtype, index_dtype: torch.dtype | None) -> tuple[int, int]:
    """Bytes one token costs in one layer: (attention's row: K and V, or MLA's latent, scales
    included; a DSA layer's indexer key, 0 for any other layer)."""
    s = cache_spec(spec)
    index = _index_values(s)
    attn = (values_per_token(s) - index) * _element_size(dtype) + 4 * scales_per_token(s, dtype)
    return attn, index * _element_size(_index_dtype(dtype, index_dtype)) if index else 0


def bytes_per_token(spec, dtype: torch.dtype = torch.bfloat16, *, index_dtype: torch.dtype | None = None) -> int:
    """Bytes per token per layer, scales of a quantized dtype included (what
    ``cache.bytes_per_token`` reports for the matching cache). A DSA layer
    (:class:`IndexedLatentDims`) adds its indexer key, stored unquantized in ``index_dtype``: the
    cache's compute dtype (default ``dtype``, or bf16 when ``dtype`` is quantized), as
    :class:`~attnkit.models.indexer.IndexedLatentCache` stores it."""
    return sum(_row_bytes(spec, dtype, index_dtype))


def kv_cache_bytes(spec, *, context: int = 1, layers: int = 1, batch: int = 1,
                   dtype: torch.dtype = torch.bfloat16, index_dtype: torch.dtype | None = None) -> int:
    """Bytes of KV cache for ``batch`` sequences of ``context`` tokens over ``layers`` layers.

    ``spec``: anything :func:`cache_spec` accepts (an :class:`MLAConfig` sizes the latent cache;
    use :func:`expanded_dims` for the per-head cache the naive path would keep). A quantized
    ``dtype`` (int8, fp8) counts its fp32 scales (:func:`scales_per_token`), not an int8 cache's
    K channel scale: one (Hkv, D) fp32 tensor per layer, whatever the context. A DSA layer's
    indexer keys are counted in ``index_dtype`` (:func:`bytes_per_token`).
    """
    for name, val in (("context", context), ("layers", layers), ("batch", batch)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 0:
            raise ValueError(f"{name} must be a non-negative int, got {val!r}")
    return bytes_per_token(spec, dtype, index_dtype=index_dtype) * context * layers * batch


@dataclass(frozen=True)
class SelectionSpec:
    """The keys each query of a decode step attends to under a sparse selection, when a layer
    keeps fewer keys than its cache holds:

    * ``top_k`` keys per query (DeepSeek sparse attention's indexer: 2048);
    * ``blocks`` blocks of ``block_size`` consecutive keys (MiniMax-M3's selected blocks, NSA's);
    * ``window`` most recent keys, attended as well (a local window).

    The parts add up, capped at the context: :meth:`keys_read`. Where the window overlaps the
    selected blocks the count is an upper bound. A selection per KV head (MiniMax-M3 selects per
    KV group) keeps as many keys for every head, so the bytes are the same."""

    top_k: int = 0
    blocks: int = 0
    block_size: int = 0
    window: int = 0

    def __post_init__(self):
        for name in ("top_k", "blocks", "block_size", "window"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise ValueError(f"SelectionSpec {name} must be a non-negative int, got {val!r}")
        if (self.blocks == 0) != (self.block_size == 0):
            raise ValueError(f"SelectionSpec blocks ({self.blocks}) and block_size ({self.block_size}) go together: "
                             f"both positive, or both 0")
        if self.top_k + self.blocks * self.block_size + self.window == 0:
            raise ValueError("SelectionSpec keeps no key: give top_k, blocks and block_size, or window")

    @property
    def keys(self) -> int:
        """Keys per query the selection names (before the cap at the context)."""
        return self.top_k + self.blocks * self.block_size + self.window

    def keys_read(self, context: int) -> int:
        """Keys a query reads at ``context`` cached tokens: the selection's, at most the context."""
        return min(positive_int("context", context), self.keys)

    def __str__(self) -> str:
        parts = [f"top {self.top_k}"] if self.top_k else []
        parts += [f"{self.blocks} blocks x {self.block_size}"] if self.blocks else []
        parts += [f"window {self.window}"] if self.window else []
        return " + ".join(parts) + f" = {self.keys:,} keys"


def decode_read_bytes(spec, *, context: int, select: SelectionSpec | None = None, batch: int = 1,
                      dtype: torch.dtype = torch.bfloat16, index_dtype: torch.dtype | None = None) -> int:
    """Bytes one decode step (one new query per sequence) reads from one layer's KV cache, for
    ``batch`` sequences of ``context`` cached tokens: every row (dense), or with ``select`` the
    rows it keeps, ``select.keys_read(context)`` per sequence. A row is what a token costs
    (:func:`bytes_per_token`): K and V of every KV head, each read once for its whole group of
    query heads, or MLA's latent and rope key (V is read from the latent), fp32 scales of a
    quantized ``dtype`` included. A DSA layer (:class:`IndexedLatentDims`) reads its indexer's
    keys besides, every cached one, whatever the selection (the indexer scores every key to
    select; in ``index_dtype``, :func:`bytes_per_token`)."""
    positive_int("batch", batch)
    context = positive_int("context", context)
    keys = context if select is None else select.keys_read(context)
    attn, index = _row_bytes(spec, dtype, index_dtype)
    return (keys * attn + context * index) * batch


def expanded_dims(config: MLAConfig) -> AttentionDims:
    """The per-head K/V an MLA layer would cache if it stored keys and values expanded (what
    older Hugging Face DeepSeek code did): ``num_heads`` heads of qk_head_dim and v_head_dim."""
    if not isinstance(config, MLAConfig):
        raise TypeError(f"config must be an MLAConfig, got {type(config).__name__}")
    return AttentionDims(config.num_heads, config.qk_head_dim, config.v_head_dim, config.num_heads)


def gqa_equivalent_groups(spec, head_dim: int | None = None) -> float:
    """How many GQA key/value groups of ``head_dim`` (K and V each) cache as much per token:
    ``values_per_token / (2 * head_dim)``. Without ``head_dim``: MLA uses its
    ``qk_nope_head_dim`` (the DeepSeek-V2 paper's d_h; 576 / (2 * 128) = 2.25 for V2/V3; a DSA
    layer counts its indexer key too, 704 / 256 = 2.75 for V3.2), and an MHA/GQA/MQA layer its
    own K+V width per head (so the answer is its ``num_kv_heads``)."""
    s = cache_spec(spec)
    if head_dim is not None:
        return values_per_token(s) / (2 * positive_int("head_dim", head_dim))
    if isinstance(s, (MLAConfig, IndexedLatentDims)):
        mla = s.mla if isinstance(s, IndexedLatentDims) else s
        return values_per_token(s) / (2 * mla.qk_nope_head_dim)
    return values_per_token(s) / (s.head_dim + s.v_head_dim)


# --------------------------------------------------------------------------- table


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _dtype_name(dtype: torch.dtype) -> str:
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8_e4m3"}
    return short.get(dtype, str(dtype).replace("torch.", ""))


def _rows(specs) -> list[tuple[str, Spec, int | None]]:
    if specs is None:
        return [(name, p.spec, p.layers) for name, p in PRESETS.items()]
    items = specs.items() if isinstance(specs, Mapping) else ((None, s) for s in specs)
    rows = []
    for name, s in items:
        layers = None
        if isinstance(s, tuple) and len(s) == 2 and not isinstance(s, Preset):
            s, layers = s
        if isinstance(s, Preset):
            s, layers = s.spec, s.layers
        if isinstance(s, str) and s.lower() in PRESETS:
            name = name or s.lower()
            layers = PRESETS[s.lower()].layers if layers is None else layers
        if layers is not None:
            positive_int("layers", layers)
        rows.append((name or f"#{len(rows) + 1}", cache_spec(s), layers))
    return rows


def kv_cache_table(specs=None, *, context: int = 4096, dtype: torch.dtype = torch.bfloat16, batch: int = 1,
                   layers: int | None = None, select: SelectionSpec | None = None) -> str:
    """A markdown table of KV-cache sizes: per token per layer, per token for the model, and for
    ``batch`` sequences of ``context`` tokens.

    Args:
        specs: None (every :data:`PRESETS` entry), a mapping ``name -> spec`` or ``name ->
            (spec, layers)``, or a sequence of specs / preset names / ``(spec, layers)``.
        context, dtype, batch: the cache to size.
        layers: overrides every row's layer count (rows without one use 1).
        select: a sparse :class:`SelectionSpec`: two more columns give the bytes one decode step
            reads per layer (:func:`decode_read_bytes`), of every cached row and of the selected
            rows only.

    MLA rows are followed by their expanded per-head equivalent. A DSA row (DeepSeek-V3.2,
    :class:`IndexedLatentDims`) counts the indexer's keys as well, in bf16 when ``dtype`` is
    quantized (:func:`bytes_per_token`), and compares with the per-head K/V plus those keys.
    "vs per-head" is how many times
    smaller the cache is than K and V for every query head; "= GQA with n KV heads" is
    :func:`gqa_equivalent_groups`: the KV heads (of the model's head dim, K and V each) a GQA cache
    of the same size would hold, fractional for MLA (DeepSeek-V3: 2.25).
    """
    if layers is not None:
        positive_int("layers", layers)
    positive_int("context", context)
    positive_int("batch", batch)
    elem = _element_size(dtype)
    what = (f"{_dtype_name(dtype)} + fp32 scale per row ({elem} byte/value, 4 bytes per token per KV head for K and "
            f"for V, per token for an MLA latent; DSA indexer keys bf16)" if dtype in QUANTIZED_DTYPES
            else f"{_dtype_name(dtype)} ({elem} bytes/value)")
    title = f"KV cache at {context} tokens x batch {batch}, {what}"
    head = ("| model | attention | layers | values/token/layer | bytes/token/layer | bytes/token (model) "
            "| cache (model) | vs per-head | = GQA with n KV heads |")
    rule = "|---|---|---:|---:|---:|---:|---:|---:|---:|"
    if select is not None:
        title += f"; a decode step with the selection {select} (read: per layer, per step)"
        head += f" read dense | read selected ({select.keys_read(context):,} keys) |"
        rule += "---:|---:|"
    lines = [title, "", head, rule]
    for name, s, n_layers in _rows(specs):
        n_layers = layers if layers is not None else n_layers if n_layers is not None else 1
        pairs = [(name, s)]
        if isinstance(s, MLAConfig):
            pairs.append((f"{name} (expanded per head)", expanded_dims(s)))
        for label, spec in pairs:
            vals = values_per_token(spec)
            per_layer = bytes_per_token(spec, dtype)
            if isinstance(spec, IndexedLatentDims):
                m = spec.mla
                kind = (f"DSA: MLA (r={m.kv_lora_rank}, rope={m.qk_rope_head_dim}, {m.num_heads} heads) + indexer "
                        f"key {spec.index_head_dim}")
                full = values_per_token(expanded_dims(m)) + spec.index_head_dim
            elif isinstance(spec, MLAConfig):
                kind = f"MLA (r={spec.kv_lora_rank}, rope={spec.qk_rope_head_dim}, {spec.num_heads} heads)"
                full = values_per_token(expanded_dims(spec))
            else:
                kind = f"{spec.kind} ({spec.num_kv_heads}x{spec.head_dim}" + (
                    f"/{spec.v_head_dim})" if spec.v_head_dim != spec.head_dim else ")")
                full = (spec.num_heads or spec.num_kv_heads) * (spec.head_dim + spec.v_head_dim)
            lines.append(
                f"| {label} | {kind} | {n_layers} | {vals:,} | {per_layer:,} | {_fmt_bytes(per_layer * n_layers)} "
                f"| {_fmt_bytes(kv_cache_bytes(spec, context=context, layers=n_layers, batch=batch, dtype=dtype))} "
                f"| {full / vals:.1f}x | {gqa_equivalent_groups(spec):.3g} |")
            if select is not None:
                dense, sparse = (_fmt_bytes(decode_read_bytes(spec, context=context, select=sel, batch=batch,
                                                              dtype=dtype)) for sel in (None, select))
                lines[-1] += f" {dense} | {sparse} |"
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- command line

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
           "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
           "int8": torch.int8}

_SPEC_KEYS = {
    "mla": {"heads": "num_heads", "num_heads": "num_heads", "rank": "kv_lora_rank", "kv_lora_rank": "kv_lora_rank",
            "rope": "qk_rope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim", "nope": "qk_nope_head_dim",
            "qk_nope_head_dim": "qk_nope_head_dim", "v": "v_head_dim", "v_head_dim": "v_head_dim",
            "hidden": "hidden_size", "hidden_size": "hidden_size", "q_lora_rank": "q_lora_rank",
            "index": "index_head_dim", "index_head_dim": "index_head_dim", "layers": "layers"},
    "dims": {"heads": "num_heads", "num_heads": "num_heads", "kv_heads": "num_kv_heads",
             "num_kv_heads": "num_kv_heads", "head_dim": "head_dim", "v_head_dim": "v_head_dim", "v": "v_head_dim",
             "layers": "layers"},
}


def parse_dtype(text: str) -> torch.dtype:
    """"bf16", "fp16", "fp32", "fp8" (= "fp8_e4m3"), "int8" (and torch's long names) -> torch.dtype
    (int8 and fp8 are quantized caches: fp32 scales per row are counted)."""
    try:
        return _DTYPES[text.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown dtype {text!r}; use one of {', '.join(_DTYPES)}") from None


def parse_context(text: str | int) -> int:
    """"4096", "128k" (x1024), "1m" (x1024**2) -> tokens."""
    if isinstance(text, int) and not isinstance(text, bool):
        return positive_int("context", text)
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise ValueError(f"context must be a token count such as 4096, 128k or 1m, got {text!r}")
    n = int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 ** 2}[m.group(2).lower()]
    return positive_int("context", n)


def parse_select(text: str) -> SelectionSpec:
    """A command-line selection -> :class:`SelectionSpec`: ``2048`` (top-k keys per query; ``2k``
    too), ``16x64`` (16 blocks of 64 keys), either followed by ``+512`` (a local window of 512
    keys); ``+512`` alone is a window."""
    m = re.fullmatch(r"\s*(?:(\w+?)(?:x(\w+))?)?\s*(?:\+\s*(\w+))?\s*", str(text))
    if not m or not any(m.groups()):
        raise ValueError(f"select must be top-k keys (2048), blocks x block size (16x64), either with +window "
                         f"(16x64+512), got {text!r}")
    first, size, window = m.groups()
    try:
        n = [0 if t is None else parse_context(t) for t in (first, size, window)]
    except ValueError:
        raise ValueError(f"select: bad count in {text!r}: 2048, 2k, 16x64, 16x64+512") from None
    if size is None:
        return SelectionSpec(top_k=n[0], window=n[2])
    return SelectionSpec(blocks=n[0], block_size=n[1], window=n[2])


def parse_spec(text: str) -> tuple[str, Spec, int | None]:
    """A command-line spec -> (name, spec, layers or None).

    * a preset name: ``deepseek-v3``, ``llama-3-8b``, ... (:data:`PRESETS`);
    * ``mla:heads=128,rank=512,rope=64,nope=128,v=128[,layers=61]`` (``hidden`` and
      ``q_lora_rank`` optional: they do not change the cache); ``index=128`` (``index_head_dim``)
      makes it a DSA layer (:class:`IndexedLatentDims`) whose indexer caches 128 values a token;
    * ``mha:heads=32,head_dim=128``, ``gqa:heads=32,num_kv_heads=8,head_dim=128[,v=..]``,
      ``mqa:heads=71,head_dim=64``, each with optional ``layers=``.

    Each key has a long spelling, the field's name (``num_heads``, ``num_kv_heads``,
    ``kv_lora_rank``, ...), and a short one (``heads``, ``kv_heads``, ``rank``, ...).
    """
    if not isinstance(text, str):
        raise TypeError(f"spec must be a string, got {type(text).__name__}")
    if ":" not in text:
        key = text.strip().lower()
        if key not in PRESETS:
            raise ValueError(f"unknown preset {text!r}; presets: {', '.join(PRESETS)}; or give "
                             f"mla:heads=..,rank=..,rope=..,nope=..,v=.. / gqa:heads=..,num_kv_heads=..,head_dim=..")
        return key, PRESETS[key].spec, PRESETS[key].layers
    kind, _, body = text.partition(":")
    kind = kind.strip().lower()
    if kind not in ("mla", "mha", "gqa", "mqa"):
        raise ValueError(f"spec kind must be mla, mha, gqa or mqa, got {kind!r} in {text!r}")
    keys = _SPEC_KEYS["mla" if kind == "mla" else "dims"]
    vals: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in body.split(","))):
        k, eq, v = item.partition("=")
        if not eq or k.strip() not in keys or not v.strip().isdigit():
            raise ValueError(f"bad item {item!r} in {text!r}: expected key=int with key one of {sorted(keys)}")
        vals[keys[k.strip()]] = int(v)
    layers = vals.pop("layers", None)
    try:
        if kind == "mla":
            need = ("num_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
            missing = [n for n in need if n not in vals]
            if missing:
                raise ValueError(f"mla spec {text!r} is missing {missing}")
            vals.setdefault("hidden_size", vals["num_heads"] * vals["v_head_dim"])
            index_head_dim = vals.pop("index_head_dim", None)
            spec: Spec = MLAConfig(**vals)
            if index_head_dim is not None:
                spec = IndexedLatentDims(spec, index_head_dim)
        else:
            if kind == "mha" and "num_heads" in vals:
                vals.setdefault("num_kv_heads", vals["num_heads"])
            elif kind == "mqa":
                if vals.setdefault("num_kv_heads", 1) != 1:
                    raise ValueError(f"mqa spec {text!r} has num_kv_heads={vals['num_kv_heads']}; MQA has one (use gqa:)")
            need = ("num_heads", "head_dim") if kind == "mha" else ("num_kv_heads", "head_dim")
            missing = [n for n in need if n not in vals]
            if missing:
                raise ValueError(f"{kind} spec {text!r} is missing {missing}")
            spec = AttentionDims(**vals)
    except TypeError as e:
        raise ValueError(f"bad spec {text!r}: {e}") from None
    return text, spec, layers


def _argument(parse):
    """``parse`` as an argparse ``type=``: its ValueError's message becomes argparse's error (argparse
    would otherwise print only "invalid parse_dtype value")."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def add_kv_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``attnkit kv`` options: specs, ``--context``, ``--dtype``, ``--batch``, ``--layers``,
    ``--select``."""
    parser.add_argument("specs", nargs="*", metavar="SPEC",
                        help=f"preset ({', '.join(PRESETS)}) or mla:heads=..,rank=..,rope=..,nope=..,v=..[,index=..] "
                             f"or mha/gqa/mqa:heads=..,num_kv_heads=..,head_dim=.. (default: every preset)")
    parser.add_argument("--context", type=_argument(parse_context), default=4096, help="tokens per sequence (4096, 128k)")
    parser.add_argument("--dtype", type=_argument(parse_dtype), default=torch.bfloat16,
                        help="cache dtype (bf16, fp16, fp32; int8 / fp8: quantized, fp32 scale per row counted)")
    parser.add_argument("--batch", type=int, default=1, help="sequences")
    parser.add_argument("--layers", type=int, default=None, help="override every model's layer count")
    parser.add_argument("--select", type=_argument(parse_select), default=None, metavar="SEL",
                        help="a sparse selection per query: top-k keys (2048), blocks x block size (16x64), "
                             "either +window (16x64+512); adds the bytes a decode step reads per layer, dense "
                             "and of the selected rows")
    return parser


def run_kv(args: argparse.Namespace) -> int:
    """Print :func:`kv_cache_table` for parsed ``attnkit kv`` arguments."""
    specs = None
    if args.specs:
        specs = {}
        for text in args.specs:
            name, spec, layers = parse_spec(text)
            specs[name] = (spec, layers)
    print(kv_cache_table(specs, context=args.context, dtype=args.dtype, batch=args.batch, layers=args.layers,
                         select=getattr(args, "select", None)), end="")
    return 0
