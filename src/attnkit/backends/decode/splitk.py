"""The split-K engine: one algorithm of few-query attention on CPU over contiguous or paged K/V,
shared by the ``decode`` and ``paged`` backends; its merge rule
(:func:`attnkit.backends.common.merge_partials`) is the ring's too.

Notation: B batch, Hq / Hkv query / KV heads, G = Hq // Hkv, Sq queries per sequence, M = G * Sq
query rows per KV head, Sk keys, D / Dv head dims.

Two implementations with one semantics:

* native (:mod:`attnkit.native`): a C++ kernel compiled on first use for the CPU it runs
  on, threads from torch's intra-op pool. Each unit (sequence, KV head, key slice) streams its
  keys once for all M query rows, converting fp16/bf16 rows to fp32 in registers-sized tiles,
  with an online softmax; slices merge by log-sum-exp.
* torch (:mod:`attnkit.backends.decode.torch_impl`): the same in torch ops, key chunk by key
  chunk, when no compiler is available.

The mask reaches the engine as one interval of keys per query row (``Mask.key_range``: causal,
windows, padding, the paged ``lengths``), so nothing of size (Sq, Sk) is built; a mask that is not
an interval becomes an fp32 bias. A per-query selection (:class:`~attnkit.masks.SelectedKeys`,
:class:`~attnkit.masks.SelectedBlocks`, cut by intervals, joined with one) reaches it as lists of
key positions (:meth:`ReducedSelection.lists`): the engine walks each query's list, so a step
costs the selection, not the context (:func:`reads_selection` says when). Contract (as :func:`attnkit.attention`): a row with no visible
key is exactly 0 (lse -inf); NaN in a visible score gives NaN.

:func:`splitk_attention` parses its arguments into a :class:`SplitKCall` (:func:`parse_call`),
then :func:`run_call` turns the mask into key intervals and hands them to the implementation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ... import native
from ...masks import Mask, ReducedMask
from ..common import v_is_prefix_of_k, with_sinks
from .torch_impl import torch_selected, torch_splitk

__all__ = ["Q_CHUNK", "SELECTION_Q_CHUNK", "SplitKCall", "implementation", "parse_call", "reads_selection", "run_call",
           "splitk_attention"]

#: Query rows per engine call. A call scores all G * Sq rows of a KV head against each key tile,
#: with partial results per key slice: longer calls (prefill with a soft cap, which no SDPA kernel
#: takes) go a chunk of queries at a time, which bounds those buffers and lets each chunk stop at
#: the last key its rows see (causal prefill does about half the work).
Q_CHUNK = 64

#: Queries per engine call with a selection (each its own list): bounds the lists and the partial
#: results (about ``SELECTION_Q_CHUNK * Hq * Dv`` fp32 a slice) of a prefill.
SELECTION_Q_CHUNK = 256

#: Bytes of K/V rows the torch implementation gathers per chunk of a selection's queries.
_GATHER_BYTES = 32 << 20


def reads_selection(reduced: ReducedMask, num_kv_heads: int) -> bool:
    """True when the engine walks the call's selection in place (a list of keys per query): the
    mask is a selection the lists describe (:attr:`ReducedMask.selection`) with one list per
    group of whole KV heads (Hs divides Hkv). Else a selection takes the dense path: an fp32 bias
    over (B, Hq, Sq, Sk), exact but as costly as the context."""
    sel = reduced.selection
    return sel is not None and num_kv_heads % sel.heads == 0


def implementation() -> str:
    """"native" or "torch": the implementation the engine runs on this machine."""
    return "native" if native.load() is not None else "torch"


@dataclass(slots=True)
class SplitKCall:
    """One engine call, its arguments parsed: what :func:`run_call` needs and nothing to decide.

    ``v`` None means V is ``k[..., :v_head_dim]`` (also when a given ``v`` was that view of
    ``k``); ``num_kv_heads`` and ``kv_len`` are read from the dense K or the pools and
    ``block_table``; ``reduced`` is the mask reduced over (B, Hq, Sq, Sk); ``sinks`` fp32;
    ``ops`` the native ops (``torch.ops.attnkit_cpu``), or None for the torch implementation."""

    q: Tensor
    k: Tensor
    v: Tensor | None
    v_head_dim: int
    num_kv_heads: int
    kv_len: int
    scale: float
    reduced: ReducedMask
    block_table: Tensor | None
    sinks: Tensor | None
    softcap: float | None
    k_scale: Tensor | None
    v_scale: Tensor | None
    return_lse: bool
    ops: object | None


def splitk_attention(q: Tensor, k: Tensor, v: Tensor | None, *, scale: float,
                     mask: Mask | ReducedMask | None = None,
                     block_table: Tensor | None = None, v_head_dim: int | None = None, kv_len: int | None = None,
                     sinks: Tensor | None = None, softcap: float | None = None,
                     k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                     return_lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """Attention on CPU without autograd: a decode step's few queries in one engine call, longer
    calls (soft-capped or ALiBi prefill) a chunk of :data:`Q_CHUNK` queries at a time.

    Args:
        q: (B, Hq, Sq, D).
        k, v: dense (B, Hkv, Sk, D) / (B, Hkv, Sk, Dv), or with ``block_table`` the pools
            (N, bs, Hkv, D) / (N, bs, Hkv, Dv). ``v=None``: V is K[..., :v_head_dim].
        mask: an attnkit mask over (B, Hq, Sq, Sk) (the paged lengths already folded in), or the
            call's :class:`attnkit.masks.ReducedMask` (what the backend passes).
        block_table: (B, W) block ids for paged pools; ``kv_len`` is then the logical Sk.
        sinks: (Hq,) per query head or (B|1, Hq, Sq) per query: logits joining each row's
            denominator; softcap: c of c * tanh(s / c);
            an :class:`attnkit.masks.ALiBi` in ``mask`` is applied per score.
        k_scale, v_scale: quantized K/V (int8 / fp8 ``k`` and ``v``, :mod:`attnkit.kvquant`): fp32
            scales of their rows, ``k.shape[:3]`` / ``v.shape[:3]`` (``v_scale`` None with ``v``
            None). A key's score is its dot product with the quantized row times its K scale, and
            its probability is multiplied by its V scale before P @ V: attention over
            ``data * scale`` without building it.

    Returns:
        out (B, Hq, Sq, Dv) in q's dtype and, with ``return_lse``, lse (B, Hq, Sq) fp32 (without
        the sinks).
    """
    call = parse_call(q, k, v, scale=scale, mask=mask, block_table=block_table, v_head_dim=v_head_dim,
                      kv_len=kv_len, sinks=sinks, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
                      return_lse=return_lse)
    return run_call(call)


def parse_call(q: Tensor, k: Tensor, v: Tensor | None, *, scale: float, mask: Mask | ReducedMask | None = None,
               block_table: Tensor | None = None, v_head_dim: int | None = None, kv_len: int | None = None,
               sinks: Tensor | None = None, softcap: float | None = None, k_scale: Tensor | None = None,
               v_scale: Tensor | None = None, return_lse: bool = False) -> SplitKCall:
    """:func:`splitk_attention`'s arguments as a :class:`SplitKCall`: V read from K where it is a
    view of K's first channels (MLA), the sizes read from the layout, the mask reduced, and the
    implementation chosen."""
    B, Hq, Sq, D = q.shape
    if v is not None and block_table is None and v_is_prefix_of_k(k, v) and (
            k_scale is None or v_scale is None or v_scale is k_scale):
        v_head_dim, v, v_scale = v.shape[-1], None, None
    Dv = v.shape[-1] if v is not None else int(v_head_dim)
    Hkv = k.shape[2] if block_table is not None else k.shape[1]
    Sk = kv_len if block_table is not None else k.shape[2]
    reduced = mask if isinstance(mask, ReducedMask) else ReducedMask(mask, B, Sq, Sk)
    # Traced code never builds or loads the library (auto takes this engine under torch.compile
    # only once it is loaded): the op is called by name, its Meta kernel gives the shapes.
    ops = (torch.ops.attnkit_cpu if native.library_path() is not None else None) \
        if torch.compiler.is_compiling() else native.load()
    sinks32 = None
    if sinks is not None:  # (Hq,) per query head, or (B|1, Hq, Sq) per query, as the kernel reads them
        sinks32 = sinks.detach().float()
        sinks32 = (sinks32 if sinks32.dim() == 1 else sinks32.expand(B, Hq, Sq)).contiguous()
    return SplitKCall(q, k, v, Dv, Hkv, Sk, scale, reduced, block_table, sinks32, softcap, k_scale, v_scale,
                      return_lse, ops)


def run_call(c: SplitKCall) -> tuple[Tensor, Tensor | None]:
    """Run a parsed call: the mask as key intervals (and a bias where it is not one), ALiBi as
    slopes and query positions, then the native kernel or the torch implementation; a call of
    more than :data:`Q_CHUNK` queries a chunk at a time."""
    q, reduced = c.q, c.reduced
    B, Hq, Sq, _ = q.shape
    if reads_selection(reduced, c.num_kv_heads):
        return _selected(c)
    if Sq > Q_CHUNK:
        return _chunked(c)
    if c.ops is not None and reduced.rest is None and c.block_table is None:
        lo = hi = bias = None  # the kernel's default: every row sees all Sk keys
    elif c.ops is not None and Sq == 1 and reduced.padding_lengths is not None:
        # A decode step over right-padded keys (a paged call's lengths, a static cache's step):
        # each row sees its sequence's keys [0, length). No interval tensors to build: the kernel
        # reads hi as B * Sq = B contiguous int64, which the (B,) lengths already are. Paged
        # lengths were validated against the pool; dense ones may pass Sk (all keys allowed).
        lo, bias, hi = None, None, reduced.padding_lengths
        if c.block_table is None:
            hi = hi.clamp(max=c.kv_len)
        if hi.dtype != torch.long or hi.device != q.device or not hi.is_contiguous():
            hi = hi.to(device=q.device, dtype=torch.long).contiguous()
    else:
        lo, hi, bias = _bounds(reduced, B, Hq, Sq, c.kv_len, q.device, shift=c.sinks is None)
    alibi = reduced.alibi  # computed per score, never materialized
    slopes = qpos = None
    if alibi is not None:
        slopes = alibi.slopes.to(q.device).contiguous()
        if not (c.ops is not None and c.block_table is None and alibi.q_start is None
                and alibi.align == "bottom_right"):
            qpos = alibi.positions(Sq, c.kv_len, q.device).expand(B, Sq).contiguous()  # else the kernel's default
    if c.ops is not None:
        b32 = None if bias is None else bias.expand(B, Hq, Sq, c.kv_len)
        out, lse = _native(c, _plain(q, whole=True), _plain(c.k), None if c.v is None else _plain(c.v),
                           _table(c.block_table), lo, hi, b32, slopes, qpos)
        return out, (lse if c.return_lse else None)
    out, lse = _torch(c, q, lo, hi, bias, slopes, qpos)
    if c.sinks is not None:
        out = with_sinks(out, lse, c.sinks)[0]
    return out.to(q.dtype), (lse if c.return_lse else None)


#: The native op's selection arguments when there is none (sel_ids, sel_block, sel_lo, sel_hi,
#: union_lo, union_hi, seq_div).
_NO_SELECTION = (None, 1, None, None, None, None, 1)


def _native(c: SplitKCall, q, k, v, table, lo, hi, bias, slopes, qpos, sinks=None, selection=_NO_SELECTION):
    """One call of the native kernel (inputs already as it reads them; ``sinks`` the call's
    unless given; ``selection`` the op's selection arguments): (out in q's dtype, lse). Every
    argument is passed: a compiled graph's C++ wrapper passes exactly those a traced call names."""
    return c.ops.splitk_attention(q, k, v, _scales(c.k_scale), _scales(c.v_scale), c.v_head_dim, table, lo, hi,
                                  bias, slopes, qpos, c.sinks if sinks is None else sinks, float(c.scale),
                                  float(c.softcap or 0.0), c.num_kv_heads, c.return_lse, *selection)


def _torch(c: SplitKCall, q, lo, hi, bias, slopes, qpos):
    """One call of the torch implementation: (out fp32 without the sinks, lse)."""
    return torch_splitk(q, c.k, c.v, c.v_head_dim, c.num_kv_heads, c.kv_len, c.scale, lo, hi, bias, c.block_table,
                        c.softcap, slopes, qpos, c.k_scale, c.v_scale)


def _chunked(c: SplitKCall) -> tuple[Tensor, Tensor | None]:
    """:func:`run_call` a chunk of :data:`Q_CHUNK` queries at a time: the intervals, bias and
    ALiBi positions of the whole call, sliced per chunk."""
    q, reduced, Sk, Dv = c.q, c.reduced, c.kv_len, c.v_head_dim
    B, Hq, Sq, _ = q.shape
    alibi = reduced.alibi
    lo, hi, bias = _bounds(reduced, B, Hq, Sq, Sk, q.device, shift=c.sinks is None)
    slopes = qpos = None
    if alibi is not None:
        slopes = alibi.slopes.to(q.device).contiguous()
        qpos = alibi.positions(Sq, Sk, q.device).expand(B, Sq).contiguous()
    native_ops = c.ops is not None
    out = torch.empty(B, Hq, Sq, Dv, dtype=q.dtype if native_ops else torch.float32, device=q.device)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device) if c.return_lse or not native_ops else None
    k = v = table = None
    if native_ops:
        k, v, table = _plain(c.k), None if c.v is None else _plain(c.v), _table(c.block_table)
    for i0 in range(0, Sq, Q_CHUNK):
        i1 = min(Sq, i0 + Q_CHUNK)
        lo_c, hi_c = lo[:, i0:i1].contiguous(), hi[:, i0:i1].contiguous()
        b_c = None if bias is None else bias.expand(B, Hq, Sq, Sk)[:, :, i0:i1]
        p_c = None if qpos is None else qpos[:, i0:i1].contiguous()
        if native_ops:
            s_c = c.sinks[:, :, i0:i1].contiguous() if c.sinks is not None and c.sinks.dim() == 3 else None
            o, l_c = _native(c, _plain(q[:, :, i0:i1], whole=True), k, v, table, lo_c, hi_c, b_c, slopes, p_c, s_c)
        else:
            o, l_c = _torch(c, q[:, :, i0:i1], lo_c, hi_c, b_c, slopes, p_c)
        out[:, :, i0:i1] = o
        if lse is not None:
            lse[:, :, i0:i1] = l_c
    if not native_ops:
        if c.sinks is not None:
            out = with_sinks(out, lse, c.sinks)[0]
        out = out.to(q.dtype)
    return out, (lse if c.return_lse else None)


def _selected(c: SplitKCall) -> tuple[Tensor, Tensor | None]:
    """:func:`run_call` for a selection: a chunk of queries at a time, each query its own
    sequence of one query over the same K/V (``seq_div``), walking its lists of keys."""
    q, reduced, Dv = c.q, c.reduced, c.v_head_dim
    sel = reduced.selection
    B, Hq, Sq, D = q.shape
    native_ops = c.ops is not None
    slopes = qpos = None
    if reduced.alibi is not None:
        slopes = reduced.alibi.slopes.to(q.device).float().contiguous()
        qpos = reduced.alibi.positions(Sq, c.kv_len, q.device).expand(B, Sq).long()
    if native_ops:
        chunk = SELECTION_Q_CHUNK
        k, v, table = _plain(c.k), None if c.v is None else _plain(c.v), _table(c.block_table)
        # the ids as given, R and W per query: the kernel builds each query's list itself
        ids = sel.mask.ids.to(device=q.device, dtype=torch.long)
        ids = ids.unsqueeze(1) if ids.dim() == 3 else ids
        within = [t.to(device=q.device, dtype=torch.long).expand(B, Sq) for t in sel.within(q.device)]
        union = sel.union(q.device)
        union = None if union is None else [t.to(device=q.device, dtype=torch.long).expand(B, Sq) for t in union]
        if Sq == 1:  # a decode step: q (B, Hq, 1, D) is already B sequences of one query each
            per_query = [t.reshape(B).contiguous() for t in within + (union or [])]
            uni = per_query[2:] if union is not None else [None, None]
            out, lse = _native(c, _plain(q, whole=True), k, v, table, None, None, None, slopes,
                               None if qpos is None else qpos.contiguous(),
                               selection=(ids, sel.block_size, per_query[0], per_query[1], uni[0], uni[1], 1))
            return out, (lse if c.return_lse else None)
    else:
        row = c.num_kv_heads * (c.q.shape[-1] + Dv) * c.k.element_size()
        longest = sel.mask.ids.shape[-1] * sel.block_size + (c.kv_len if sel.union_part is not None else 0)
        chunk = max(1, _GATHER_BYTES // max(1, B * row * min(longest, c.kv_len)))
    out = torch.empty(B, Hq, Sq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device) if c.return_lse else None
    for i0 in range(0, Sq, chunk):
        i1 = min(Sq, i0 + chunk)
        m = i1 - i0
        qc = _plain(q[:, :, i0:i1].transpose(1, 2).reshape(B * m, Hq, 1, D), whole=True)
        pc = None if qpos is None else qpos[:, i0:i1].reshape(B * m, 1).contiguous()
        sc = c.sinks
        if sc is not None and sc.dim() == 3:  # per query: each of the chunk's B * m sequences its own
            sc = sc[:, :, i0:i1].transpose(1, 2).reshape(B * m, Hq, 1).contiguous()
        if native_ops:
            per_query = [t[:, i0:i1].reshape(B * m).contiguous() for t in within + (union or [])]
            uni = per_query[2:] if union is not None else [None, None]
            o, l_c = _native(c, qc, k, v, table, None, None, None, slopes, pc, sc,
                             selection=(ids[:, :, i0:i1], sel.block_size, per_query[0], per_query[1], uni[0], uni[1], m))
        else:
            keys, lo, hi = sel.lists(q.device, i0, i1)  # (B, m, Hs, L), (B, m, Hs)
            o, l_c = torch_selected(qc, c.k, c.v, Dv, c.num_kv_heads, c.scale, keys.flatten(0, 1), lo.flatten(0, 1),
                                    hi.flatten(0, 1), m, c.block_table, c.softcap, slopes, pc, c.k_scale, c.v_scale)
            if sc is not None:
                o = with_sinks(o, l_c, sc)[0]
        out[:, :, i0:i1] = o.reshape(B, m, Hq, Dv).transpose(1, 2)
        if lse is not None:
            lse[:, :, i0:i1] = l_c.reshape(B, m, Hq).transpose(1, 2)
    return out, lse


def _bounds(reduced: ReducedMask, B: int, Hq: int, Sq: int, Sk: int, device,
            shift: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
    """(lo (B, Sq), hi (B, Sq)) int64 key intervals of the mask without its ALiBi part, and an
    fp32 bias (B|1, Hq|1, Sq, Sk) for a mask that is not an interval (then each row's interval
    spans its allowed keys). ``shift``: subtract each row's largest bias (not with sinks, whose
    ratio to the scores a shift would change)."""
    rng = reduced.intervals(device)
    bias = None
    if rng is None:
        allowed, b = reduced.dense(device, alibi=False, shift=shift)
        b = torch.zeros((), device=device) if b is None else b.float()
        bias = b.masked_fill(~allowed, float("-inf"))
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        lo, hi = _allowed_span(allowed, Sk)
    else:
        lo, hi = rng
    lo = lo.to(device=device, dtype=torch.long).clamp(0, Sk).expand(B, Sq).contiguous()
    hi = hi.to(device=device, dtype=torch.long).clamp(0, Sk).expand(B, Sq).contiguous()
    return lo, hi, bias


def _allowed_span(allowed: Tensor, Sk: int) -> tuple[Tensor, Tensor]:
    """(lo, hi) (B|1, Sq): the first allowed key and one past the last of each query row, over
    every head (lo = hi = 0 for a row that allows nothing). A mask that is not an interval still
    bounds the keys the engine reads: a paged sequence's keys past its length are never allowed,
    so its table entries there (padding, such as -1) are never read."""
    seen = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape)).any(1)  # (B|1, Sq, Sk)
    any_key = seen.any(-1)
    lo = seen.to(torch.uint8).argmax(-1)  # the first True (argmax returns the first maximum)
    hi = Sk - seen.flip(-1).to(torch.uint8).argmax(-1)
    zero = torch.zeros((), dtype=torch.long, device=allowed.device)
    return torch.where(any_key, lo, zero), torch.where(any_key, hi, zero)


def _plain(t: Tensor, whole: bool = False) -> Tensor:
    """``t`` as the kernel reads it: detached, unit stride in the last dim (``whole``: contiguous).
    A last dim of size 1 has no meaningful stride (``contiguous()`` keeps any): the kernel reads
    it as it is. Copies and detaches only when needed: each skipped no-op is a dispatch on every
    decode step."""
    if t.requires_grad:
        t = t.detach()
    if not (t.is_contiguous() if whole else t.stride(-1) == 1 or t.shape[-1] <= 1):
        t = t.contiguous()
    return t


def _scales(scale: Tensor | None) -> Tensor | None:
    """Row scales as the kernel reads them: fp32, detached (any strides)."""
    if scale is None:
        return None
    return scale.detach() if scale.dtype == torch.float32 else scale.detach().float()


def _table(block_table: Tensor | None) -> Tensor | None:
    """The (B, W) block table as the kernel reads it: int64, contiguous."""
    if block_table is None or (block_table.dtype == torch.long and block_table.is_contiguous()):
        return block_table
    return block_table.long().contiguous()
