"""Explicit fusion of Linear layers that read the same input (as gpt-fast's ``model.py``).

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


class HeadInterleavedLoadHook:
    """``load_state_dict`` pre-hook for BLOOM / GPT-NeoX attention names: ``query_key_value``, a
    fused Linear whose output rows are ordered per head (H, 3, hd: head 0's q, k, v, then head
    1's, ...), becomes separate ``q_proj / k_proj / v_proj`` entries (which :class:`FusedLoadHook`
    then fuses when the module is fused), and ``dense`` becomes ``o_proj``. Weights and biases;
    only when the state dict has those names and not the module's own.

    Args:
        heads: H (those layouts have as many K/V heads as query heads).
        head_dim: hd.
    """

    def __init__(self, heads: int, head_dim: int):
        self.heads, self.head_dim = heads, head_dim

    def __call__(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs) -> None:
        H, hd = self.heads, self.head_dim
        for suffix in ("weight", "bias"):
            src = f"{prefix}query_key_value.{suffix}"
            if src in state_dict and f"{prefix}q_proj.{suffix}" not in state_dict \
                    and f"{prefix}qkv_proj.{suffix}" not in state_dict:
                t = state_dict[src]
                if t.dim() < 1 or t.shape[0] != 3 * H * hd:
                    error_msgs.append(f"size mismatch for {src}: {tuple(t.shape)} has {t.shape[0] if t.dim() else 0} "
                                      f"rows, expected 3 x {H} heads x {hd} = {3 * H * hd}")
                    continue
                del state_dict[src]
                parts = t.unflatten(0, (H, 3, hd)).transpose(0, 1)  # (3, H, hd, ...)
                for name, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                    state_dict[f"{prefix}{name}.{suffix}"] = part.flatten(0, 1)
            dense = f"{prefix}dense.{suffix}"
            if dense in state_dict and f"{prefix}o_proj.{suffix}" not in state_dict:
                state_dict[f"{prefix}o_proj.{suffix}"] = state_dict.pop(dense)
