"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Every rank holds its shard of q, k, v (B, H, S/P, D). K/V shards travel around the ring (rank r
sends to r+1 and receives from r-1) with ``torch.distributed`` point-to-point ops
(``batch_isend_irecv``: NCCL on GPUs, gloo on CPU). At each of the P steps a rank starts sending
the K/V block it holds and receiving the next one, attends its queries to the block it holds
while that transfer is in flight, and merges the partial result exactly with its log-sum-exp.

Backward is the same ring again: K/V travel as in forward (the next block is prefetched while
this one is computed), and each K/V block's gradient accumulator travels *with* it (as in
ring-flash-attention): the rank holding a block adds its queries' share into the accumulator it
received and passes it on, so after P steps (one more hop) every accumulator arrives at the rank
that owns the block.

Memory over overlap: the dK/dV hop is waited for at once, after the step's compute, and the
accumulator is added to in place, so a rank holds at most two dK/dV sets (the one sent and the
one arriving, only during the hop). Overlapping the hop with the next step's compute would need
a third (a fresh block to fill while the accumulator is still on its way): 2 more shard-sized
buffers per rank, at the peak. The price is P hops of 2 fp32 shards per backward on the critical
path; the hop grows like S/P while a step's compute grows like (S/P)^2, so it is a small share
at the lengths context parallelism is for (``benchmarks/bench_ring.py``,
``benchmarks/results/ring.md``). Peak per rank, in shard-sized tensors:
q, k, v, out, dq and the caller's dout (6), plus the K/V block in use, the next one arriving and
the accumulator while computing, or the K/V block and two accumulators during the hop: 12 either
way (fp16/bf16: the accumulators are fp32), against 8 for 1/P of a single process. Score tiles
(below) come on top while computing. No other shard-sized temporaries: K/V tiles are converted
to the compute dtype tile by tile, delta = rowsum(dout * out) is computed a slab of rows at a
time, and dq / dk / dv are accumulated in place.

Masks are evaluated per block at global indices (:func:`attnkit.distributed.blocks.mask_at`):
causal, key padding, documents, sliding windows, prefix-LM and bool tensors over the full
(B, H, S, S) problem (held by every rank, so O(S^2) memory: fine for tests, not for long
sequences). Blocks a mask leaves empty are skipped, which is what makes zigzag sharding cheap.

The modifiers of today's models: ``softcap`` caps every tile's scores; ALiBi's distance bias is
computed per tile from global indices (tile-sized, never over the whole problem); ``sinks``
enter once, after the last block is merged (:func:`attnkit.backends.common.with_sinks`), and the
backward then runs on the final log-sum-exp that includes them. Each rank's sink gradient is its
queries' share (sum over the group, like the weights of :class:`ContextParallel`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from .._checks import check_sinks, positive_number
from ..backends.common import with_sinks
from ..functional import check_qkv
from ..masks import ALiBi, And, Causal, Mask, ReducedMask, as_mask
from .blocks import block_backward, block_forward, compute_dtype, mask_at, merge_partials, softmax_delta
from .sharding import SHARDINGS, shard_ranges

__all__ = ["ring_attention"]

# Score tiles (B * Hq * rows * keys elements; backward holds two at once) are a quarter of this
# rank's q shard, within [2^18, 2^25] elements: the workspace then scales with the shard, like
# the activations, instead of with (S/P)^2 (half a shard on top of the ring's 12 while computing
# on a middle block; the 2^18 floor, 1 MiB in fp32, keeps small shards from paying Python overhead
# per tiny tile, and weighs more than that below 2^20-element shards). Tiles merge exactly
# (log-sum-exp), so tiling changes nothing but memory and which tiles a mask lets us skip. Tests
# set _TILE_ELEMENTS to force many small tiles.
_TILE_MIN, _TILE_MAX = 1 << 18, 1 << 25
_TILE_ELEMENTS: int | None = None


class _Plan:
    """Which (query rows, key columns) tiles of each ring step to compute, and their masks.

    Built once per call from this rank's layout; forward and backward walk the same tiles."""

    def __init__(self, mask: Mask | None, *, rank: int, world: int, sharding: str, batch: int, heads: int,
                 q_local: int, kv_local: int, head_dim: int, device: torch.device, alibi: ALiBi | None = None,
                 dtype: torch.dtype = torch.float32):
        self.mask, self.rank, self.world, self.sharding = mask, rank, world, sharding
        self.batch, self.heads, self.device = batch, heads, device
        self.q_len, self.kv_len = q_local * world, kv_local * world
        self.q_ranges = shard_ranges(q_local, rank, world, sharding)
        self.kv_local = kv_local
        self.mod = None if mask is None else mask.mask_mod(self.q_len, self.kv_len, device)
        # Causal terms let whole tiles be skipped (or taken unmasked) from their index ranges alone.
        causal_terms = [mask] if isinstance(mask, Causal) else \
            list(mask.masks) if isinstance(mask, And) else []
        self.causal_offsets = [self.kv_len - self.q_len if c.align == "bottom_right" else 0
                               for c in causal_terms if isinstance(c, Causal) and c.q_start is None]
        self.pure_causal = isinstance(mask, Causal) and mask.q_start is None
        # ALiBi: slope[h] * (j - p_i) with p_i query i's global position in key coordinates.
        self.slopes = self.q_pos = None
        if alibi is not None:
            self.slopes = alibi.slopes.to(device=device, dtype=dtype).view(1, heads, 1, 1)
            self.q_pos = alibi.positions(self.q_len, self.kv_len, device)  # (B|1, Sq)
        budget = _TILE_ELEMENTS or min(_TILE_MAX, max(_TILE_MIN, batch * heads * q_local * head_dim // 4))
        # Square tiles: along a causal diagonal only the tiles the mask reaches are computed.
        self.side = max(1, math.isqrt(budget // max(1, batch * heads)))

    def tiles(self, src: int):
        """Yield (query slice, key slice, allowed or None, causal, bias or None) for the K/V block
        of rank ``src``; ``causal`` marks a square tile on a pure causal mask's diagonal (top-left
        causal within the tile, ``allowed`` None); ``bias`` is the tile's ALiBi (B|1, Hq, n, m).
        Tiles the mask leaves empty are not yielded."""
        for qs, ks, qa, ka, allowed, causal in self._tiles(src):
            bias = None
            if self.slopes is not None:
                rows = self.q_pos[:, qa:qa + qs.stop - qs.start, None]  # (B|1, n, 1)
                cols = torch.arange(ka, ka + ks.stop - ks.start, device=self.device)
                bias = self.slopes * (cols - rows).to(self.slopes.dtype)[:, None]
            yield qs, ks, allowed, causal, bias

    def _tiles(self, src: int):
        kv_ranges = shard_ranges(self.kv_local, src, self.world, self.sharding)
        side = self.side
        for q_lo, q_g, q_n in self.q_ranges:
            for r0 in range(0, q_n, side):
                r1 = min(q_n, r0 + side)
                qa, qb = q_g + r0, q_g + r1 - 1  # first and last global query index of the tile
                for k_lo, k_g, k_n in kv_ranges:
                    for c0 in range(0, k_n, side):
                        c1 = min(k_n, c0 + side)
                        ka, kb = k_g + c0, k_g + c1 - 1
                        # Causal j <= i + off: nothing allowed if the first key is past the last query.
                        if any(ka > qb + off for off in self.causal_offsets):
                            continue
                        qs, ks = slice(q_lo + r0, q_lo + r1), slice(k_lo + c0, k_lo + c1)
                        if self.mask is None or (self.pure_causal and kb <= qa + self.causal_offsets[0]):
                            yield qs, ks, qa, ka, None, False
                            continue
                        if self.pure_causal and ka == qa + self.causal_offsets[0] and c1 - c0 == r1 - r0:
                            yield qs, ks, qa, ka, None, True  # the diagonal: top-left causal within the tile
                            continue
                        allowed = mask_at(self.mask, torch.arange(qa, qb + 1, device=self.device),
                                          torch.arange(ka, kb + 1, device=self.device), batch=self.batch,
                                          heads=self.heads, q_len=self.q_len, kv_len=self.kv_len,
                                          mask_mod=self.mod)
                        if not bool(allowed.any()):
                            continue
                        yield qs, ks, qa, ka, (None if bool(allowed.all()) else allowed), False


class _Ring:
    """Point-to-point neighbours of this rank in ``group``: send to r+1, receive from r-1."""

    def __init__(self, group, rank: int, world: int):
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
        self.prev = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world

    def start(self, send: list[Tensor], recv: list[Tensor]):
        """Start sending ``send`` to the next rank and receiving ``recv`` from the previous one."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recv]
        return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(reqs) -> None:
        for r in reqs:
            r.wait()


def _forward(q, k, v, sinks, plan: _Plan, ring: _Ring, scale: float, softcap) -> tuple[Tensor, Tensor]:
    """out and lse over the whole ring (the sinks joined), in the compute dtype."""
    B, Hq, Sq, _ = q.shape
    ct = compute_dtype(q.dtype)
    out = q.new_zeros(B, Hq, Sq, v.shape[-1], dtype=ct)
    lse = q.new_full((B, Hq, Sq), float("-inf"), dtype=ct)
    comm = plan.world > 1 and k.numel() + v.numel() > 0
    k_cur, v_cur = k, v
    for step in range(plan.world):
        reqs = None
        if comm and step < plan.world - 1:
            k_next, v_next = torch.empty_like(k_cur), torch.empty_like(v_cur)
            reqs = ring.start([k_cur, v_cur], [k_next, v_next])  # in flight during this step's compute
        src = (plan.rank - step) % plan.world
        # K/V tiles go to the block functions as they are: they convert each tile to the compute
        # dtype themselves (no shard-sized fp32 copy of a fp16/bf16 block).
        for qs, ks, allowed, causal, bias in plan.tiles(src):
            bo, bl = block_forward(q[:, :, qs], k_cur[:, :, ks], v_cur[:, :, ks], allowed, scale, causal=causal,
                                   softcap=softcap, bias=bias)
            out[:, :, qs], lse[:, :, qs] = merge_partials(out[:, :, qs], lse[:, :, qs], bo, bl)
        if reqs is not None:
            ring.wait(reqs)
            # The requests hold their tensors: drop them too, or the block just sent stays alive.
            k_cur, v_cur = k_next, v_next
            del reqs, k_next, v_next
    if sinks is not None:  # once, over every key of the row
        out, lse = with_sinks(out, lse, sinks.detach())
    return out, lse


def _backward(q, k, v, sinks, out, lse, dout, plan: _Plan, ring: _Ring, scale: float, softcap):
    """Returns dq, dk, dv in the compute dtype, and d sinks (this rank's rows' share) or None.

    ``lse`` is the final one, sinks included: each tile's probabilities exp(s - lse) are then the
    true ones, and a sink's gradient is -sum over rows of p_sink * delta.

    Shard-sized buffers alive at once, besides q, k, v, out, dout and dq: the K/V block being
    used, the next one arriving (double buffering), and ONE dK/dV accumulator while computing;
    the block being used and TWO dK/dV accumulators (the one sent, the one arriving) during
    the dK/dV hop. The hop therefore does not overlap compute (see the module docstring)."""
    ct = compute_dtype(q.dtype)
    delta = softmax_delta(out, dout)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    comm = plan.world > 1 and k.numel() + v.numel() > 0
    k_cur, v_cur = k, v
    # The accumulator of the block held this step: at step 0 this rank's own block, which starts
    # here; afterwards the one the previous rank passed on, which this rank adds its share to.
    dk_acc = torch.zeros(k.shape, dtype=ct, device=k.device)
    dv_acc = torch.zeros(v.shape, dtype=ct, device=v.device)
    for step in range(plan.world):
        kv_reqs = None
        if comm and step < plan.world - 1:
            k_next, v_next = torch.empty_like(k_cur), torch.empty_like(v_cur)
            kv_reqs = ring.start([k_cur, v_cur], [k_next, v_next])  # in flight during this step's compute
        src = (plan.rank - step) % plan.world
        for qs, ks, allowed, causal, bias in plan.tiles(src):
            block_backward(q[:, :, qs], k_cur[:, :, ks], v_cur[:, :, ks], dout[:, :, qs], lse[:, :, qs],
                           delta[:, :, qs], allowed, scale, dq_out=dq[:, :, qs], dk_out=dk_acc[:, :, ks],
                           dv_out=dv_acc[:, :, ks], causal=causal, out=out[:, :, qs], softcap=softcap, bias=bias)
        # Free the block just used before the hop allocates its receive buffers: swap in the
        # next one (its transfer ran during the compute), or drop the last one.
        if kv_reqs is not None:
            ring.wait(kv_reqs)
            k_cur, v_cur = k_next, v_next
            del kv_reqs, k_next, v_next  # the requests hold their tensors: drop them too
        elif step == plan.world - 1:
            k_cur = v_cur = None
        if comm:
            # Pass this block's accumulator on and receive the one of the block held next step;
            # waited for at once, so the sent one is freed before the next receive buffers exist.
            # After the last step this hop delivers every accumulator to the rank that owns it.
            dk_in, dv_in = torch.empty_like(dk_acc), torch.empty_like(dv_acc)
            ring.wait(ring.start([dk_acc, dv_acc], [dk_in, dv_in]))
            dk_acc, dv_acc = dk_in, dv_in
            del dk_in, dv_in
    dsinks = None
    if sinks is not None:
        p_sink = torch.exp(sinks.detach().to(ct).view(1, -1, 1) - lse.to(ct))  # (B, Hq, Sq/P)
        dsinks = -(p_sink * delta).sum((0, 2))
    return dq, dk_acc, dv_acc, dsinks


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan, ring, scale, softcap):
        out, lse = _forward(q, k, v, sinks, plan, ring, scale, softcap)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.plan, ctx.ring, ctx.scale, ctx.softcap = plan, ring, scale, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        dq, dk, dv, dsinks = _backward(q, k, v, sinks, out, lse, dout.contiguous(), ctx.plan, ctx.ring, ctx.scale,
                                       ctx.softcap)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None if dsinks is None else dsinks.to(sinks.dtype),
                None, None, None, None)


def _validate(q, k, v, scale) -> float:
    return check_qkv(q, k, v, scale, layout="(this rank's shard: B, H, S/P, D)")


def _check_same_everywhere(values: list[int], names: list[str], group, device, rank: int) -> None:
    """One all-reduce: every rank must pass the same shapes and options, or peers would exchange
    buffers of different sizes (a hang or garbage on NCCL)."""
    t = torch.tensor(values + [-x for x in values], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    hi, lo = t[: len(values)].tolist(), [-x for x in t[len(values):].tolist()]
    bad = [f"{n}: this rank {x}, others between {a} and {b}" for n, x, a, b in zip(names, values, lo, hi) if a != b]
    if bad:
        raise ValueError(f"ring_attention: rank {rank} disagrees with other ranks of the group (every rank must pass "
                         f"shards of the same shape, dtype and options; pad uneven sequences): " + "; ".join(bad))


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, mask=None, scale: float | None = None,
                   group=None, sharding: str = "zigzag", softcap: float | None = None,
                   sinks: Tensor | None = None) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group`` (context parallelism).

    Every rank calls this with its shard; the result is this rank's shard of what
    :func:`attnkit.attention` gives on the gathered sequence, and gradients flow to this rank's
    q, k, v shards (backward is a ring too: every rank must run it).

    Args:
        q: (B, Hq, Sq/P, D) this rank's queries.
        k: (B, Hkv, Sk/P, D) this rank's keys; Hq must be a multiple of Hkv. Only Hkv heads travel.
        v: (B, Hkv, Sk/P, Dv) this rank's values.
        causal: bottom-right causal over the *global* sequence (j <= i + Sk - Sq).
        mask: None, an :mod:`attnkit.masks` object or a bool tensor, over the global
            (B, Hq, Sq, Sk) problem (``KeyPadding(lengths)``, ``Document(lengths)``,
            ``SlidingWindow``, ``ALiBi`` (at global positions), ...; every rank passes the same
            one). Other additive float masks are refused.
        scale: multiplies q @ k^T; default 1 / sqrt(D).
        softcap: c > 0: scores become c * tanh(scores / c) after scaling, before masks and ALiBi.
        sinks: (Hq,) learned logits, one per query head, joining each row's softmax denominator
            (no value); differentiable: this rank's sinks get its rows' share of the gradient.
        group: the process group of the context-parallel ranks (default: the world).
        sharding: how the sequence was cut: ``"zigzag"`` (load-balanced, the default of
            :func:`shard_sequence`) or ``"contiguous"``. It must match how q, k, v were sharded.

    Returns:
        (B, Hq, Sq/P, Dv) in q's dtype: this rank's shard of the output. Queries with nothing to
        attend to get exactly 0, with zero gradients.

    Equivalent code (what the tests check)::

        full = attnkit.attention(gather(q), gather(k), gather(v), mask, causal=causal, scale=scale)
        out = shard_sequence(full, dim=2, sharding=sharding)
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ring_attention needs torch.distributed: call torch.distributed.init_process_group "
                           "(for example under torchrun) first")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    scale = _validate(q, k, v, scale)
    softcap, sinks = positive_number("softcap", softcap, none_means=""), check_sinks(sinks, q)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this process is not a member of `group`")
    B, Hq, Sq_l, D = q.shape
    Hkv, Sk_l, Dv = k.shape[1], k.shape[2], v.shape[3]
    dtypes = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
    _check_same_everywhere(
        [B, Hq, Hkv, Sq_l, Sk_l, D, Dv, dtypes[q.dtype], int(bool(causal)), SHARDINGS.index(sharding),
         int(softcap is not None), int(sinks is not None)],
        ["batch", "q heads", "kv heads", "local q length", "local kv length", "head dim", "v head dim",
         "dtype", "causal", "sharding", "softcap", "sinks"], group, q.device, rank)
    if sharding == "zigzag" and (Sq_l % 2 or Sk_l % 2):
        raise ValueError(f"zigzag sharding holds two equal chunks per rank, so local lengths must be even; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}; pad the sequence to a multiple of 2 * world_size = "
                         f"{2 * world} (see attnkit.distributed.padded_length)")
    m = as_mask(mask, causal)
    alibi = None
    if m is not None:
        m.check(B, Hq, Sq_l * world, Sk_l * world)
        reduced = ReducedMask(m, B, Sq_l * world, Sk_l * world)
        m, alibi = reduced.rest, reduced.alibi
        if reduced.rest_has_bias:
            raise TypeError("ring_attention does not take additive (float) masks other than ALiBi (ANDed at the top "
                            "level): use a bool tensor or an attnkit.masks object (Causal, KeyPadding, Document, "
                            "SlidingWindow, ALiBi, ...)")
        if m is not None and m.allows_all(Sq_l * world, Sk_l * world):
            m = None
        if isinstance(mask, Tensor) and mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    plan = _Plan(m, rank=rank, world=world, sharding=sharding, batch=B, heads=Hq, q_local=Sq_l, kv_local=Sk_l,
                 head_dim=max(D, Dv), device=q.device, alibi=alibi, dtype=compute_dtype(q.dtype))
    ring = _Ring(group, rank, world)
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), sinks, plan, ring, scale, softcap)
