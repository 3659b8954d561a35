"""Read a Hugging Face checkpoint directory, with torch alone: its tensors, and
(:func:`read_pretrained`) its config and weights checked and named for :class:`attnkit.models.Decoder`.

A checkpoint directory is what ``save_pretrained`` writes: ``config.json`` plus
``model.safetensors`` (or sharded ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``), or ``pytorch_model.bin`` (+ index), read with
``torch.load(weights_only=True)``. Nothing is downloaded and no code from the checkpoint runs.

Safetensors is parsed here (no ``safetensors`` package needed): an 8-byte little-endian header
length, a JSON header ``{name: {dtype, shape, data_offsets}}``, then the raw little-endian data;
tensors are zero-copy views of a copy-on-write memory map until they are copied into the model.
"""

from __future__ import annotations

import json
import math
import mmap
import pickle
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .config import DecoderConfig
from .hf_configs import config_dtype, config_from_hf

__all__ = ["read_safetensors", "read_checkpoint", "read_json", "read_pretrained", "Pretrained"]

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20  # the safetensors spec's limit on the JSON header


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


def read_json(path: Path) -> dict:
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
            weight_map = read_json(d / index).get("weight_map")
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


@dataclass(frozen=True)
class Pretrained:
    """A checkpoint directory read and checked for :class:`attnkit.models.Decoder`.

    Attributes:
        path: the directory.
        hf_config: ``config.json`` as a dict.
        config: the :class:`DecoderConfig` it describes.
        dtype: the dtype to build the model in.
        state_dict: the tensors, under the decoder's names, without the ones it does not run.
    """

    path: Path
    hf_config: dict
    config: DecoderConfig
    dtype: torch.dtype
    state_dict: dict[str, Tensor]


def read_pretrained(path: str | Path, *, dtype: torch.dtype | None = None) -> Pretrained:
    """Read the ``save_pretrained`` directory ``path`` for a decoder in ``dtype`` (default: the
    config's ``dtype`` / ``torch_dtype``, else fp32).

    The only tensors dropped are stale RoPE buffers (``*.rotary_emb.inv_freq``) and DeepSeek's
    multi-token-prediction layers (indices >= ``num_hidden_layers``), which the decoder does not
    run; a tied head is filled from the embedding when the checkpoint leaves it out."""
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"{d} is not a directory (expected a save_pretrained checkpoint folder)")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d} has no config.json")
    c = read_json(d / "config.json")
    cfg = config_from_hf(c)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a torch floating dtype, got {dtype!r}")
    dtype = dtype or config_dtype(c) or torch.float32
    return Pretrained(d, c, cfg, dtype, _decoder_state_dict(read_checkpoint(d), cfg, c, d))


def _decoder_state_dict(sd: dict[str, Tensor], cfg: DecoderConfig, c: dict, path: Path) -> dict[str, Tensor]:
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if c.get("model_type") in ("deepseek_v3", "deepseek_v32"):  # multi-token-prediction layers past the last
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
