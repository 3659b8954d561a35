"""Load Hugging Face checkpoints into :class:`attnkit.models.Decoder`, with torch alone.

A checkpoint directory is what ``save_pretrained`` writes: ``config.json`` plus
``model.safetensors`` (or sharded ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``), or ``pytorch_model.bin`` (+ index), read with
``torch.load(weights_only=True)``. Nothing is downloaded and no code from the checkpoint runs.

Safetensors is parsed here (no ``safetensors`` package needed): an 8-byte little-endian header
length, a JSON header ``{name: {dtype, shape, data_offsets}}``, then the raw little-endian data;
tensors are zero-copy views of a copy-on-write memory map until they are copied into the model.

Supported ``model_type``: "llama", "mistral" (without sliding window), "qwen2" (without sliding
window) and "deepseek_v3" with dense MLPs only (``first_k_dense_replace >= num_hidden_layers``;
routed-expert layers are refused). Names match with ``strict=True``; the only keys dropped are
stale RoPE buffers (``*.rotary_emb.inv_freq``) and DeepSeek's multi-token-prediction layers
(indices >= ``num_hidden_layers``), which the decoder does not run.
"""

from __future__ import annotations

import json
import math
import mmap
import pickle
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

import torch
from torch import Tensor

from ..rope import RotaryEmbedding
from .config import DecoderConfig
from .decoder import Decoder

__all__ = ["load_pretrained", "config_from_hf", "read_safetensors", "read_checkpoint"]

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
SUPPORTED_MODEL_TYPES = (*LLAMA_FAMILY, "deepseek_v3")

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20  # the safetensors spec's limit on the JSON header


# ---------------------------------------------------------------------------- tensors


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of a ``.safetensors`` file, as CPU tensors backed by a copy-on-write map of
    the file (nothing is read until used; writing to them never touches the file)."""
    path = Path(path)
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        raise RuntimeError("reading safetensors needs a little-endian machine")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        n = int.from_bytes(head, "little")
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path}: not a safetensors file (header length {n} for a {size}-byte file)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: safetensors header is not valid JSON: {e}") from None
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + n else None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header must be a JSON object")
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            shape = [int(s) for s in info["shape"]]
            start, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: bad header entry for tensor {name!r}: {info!r:.200}") from None
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if end - start != nbytes or start < 0 or base + end > size:
            raise ValueError(f"{path}: tensor {name!r} ({info['dtype']} {shape}) has data_offsets "
                             f"[{start}, {end}] that do not fit {nbytes} bytes in a {size}-byte file")
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        off = base + start
        if off % torch.empty((), dtype=dtype).element_size():  # unaligned: copy out
            t = torch.frombuffer(bytearray(mm[off:off + nbytes]), dtype=dtype)
        else:
            t = torch.frombuffer(mm, dtype=dtype, count=numel, offset=off)
        out[name] = t.reshape(shape)
    return out


def _load_bin(path: Path) -> dict[str, Tensor]:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise  # weights_only refused a global: torch's message says which
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise ValueError(f"{path}: not a readable PyTorch checkpoint (truncated or corrupt?): "
                         f"{type(e).__name__}: {e}") from None
    if not isinstance(sd, dict):
        raise ValueError(f"{path}: expected a state dict, got {type(sd).__name__}")
    return sd


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_checkpoint(directory: str | Path) -> dict[str, Tensor]:
    """All tensors of a ``save_pretrained`` directory: safetensors (single or sharded) first,
    else ``pytorch_model.bin`` (single or sharded) with ``weights_only=True``."""
    d = Path(directory)
    for single, index, reader in (("model.safetensors", "model.safetensors.index.json", read_safetensors),
                                  ("pytorch_model.bin", "pytorch_model.bin.index.json", _load_bin)):
        if (d / single).is_file():
            return reader(d / single)
        if (d / index).is_file():
            weight_map = _read_json(d / index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{d / index} has no weight_map")
            sd: dict[str, Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                if Path(shard).name != shard:
                    raise ValueError(f"{d / index} names shard {shard!r} outside the checkpoint directory")
                part = reader(d / shard)
                sd.update(part)
            missing = sorted(set(weight_map) - set(sd))
            if missing:
                raise ValueError(f"{d / index} lists tensors its shards lack: {missing[:5]}")
            return sd
    found = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
    raise FileNotFoundError(f"{d}: no model.safetensors, model.safetensors.index.json, pytorch_model.bin "
                            f"or pytorch_model.bin.index.json (found: {found})")


# ---------------------------------------------------------------------------- config


def _as_dict(cfg) -> dict[str, Any]:
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if hasattr(cfg, "to_dict"):  # a transformers PretrainedConfig
        return cfg.to_dict()
    raise TypeError(f"config must be a dict (config.json) or a Hugging Face config, got {type(cfg).__name__}")


def _rope_fields(c: dict, head_dim: int | None) -> dict:
    """rope_theta / rope_scaling of a config.json (v4 ``rope_scaling`` + ``rope_theta`` or v5
    ``rope_parameters``), resolved exactly as :meth:`RotaryEmbedding.from_hf_config` does."""
    ns = SimpleNamespace(**{**c, "head_dim": head_dim})
    rc = RotaryEmbedding.from_hf_config(ns, interleaved=False).config
    if rc.rotary_dim != rc.head_dim:
        raise ValueError(f"partial rotary embeddings (rotary_dim {rc.rotary_dim} of head_dim {rc.head_dim}) "
                         "are not supported by attnkit.models")
    scaling = None if rc.rope_type == "default" else {k: v for k, v in rc.scaling.items() if k != "rope_theta"}
    return {"rope_theta": rc.base, "rope_scaling": scaling}


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
    ``PretrainedConfig``). Field types are checked (errors name the field); architectures or
    options the decoder does not implement raise ValueError naming them, never silently
    approximated."""
    c = _as_dict(cfg)
    f = _Fields(c)
    mt = c.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {mt!r} is not supported; attnkit.models loads {SUPPORTED_MODEL_TYPES}")
    act = f.str("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (the decoder's MLP is SwiGLU with silu)")
    quant = f.dict("quantization_config")
    if quant:
        raise ValueError(f"quantized checkpoints ({quant.get('quant_method', '?')}) are "
                         "not supported; dequantize to bf16/fp32 first")
    H = f.int("num_attention_heads")
    E = f.int("hidden_size")
    common = dict(vocab_size=f.int("vocab_size"), hidden_size=E, num_layers=f.int("num_hidden_layers"),
                  num_heads=H, intermediate_size=f.int("intermediate_size"),
                  tie_word_embeddings=f.bool("tie_word_embeddings", False),
                  rms_norm_eps=f.float("rms_norm_eps", 1e-6),
                  max_position_embeddings=f.int("max_position_embeddings", 2048))
    f.float("rope_theta", None)  # type-checked here; resolved with the rope dict below
    f.dict("rope_scaling")
    if mt == "deepseek_v3":
        L = common["num_layers"]
        k_dense = f.int("first_k_dense_replace", 0, low=0)
        experts = f.int("n_routed_experts", 0, low=0)
        if experts and k_dense < L:
            raise ValueError(f"this DeepSeek-V3 config has mixture-of-experts layers (first_k_dense_replace="
                             f"{k_dense} < num_hidden_layers={L}, n_routed_experts={experts}); "
                             "attnkit.models loads dense-MLP checkpoints only")
        rope_dim = f.int("qk_rope_head_dim")
        return DecoderConfig(**common, attention="mla", head_dim=f.int("v_head_dim"),
                             kv_lora_rank=f.int("kv_lora_rank"), q_lora_rank=f.int("q_lora_rank", None),
                             qk_nope_head_dim=f.int("qk_nope_head_dim"), qk_rope_head_dim=rope_dim,
                             v_head_dim=f.int("v_head_dim"), rope_interleave=f.bool("rope_interleave", True),
                             attention_bias=f.bool("attention_bias", False), **_rope_fields(c, rope_dim))
    if mt == "mistral" and f.int("sliding_window", None) is not None:
        raise ValueError(f"Mistral with sliding_window={c['sliding_window']} is not supported by the decoder "
                         "(full causal attention only); set sliding_window to null to load it as full attention")
    if mt == "qwen2" and f.bool("use_sliding_window", False):
        raise ValueError("Qwen2 with use_sliding_window=true is not supported (full causal attention only)")
    kv = f.int("num_key_value_heads", H)
    head_dim = f.int("head_dim", None)
    if head_dim is None:
        if E % H:
            raise ValueError(f"{f.where}: hidden_size ({E}) is not divisible by num_attention_heads ({H}) and "
                             "there is no head_dim")
        head_dim = E // H
    attention = "mha" if kv == H else "mqa" if kv == 1 else "gqa"
    if mt == "qwen2":
        bias, out_bias = True, False
    elif mt == "mistral":
        bias = out_bias = False
    else:
        bias = out_bias = f.bool("attention_bias", False)
    return DecoderConfig(**common, attention=attention, num_kv_heads=kv, head_dim=head_dim,
                         attention_bias=bias, attention_out_bias=out_bias,
                         mlp_bias=f.bool("mlp_bias", False), **_rope_fields(c, head_dim))


def _config_dtype(c: dict) -> torch.dtype | None:
    name = c.get("dtype") or c.get("torch_dtype")
    if name is None:
        return None
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"config dtype {name!r} is not a torch floating dtype")
    return dt


# ---------------------------------------------------------------------------- loading


def _prepare_state_dict(sd: dict[str, Tensor], cfg: DecoderConfig, c: dict, path: Path) -> dict[str, Tensor]:
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if c.get("model_type") == "deepseek_v3":  # multi-token-prediction layers live past the last layer
        layer = re.compile(r"model\.layers\.(\d+)\.")
        sd = {k: v for k, v in sd.items()
              if not ((m := layer.match(k)) and int(m.group(1)) >= cfg.num_layers)}
    if cfg.tie_word_embeddings:
        emb = sd.get("model.embed_tokens.weight")
        head = sd.get("lm_head.weight")
        if emb is not None and head is None:
            sd["lm_head.weight"] = emb
        elif emb is not None and head is not None and not torch.equal(emb, head):
            raise ValueError(f"{path}: tie_word_embeddings is true but lm_head.weight differs from "
                             "model.embed_tokens.weight")
    return sd


def load_pretrained(path: str | Path, *, dtype: torch.dtype | None = None, device=None) -> Decoder:
    """A :class:`Decoder` with the weights of a Hugging Face checkpoint directory.

    Args:
        path: a directory written by ``save_pretrained`` (``config.json`` + weights).
        dtype: the model's dtype (default: the config's ``dtype`` / ``torch_dtype``, else fp32).
        device: where to put the model (default CPU).

    Every checkpoint tensor must match a parameter by name and shape and every parameter must be
    in the checkpoint (``strict=True``); the error lists the differences. The model is returned
    in eval mode; ``model.hf_config`` keeps the config dict (e.g. its ``eos_token_id``).
    """
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"{d} is not a directory (expected a save_pretrained checkpoint folder)")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d} has no config.json")
    c = _read_json(d / "config.json")
    cfg = config_from_hf(c)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a torch floating dtype, got {dtype!r}")
    dtype = dtype or _config_dtype(c) or torch.float32
    sd = _prepare_state_dict(read_checkpoint(d), cfg, c, d)
    model = Decoder(cfg, dtype=dtype, device=device, init_std=None)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{d}: the checkpoint does not match attnkit's {c['model_type']} decoder "
                         f"(strict name and shape matching):\n{e}") from None
    model.hf_config = c
    return model.eval()
