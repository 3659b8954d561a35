"""Translate a Hugging Face config (``config.json``) into a :class:`DecoderConfig`.

Supported ``model_type`` (:data:`SUPPORTED_MODEL_TYPES`), each a set of :class:`DecoderConfig`
parameters of the one decoder, not a class of its own:

============  =================================================================================
llama         Llama 2 / 3 (RoPE scalings, attention / MLP bias, explicit head_dim)
mistral       + ``sliding_window`` on every layer
qwen2         q/k/v bias; ``use_sliding_window`` layers past ``max_window_layers``
qwen3         per-head QK-norm (``q_norm`` / ``k_norm``), sliding layers as Qwen2
gemma2        Gemma norms (1 + weight) around both sublayers, GeGLU, embeddings times
              sqrt(hidden), ``query_pre_attn_scalar``, soft-capped attention and final logits,
              alternating sliding / full layers
gemma3_text   Gemma 2's layout + per-head QK-norm and its own RoPE on the local (sliding) layers
phi3          fused ``qkv_proj`` / ``gate_up_proj`` as stored, partial rotary, sliding window
olmo2         QK-norm over the whole projected width, norms after each sublayer only
deepseek_v3   multi-head latent attention, dense MLPs only (``first_k_dense_replace >=
              num_hidden_layers``; routed-expert layers are refused)
deepseek_v32  DeepSeek-V3.2: deepseek_v3's MLA plus the lightning indexer's top-k key selection
              (``index_topk``, ``index_n_heads``, ``index_head_dim``); dense MLPs only
              (``mlp_layer_types`` all "dense")
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Mapping

import torch

from ..rope import RotaryEmbedding
from .config import HIDDEN_ACTS, DecoderConfig

__all__ = ["config_from_hf", "config_dtype", "SUPPORTED_MODEL_TYPES"]

@dataclass(frozen=True)
class _Family:
    """What one ``model_type``'s config.json means for the decoder, as data."""

    #: transformers' class defaults for fields a config.json may leave out (v4-era files omit them)
    defaults: dict = field(default_factory=dict)
    #: (q/k/v bias, o_proj bias) fixed by the architecture; None: the file's ``attention_bias``
    bias: tuple[bool, bool] | None = None
    #: DecoderConfig fields the architecture fixes
    fields: dict = field(default_factory=dict)
    #: Gemma's sandwich norms, embedding scale, query_pre_attn_scalar and soft-capping
    gemma: bool = False
    #: which layers slide when the file predates ``layer_types`` (see _layer_types)
    sliding: str = "all"
    #: sliding layers only with ``use_sliding_window`` (Qwen: transformers ignores the window otherwise)
    sliding_needs_flag: bool = False
    #: a second RoPE for the sliding layers (Gemma 3)
    local_rope: bool = False
    #: multi-head latent attention (DeepSeek-V3), read by _mla_config
    mla: bool = False
    #: DeepSeek-V3.2's lightning indexer on every layer (with ``mla``)
    indexed: bool = False


_GEMMA_DEFAULTS = dict(tie_word_embeddings=True, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                       hidden_activation="gelu_pytorch_tanh")

#: One row per supported ``model_type``.
_FAMILIES: dict[str, _Family] = {
    "llama": _Family(),
    "mistral": _Family(bias=(False, False)),
    "qwen2": _Family(bias=(True, False), sliding="after_max_window_layers", sliding_needs_flag=True),
    "qwen3": _Family(defaults=dict(head_dim=128), fields=dict(qk_norm="head"), sliding="after_max_window_layers",
                     sliding_needs_flag=True),
    "phi3": _Family(defaults=dict(rms_norm_eps=1e-5), bias=(False, False)),
    "olmo2": _Family(defaults=dict(rms_norm_eps=1e-5),
                     fields=dict(qk_norm="full", norm_style="olmo2", norm_placement="post")),
    "gemma2": _Family(defaults=dict(_GEMMA_DEFAULTS, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
                      gemma=True, sliding="every_other"),
    "gemma3_text": _Family(defaults=dict(_GEMMA_DEFAULTS, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                                         sliding_window_pattern=6),
                           fields=dict(qk_norm="head"), gemma=True, sliding="pattern", local_rope=True),
    "deepseek_v3": _Family(mla=True),
    # transformers' DeepseekV32Config defaults; its MLA rope always rotates interleaved pairs
    "deepseek_v32": _Family(defaults=dict(index_topk=2048, index_head_dim=128, index_n_heads=64,
                                          first_k_dense_replace=3, n_routed_experts=256, q_lora_rank=1536),
                            fields=dict(rope_interleave=True), mla=True, indexed=True),
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)


def _as_dict(cfg) -> dict[str, Any]:
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if hasattr(cfg, "to_dict"):  # a transformers PretrainedConfig
        return cfg.to_dict()
    raise TypeError(f"config must be a dict (config.json) or a Hugging Face config, got {type(cfg).__name__}")


def _rope_fields(c: dict, head_dim: int | None, layer_type: str | None = None) -> dict:
    """rope_theta / rope_scaling of a config.json (v4 ``rope_scaling`` + ``rope_theta`` or v5
    ``rope_parameters``, per layer type where the config nests them), resolved exactly as
    :meth:`RotaryEmbedding.from_hf_config` does; partial rotary kept as ``partial_rotary_factor``."""
    ns = SimpleNamespace(**{**c, "head_dim": head_dim})
    try:
        rope = RotaryEmbedding.from_hf_config(ns, interleaved=False, layer_type=layer_type)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.json (model_type {c.get('model_type')!r}): unsupported RoPE settings "
                         f"(rope_parameters / rope_scaling / rope_theta): {e}") from None
    rc = rope.config
    scaling = None if rc.rope_type == "default" else {k: v for k, v in rc.scaling.items() if k != "rope_theta"}
    if rc.rotary_dim != rc.head_dim:
        params = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if layer_type is not None and isinstance(params.get(layer_type), Mapping):
            params = params[layer_type]
        prf = params.get("partial_rotary_factor", c.get("partial_rotary_factor"))
        scaling = {"rope_type": rc.rope_type, **(scaling or {}), "partial_rotary_factor": prf}
    return {"rope_theta": rc.base, "rope_scaling": scaling}


def _layer_types(f: "_Fields", fam: _Family, L: int) -> tuple[list[str], int | None]:
    """Per-layer attention kinds and the sliding window W (None: every layer full)."""
    c = f.c
    window = f.int("sliding_window", None)
    given = c.get("layer_types")
    if fam.sliding_needs_flag and not f.bool("use_sliding_window", False):
        return ["full_attention"] * L, None  # transformers ignores sliding_window then
    if given is not None:
        if not isinstance(given, list) or len(given) != L or any(t not in ("full_attention", "sliding_attention")
                                                                   for t in given):
            raise ValueError(f"{f.where} field 'layer_types' must list 'full_attention' / 'sliding_attention' for "
                             f"each of the {L} layers, got {given!r:.200}")
        types = list(given)
    elif window is None:
        types = ["full_attention"] * L
    elif fam.sliding == "every_other":  # transformers' defaults when the file predates layer_types
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    elif fam.sliding == "pattern":
        pattern = f.int("sliding_window_pattern", f.int("_sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)]
    elif fam.sliding == "after_max_window_layers":
        first = f.int("max_window_layers", L, low=0)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(L)]
    else:  # Mistral, Phi-3: every layer
        types = ["sliding_attention"] * L
    if "sliding_attention" not in types:
        return types, None
    if window is None:
        raise ValueError(f"{f.where} has sliding_attention layers but no sliding_window")
    return types, window


_REQUIRED = object()


class _Fields:
    """config.json read with types checked: a wrong type or a missing required key is a ValueError
    naming the field, the value and the model type (JSON's ``"false"`` is a string, not a bool)."""

    def __init__(self, c: dict):
        self.c = c
        self.where = f"config.json (model_type {c.get('model_type')!r})"

    def _get(self, key, default):
        if key in self.c and self.c[key] is not None:
            return self.c[key], True
        if default is _REQUIRED:
            raise ValueError(f"{self.where} has no {key!r}, which the decoder needs")
        return default, False

    def _bad(self, key, val, what):
        return ValueError(f"{self.where} field {key!r} must be {what}, got {val!r} ({type(val).__name__})")

    def int(self, key, default=_REQUIRED, *, low: int = 1):
        val, given = self._get(key, default)
        if given and (isinstance(val, bool) or not isinstance(val, int) or val < low):
            raise self._bad(key, val, f"an int >= {low}")
        return val

    def bool(self, key, default=_REQUIRED):
        val, given = self._get(key, default)
        if given and not isinstance(val, bool):
            raise self._bad(key, val, "true or false")
        return val

    def float(self, key, default=_REQUIRED, *, positive: bool = True):
        val, given = self._get(key, default)
        if given and (isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val)
                      or (positive and val <= 0)):
            raise self._bad(key, val, "a finite number" + (" > 0" if positive else ""))
        return None if val is None else float(val)

    def str(self, key, default=_REQUIRED):
        val, given = self._get(key, default)
        if given and not isinstance(val, str):
            raise self._bad(key, val, "a string")
        return val

    def dict(self, key, default=None):
        val, given = self._get(key, default)
        if given and not isinstance(val, Mapping):
            raise self._bad(key, val, "an object")
        return val


def config_from_hf(cfg) -> DecoderConfig:
    """The :class:`DecoderConfig` of a Hugging Face config (``config.json`` as a dict, or a
    ``PretrainedConfig``) of a supported family (:data:`SUPPORTED_MODEL_TYPES`). Field types
    are checked (errors name the field); architectures or options the decoder does not implement
    raise ValueError naming them, never silently approximated."""
    c = _as_dict(cfg)
    mt = c.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        hint = " (load the text model's checkpoint, model_type 'gemma3_text')" if mt == "gemma3" else ""
        raise ValueError(f"model_type {mt!r} is not supported{hint}; attnkit.models loads {SUPPORTED_MODEL_TYPES}")
    fam = _FAMILIES[mt]
    c = {**fam.defaults, **c}  # an explicit null stays null (e.g. no soft-capping)
    f = _Fields(c)
    act_key = "hidden_activation" if fam.gemma and "hidden_activation" in c else "hidden_act"
    act = f.str(act_key, "silu")
    if act not in HIDDEN_ACTS:
        raise ValueError(f"{act_key} {act!r} is not supported (the decoder's gated MLP takes {HIDDEN_ACTS})")
    quant = f.dict("quantization_config")
    if quant:
        raise ValueError(f"quantized checkpoints ({quant.get('quant_method', '?')}) are "
                         "not supported; dequantize to bf16/fp32 first")
    if f.bool("use_bidirectional_attention", False):
        raise ValueError(f"{f.where}: use_bidirectional_attention=true (an encoder) is not supported; the decoder "
                         "is causal")
    H = f.int("num_attention_heads")
    E = f.int("hidden_size")
    L = f.int("num_hidden_layers")
    common = dict(vocab_size=f.int("vocab_size"), hidden_size=E, num_layers=L,
                  num_heads=H, intermediate_size=f.int("intermediate_size"),
                  tie_word_embeddings=f.bool("tie_word_embeddings", False),
                  rms_norm_eps=f.float("rms_norm_eps", 1e-6),
                  max_position_embeddings=f.int("max_position_embeddings", 2048), hidden_act=act)
    f.float("rope_theta", None)  # type-checked here; resolved with the rope dict below
    f.dict("rope_scaling")
    f.dict("rope_parameters")
    if fam.mla:
        k_dense = f.int("first_k_dense_replace", 0, low=0)
        experts = f.int("n_routed_experts", 0, low=0)
        mlp_types = c.get("mlp_layer_types")
        if mlp_types is not None and (not isinstance(mlp_types, list) or len(mlp_types) != L
                                      or any(t not in ("dense", "sparse") for t in mlp_types)):
            raise ValueError(f"{f.where} field 'mlp_layer_types' must list 'dense' / 'sparse' for each of the {L} "
                             f"layers, got {mlp_types!r:.200}")
        sparse = ([i for i, t in enumerate(mlp_types) if t == "sparse"] if mlp_types is not None
                  else list(range(k_dense, L)) if experts else [])
        if sparse:
            raise ValueError(f"this DeepSeek config has mixture-of-experts layers {sparse[:8]} (first_k_dense_replace="
                             f"{k_dense}, num_hidden_layers={L}, n_routed_experts={experts}, mlp_layer_types="
                             f"{mlp_types}); attnkit.models loads dense-MLP checkpoints only")
        rope_dim = f.int("qk_rope_head_dim")
        index = {}
        if fam.indexed:
            index = dict(index_topk=f.int("index_topk"), index_n_heads=f.int("index_n_heads"),
                         index_head_dim=f.int("index_head_dim"))
        interleave = fam.fields.get("rope_interleave", f.bool("rope_interleave", True))
        return DecoderConfig(**common, attention="mla", head_dim=f.int("v_head_dim"),
                             kv_lora_rank=f.int("kv_lora_rank"), q_lora_rank=f.int("q_lora_rank", None),
                             qk_nope_head_dim=f.int("qk_nope_head_dim"), qk_rope_head_dim=rope_dim,
                             v_head_dim=f.int("v_head_dim"), rope_interleave=interleave,
                             attention_bias=f.bool("attention_bias", False), **index, **_rope_fields(c, rope_dim))
    kv = f.int("num_key_value_heads", H)
    head_dim = f.int("head_dim", None)
    if head_dim is None:
        if E % H:
            raise ValueError(f"{f.where}: hidden_size ({E}) is not divisible by num_attention_heads ({H}) and "
                             "there is no head_dim")
        head_dim = E // H
    attention = "mha" if kv == H else "mqa" if kv == 1 else "gqa"
    bias, out_bias = fam.bias if fam.bias is not None else (f.bool("attention_bias", False),) * 2
    types, window = _layer_types(f, fam, L)
    family: dict[str, Any] = dict(fam.fields)
    if fam.gemma:
        family.update(norm_style="gemma", norm_placement="sandwich", embedding_multiplier=E ** 0.5,
                      query_scale=f.float("query_pre_attn_scalar") ** -0.5,
                      attn_softcap=f.float("attn_logit_softcapping", None),
                      final_softcap=f.float("final_logit_softcapping", None))
    rope = _rope_fields(c, head_dim, "full_attention" if _nested_rope(c) else None)
    if fam.local_rope and "sliding_attention" in types:
        if _nested_rope(c):
            local = _rope_fields(c, head_dim, "sliding_attention")
        else:  # v4 files: rope_local_base_freq, default RoPE on the local layers
            local = {"rope_theta": f.float("rope_local_base_freq"), "rope_scaling": None}
        family.update(local_rope_theta=local["rope_theta"], local_rope_scaling=local["rope_scaling"])
    return DecoderConfig(**common, attention=attention, num_kv_heads=kv, head_dim=head_dim,
                         attention_bias=bias, attention_out_bias=out_bias, mlp_bias=f.bool("mlp_bias", False),
                         layer_types=tuple(types), sliding_window=window, **rope, **family)


def _nested_rope(c: dict) -> bool:
    """Whether the config's rope_parameters are per layer type (Gemma 3 in transformers v5)."""
    params = c.get("rope_parameters")
    return isinstance(params, Mapping) and any(k in params for k in ("full_attention", "sliding_attention"))


def config_dtype(c: dict) -> torch.dtype | None:
    name = c.get("dtype") or c.get("torch_dtype")
    if name is None:
        return None
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"config dtype {name!r} is not a torch floating dtype")
    return dt
