"""``ContextParallel``: run a :class:`attnkit.MultiHeadAttention` on a sharded sequence.

Each rank feeds its shard x (B, S/P, E) and gets its shard of the output (B, S/P, out_dim). The
wrapped module's own parameters are used (nothing is copied): projections (fused or not, QK-norm
included) run on the local tokens, RoPE rotates them at their *global* positions, and
:func:`ring_attention` does the attention over the whole sequence with the module's options
(scale, softcap, sinks, sliding window, ALiBi).

Weights are replicated: each rank's weight gradients are its shard's share, and the true
gradient is their sum over the group. Call :meth:`ContextParallel.all_reduce_grads` after
backward (or let DDP / FSDP over the context-parallel group do it, as for data parallelism).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._checks import shape_of
from ..masks import as_mask
from ..modules.attention import MultiHeadAttention
from ..modules.options import alibi_mask, and_masks, window_mask
from ..rope import RotaryAngles, RotaryEmbedding
from .ring import ring_attention
from .sharding import SHARDINGS, shard_positions

__all__ = ["ContextParallel"]


class ContextParallel(nn.Module):
    """Context-parallel self-attention with the weights of ``module``.

    Args:
        module: a :class:`attnkit.MultiHeadAttention` (MHA, GQA or MQA; causal or not; with or
            without RoPE, fused QKV, QK-norm, softcap, sinks, a window or ALiBi) built for
            self-attention (kdim = vdim = embed_dim).
        group: the process group of the context-parallel ranks (default: the world).
        sharding: ``"zigzag"`` (load-balanced, default) or ``"contiguous"``: how the inputs are
            sharded (:func:`attnkit.distributed.shard_sequence` with the same value).

    Self-attention over the whole sequence only: ``forward`` has no cache, cross-attention or
    ``need_weights`` arguments; attention dropout in training mode and additive float masks
    raise.
    """

    def __init__(self, module: MultiHeadAttention, group=None, sharding: str = "zigzag"):
        super().__init__()
        if not isinstance(module, MultiHeadAttention):
            raise TypeError(f"module must be an attnkit.MultiHeadAttention, got {type(module).__name__}")
        if sharding not in SHARDINGS:
            raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
        if module.kdim != module.embed_dim or module.vdim != module.embed_dim:
            raise ValueError(f"ContextParallel runs self-attention; the module has kdim={module.kdim}, "
                             f"vdim={module.vdim}, embed_dim={module.embed_dim}")
        self.module, self.group, self.sharding = module, group, sharding

    def forward(self, x: Tensor, *, mask=None, positions: Tensor | None = None) -> Tensor:
        """
        Args:
            x: (B, S/P, E) this rank's shard of the input ((S/P, B, E) with ``batch_first=False``).
            mask: an :mod:`attnkit.masks` object or bool tensor over the *global* (B, H, S, S)
                problem, ANDed with the module's causal flag (e.g. ``KeyPadding(lengths)``).
            positions: (B, S/P) or (1, S/P) global RoPE positions of this shard's tokens; default
                :func:`shard_positions` (token t of the full sequence is at position t).

        Returns:
            (B, S/P, out_dim): this rank's shard of the module's output on the full sequence.
        """
        m = self.module
        if m.training and m.dropout > 0:
            raise ValueError(f"ContextParallel does not support attention dropout (module.dropout={m.dropout}) "
                             "in training mode; set dropout=0 or call .eval()")
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise ValueError(f"x must be a 3-D tensor ({'B, S/P' if m.batch_first else 'S/P, B'}, {m.embed_dim}), "
                             f"got shape {shape_of(x)}")
        if not m.batch_first:
            x = x.transpose(0, 1)
        if x.shape[-1] != m.embed_dim:
            raise ValueError(f"x has width {x.shape[-1]} (shape {tuple(x.shape)}), expected {m.embed_dim}")
        B, S_loc, _ = x.shape
        angles = None
        if m.rope is not None:
            angles = self._angles(positions, B, S_loc, x.device)
        elif positions is not None:
            raise ValueError("positions given, but the module has no rope")
        q, k, v = m.project(x, x, x, angles)  # (B, H, S/P, hd), (B, Hkv, S/P, hd), (B, Hkv, S/P, hdv)
        # over the whole sequence: no cache, so the window and ALiBi anchor at global positions
        mask = and_masks(as_mask(mask), window_mask(m.window, None, B, x.device),
                         alibi_mask(m.alibi_slopes, None, B, x.device) if m.alibi else None)
        out = ring_attention(q, k, v, causal=m.causal, mask=mask, scale=m.scale, softcap=m.softcap, sinks=m.sinks,
                             group=self.group, sharding=self.sharding)
        out = m.o_proj(out.transpose(1, 2).flatten(2))
        return out if m.batch_first else out.transpose(0, 1)

    def _angles(self, positions, B: int, S_loc: int, device) -> RotaryAngles:
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        if positions is None:
            positions = shard_positions(S_loc * world, rank, world, self.sharding, device=device).expand(B, S_loc)
        rope = self.module.rope
        if not (isinstance(rope, RotaryEmbedding) and rope.rope_type == "dynamic"):
            return rope.angles(positions)
        # Dynamic NTK picks its frequencies from the largest position of the call: that is the
        # largest over the whole sequence, not this shard's. Append it as one extra position.
        if not isinstance(positions, Tensor) or positions.dim() != 2:
            raise ValueError(f"positions must be a (B, S/P) integer tensor, got "
                             f"{shape_of(positions)}")
        if positions.shape[1] != S_loc or positions.shape[0] not in (1, B):
            raise ValueError(f"positions of shape {tuple(positions.shape)} do not match (B, S/P) = ({B}, {S_loc})")
        top = positions.amax().reshape(1).to(torch.int64) if positions.numel() else \
            torch.zeros(1, dtype=torch.int64, device=positions.device)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
        extended = rope.angles(torch.cat((positions, top.to(positions.dtype).expand(positions.shape[0], 1)), dim=1))
        return RotaryAngles(extended.cos[:, :-1], extended.sin_signed[:, :-1], extended.config)

    @torch.no_grad()
    def all_reduce_grads(self) -> None:
        """Sum every parameter gradient of the wrapped module over the group (a collective: every
        rank calls it after backward). Afterwards each rank holds the full-sequence gradients."""
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)

    def extra_repr(self) -> str:
        return f"sharding={self.sharding!r}"
