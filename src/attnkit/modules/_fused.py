"""Explicit fusion of Linear layers that read the same input (STYLE 12, as gpt-fast's ``model.py``).

A fused module owns one ``nn.Linear`` whose output rows are the parts' rows stacked in order
(q | k | v, gate | up). Checkpoints name the parts separately (Llama, Mistral, Qwen, DeepSeek) or
fused (Phi-3's ``qkv_proj`` / ``gate_up_proj``); a ``load_state_dict`` pre-hook converts whichever
form a state dict has into the form the module holds, weights and biases alike, so both load with
``strict=True``. ``state_dict()`` emits the module's own names (what ``named_parameters()`` says):
no copies at save time, and optimizer state, sharding and ``strict`` round trips keep working.
"""

from __future__ import annotations

import torch

__all__ = ["FusedLoadHook"]


class FusedLoadHook:
    """``load_state_dict`` pre-hook between one fused Linear and its separate parts.

    Args:
        fused: the fused Linear's name (``"qkv_proj"``).
        parts: the separate Linears' names in row order (``("q_proj", "k_proj", "v_proj")``).
        sizes: each part's output rows.
        to_fused: True on a fused module (parts in a state dict are concatenated into
            ``fused``); False on a module with separate parts (``fused`` is split into them).

    A state dict that already has the module's own names is left alone, as is one that has
    neither form complete (``strict`` then names what is missing). A part whose row count does not
    fit is reported as a size mismatch naming that part.
    """

    def __init__(self, fused: str, parts: tuple[str, ...], sizes: tuple[int, ...], *, to_fused: bool):
        self.fused, self.parts, self.sizes, self.to_fused = fused, tuple(parts), tuple(sizes), to_fused

    def __call__(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs) -> None:
        for suffix in ("weight", "bias"):
            fused = f"{prefix}{self.fused}.{suffix}"
            parts = [f"{prefix}{p}.{suffix}" for p in self.parts]
            if self.to_fused:
                if fused in state_dict or not all(p in state_dict for p in parts):
                    continue
                bad = [f"{p} has {state_dict[p].shape[0]} rows, expected {n}"
                       for p, n in zip(parts, self.sizes) if state_dict[p].dim() < 1 or state_dict[p].shape[0] != n]
                if bad:
                    error_msgs.append(f"size mismatch while fusing into {fused}: {'; '.join(bad)}")
                    continue
                state_dict[fused] = torch.cat([state_dict.pop(p) for p in parts])
            else:
                if fused not in state_dict or any(p in state_dict for p in parts):
                    continue
                t = state_dict[fused]
                if t.dim() < 1 or t.shape[0] != sum(self.sizes):
                    error_msgs.append(f"size mismatch for {fused}: {tuple(t.shape)} has "
                                      f"{t.shape[0] if t.dim() else 0} rows, expected {sum(self.sizes)} "
                                      f"({' + '.join(map(str, self.sizes))} for {', '.join(self.parts)})")
                    continue
                del state_dict[fused]
                for p, chunk in zip(parts, t.split(list(self.sizes))):
                    state_dict[p] = chunk
