"""Load Hugging Face checkpoints into :class:`attnkit.models.Decoder`, with torch alone.

A checkpoint directory is what ``save_pretrained`` writes: ``config.json`` plus the weights.
:mod:`.checkpoints` reads the weights (safetensors, single or sharded, or ``pytorch_model.bin``
with ``weights_only=True``); :mod:`.hf_configs` turns ``config.json`` into a
:class:`DecoderConfig` (the supported ``model_type`` values: :data:`SUPPORTED_MODEL_TYPES`).
Nothing is downloaded and no code from the checkpoint runs.

Names match with ``strict=True`` (separate or fused projections load into either layout); the
only keys dropped are stale RoPE buffers (``*.rotary_emb.inv_freq``) and DeepSeek's
multi-token-prediction layers (indices >= ``num_hidden_layers``), which the decoder does not run.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor

from .checkpoints import read_checkpoint, read_json, read_safetensors
from .config import DecoderConfig
from .decoder import Decoder
from .hf_configs import SUPPORTED_MODEL_TYPES, config_dtype, config_from_hf

__all__ = ["load_pretrained", "config_from_hf", "read_safetensors", "read_checkpoint", "SUPPORTED_MODEL_TYPES"]


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
    c = read_json(d / "config.json")
    cfg = config_from_hf(c)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a torch floating dtype, got {dtype!r}")
    dtype = dtype or config_dtype(c) or torch.float32
    sd = _prepare_state_dict(read_checkpoint(d), cfg, c, d)
    model = Decoder(cfg, dtype=dtype, device=device, init_std=None)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{d}: the checkpoint does not match attnkit's {c['model_type']} decoder "
                         f"(strict name and shape matching):\n{e}") from None
    model.hf_config = c
    return model.eval()
