"""How a sequence is cut into per-rank shards, and back.

Notation: P ranks (the context-parallel group), r a rank, S the global sequence length,
n = S / P the local length, c = S / (2P) a zigzag chunk.

Two layouts (``sharding=``):

* ``"contiguous"``: rank r holds tokens ``[r*n, (r+1)*n)``. Under a causal mask the last rank
  does P times the work of the first: its queries see every earlier token.
* ``"zigzag"`` (load-balanced): the sequence is cut into 2P chunks and rank r holds chunk r
  followed by chunk 2P-1-r (one from the front, one from the back), so every rank does the same
  causal work. With P = 2 and S = 8: rank 0 holds tokens ``0 1 6 7``, rank 1 holds ``2 3 4 5``.

A layout is a list of *ranges* ``(local_start, global_start, length)``: the contiguous pieces of
the global sequence a shard is made of, in local order. Every function here is pure and works
without ``torch.distributed`` (pass ``rank``/``world_size``) except :func:`gather_sequence`.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

__all__ = ["SHARDINGS", "shard_ranges", "shard_positions", "shard_sequence", "unshard_sequence",
           "gather_sequence", "padded_length"]

#: The sequence layouts attnkit's context parallelism understands.
SHARDINGS = ("zigzag", "contiguous")

Range = tuple[int, int, int]  # (local_start, global_start, length)


def _check_sharding(sharding) -> str:
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    return sharding


def _check_rank(rank, world_size) -> None:
    for name, val in (("rank", rank), ("world_size", world_size)):
        if not isinstance(val, int) or isinstance(val, bool):
            raise TypeError(f"{name} must be an int, got {type(val).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")


def _pieces(world_size: int, sharding: str) -> int:
    """How many equal pieces a sequence is cut into: P (contiguous) or 2P (zigzag)."""
    return 2 * world_size if sharding == "zigzag" else world_size


def padded_length(seq_len: int, world_size: int, sharding: str = "zigzag") -> int:
    """The smallest length >= ``seq_len`` that ``sharding`` can cut evenly over ``world_size``
    ranks (a multiple of 2P for zigzag, of P for contiguous). Pad to it and mask the padding out
    with ``attnkit.masks.KeyPadding(lengths)``."""
    _check_sharding(sharding)
    _check_rank(0, world_size)
    m = _pieces(world_size, sharding)
    return -(-seq_len // m) * m


def shard_ranges(local_len: int, rank: int, world_size: int, sharding: str = "zigzag") -> list[Range]:
    """The pieces of the global sequence that rank ``rank`` holds, as ``(local_start,
    global_start, length)``, for shards of ``local_len`` tokens (global length P * local_len)."""
    _check_sharding(sharding)
    _check_rank(rank, world_size)
    if sharding == "contiguous":
        return [(0, rank * local_len, local_len)]
    if local_len % 2:
        raise ValueError(f"zigzag sharding holds two equal chunks per rank, so the local length must be "
                         f"even; got {local_len} (global length {local_len * world_size}); pad the sequence "
                         f"to a multiple of 2 * world_size = {2 * world_size} (see padded_length)")
    c = local_len // 2
    return [(0, rank * c, c), (c, (2 * world_size - 1 - rank) * c, c)]


def shard_positions(seq_len: int, rank: int, world_size: int, sharding: str = "zigzag",
                    device: torch.device | str | None = None) -> Tensor:
    """(seq_len / P,) int64: the global position of every token of rank ``rank``'s shard (what RoPE
    needs on that rank)."""
    local_len = _local_len(seq_len, world_size, sharding)
    parts = [torch.arange(g, g + n, device=device) for _, g, n in shard_ranges(local_len, rank, world_size, sharding)]
    return torch.cat(parts)


def _local_len(seq_len: int, world_size: int, sharding: str) -> int:
    _check_sharding(sharding)
    _check_rank(0, world_size)
    m = _pieces(world_size, sharding)
    if seq_len % m:
        raise ValueError(f"{sharding} sharding over {world_size} ranks cuts the sequence into {m} equal pieces, "
                         f"but its length {seq_len} is not a multiple of {m}; pad it to "
                         f"{padded_length(seq_len, world_size, sharding)} and mask the padding with "
                         f"attnkit.masks.KeyPadding(lengths)")
    return seq_len // world_size


def _group_rank_size(group, rank, world_size) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if rank is not None or world_size is not None:
        raise ValueError("pass both rank and world_size, or neither (then they come from the process group)")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first, or pass "
                           "rank= and world_size=")
    return dist.get_rank(group), dist.get_world_size(group)


def shard_sequence(x: Tensor, dim: int, *, rank: int | None = None, world_size: int | None = None,
                   group=None, sharding: str = "zigzag") -> Tensor:
    """Rank ``rank``'s shard of the full sequence ``x`` along ``dim`` (a copy for zigzag, a view
    for contiguous). ``rank``/``world_size`` default to the process group's.

    Example: ``q_local = shard_sequence(q, dim=2)`` for q (B, H, S, D) gives (B, H, S / P, D).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    rank, world_size = _group_rank_size(group, rank, world_size)
    dim = _dim(x, dim)
    local_len = _local_len(x.shape[dim], world_size, sharding)
    parts = [x.narrow(dim, g, n) for _, g, n in shard_ranges(local_len, rank, world_size, sharding)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard_sequence(shards: Sequence[Tensor], dim: int, *, sharding: str = "zigzag") -> Tensor:
    """The full sequence from every rank's shard (in rank order): the inverse of
    :func:`shard_sequence`. Differentiable (plain ``cat``/``narrow``)."""
    if not isinstance(shards, (list, tuple)) or not shards or not all(isinstance(s, Tensor) for s in shards):
        raise TypeError("shards must be a non-empty list of tensors, one per rank in rank order")
    P = len(shards)
    dim = _dim(shards[0], dim)
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise ValueError(f"every shard must have the same shape, got {sorted(shapes)}")
    local_len = shards[0].shape[dim]
    pieces: list[tuple[int, Tensor]] = []
    for r, s in enumerate(shards):
        for lo, g, n in shard_ranges(local_len, r, P, sharding):
            pieces.append((g, s.narrow(dim, lo, n)))
    pieces.sort(key=lambda p: p[0])
    return torch.cat([t for _, t in pieces], dim)


def gather_sequence(x: Tensor, dim: int, *, group=None, sharding: str = "zigzag") -> Tensor:
    """All-gather every rank's shard of ``x`` and return the full sequence on every rank.

    A collective (every rank of ``group`` must call it); not differentiable (use it for outputs,
    checks and logging, not inside a model)."""
    import torch.distributed as dist

    P = _group_rank_size(group, None, None)[1]
    x = x.contiguous()
    shards = [torch.empty_like(x) for _ in range(P)]
    dist.all_gather(shards, x, group=group)
    return unshard_sequence(shards, dim, sharding=sharding)


def _dim(x: Tensor, dim: int) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for a tensor of shape "
                         f"{tuple(x.shape)}, got {dim!r}")
    return dim % x.dim()
