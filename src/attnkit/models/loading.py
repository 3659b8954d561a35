"""Load Hugging Face checkpoints into :class:`attnkit.models.Decoder`, with torch alone.

A checkpoint directory is what ``save_pretrained`` writes: ``config.json`` plus the weights.
:func:`.checkpoints.read_pretrained` reads the directory (safetensors, single or sharded, or
``pytorch_model.bin`` with ``weights_only=True``); :mod:`.hf_configs` turns ``config.json`` into a
:class:`DecoderConfig` (the supported ``model_type`` values: :data:`SUPPORTED_MODEL_TYPES`);
:meth:`Decoder.from_pretrained` builds the model and loads the weights.
Nothing is downloaded and no code from the checkpoint runs.

Names match with ``strict=True`` (separate or fused projections load into either layout); the
only keys dropped are stale RoPE buffers (``*.rotary_emb.inv_freq``) and DeepSeek's
multi-token-prediction layers (indices >= ``num_hidden_layers``), which the decoder does not run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoints import Pretrained, read_checkpoint, read_pretrained, read_safetensors
from .decoder import Decoder
from .hf_configs import SUPPORTED_MODEL_TYPES, config_from_hf

__all__ = ["load_pretrained", "config_from_hf", "read_safetensors", "read_checkpoint", "read_pretrained",
           "Pretrained", "SUPPORTED_MODEL_TYPES"]


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
    return Decoder.from_pretrained(path, dtype=dtype, device=device)
