"""The ``triton`` backend's public entry points: :func:`paged_decode_attention` over a paged KV
cache and :func:`decode_attention` over a contiguous one. Each checks its arguments
(:func:`check_paged_args`), puts them in the form the kernel reads, and calls the custom op
``attnkit::decode_attention`` (:mod:`attnkit.backends.triton.kernel`).

Notation: B sequences, Hq / Hkv query / KV heads, S query tokens per sequence, D / Dv head dims,
N cache blocks of ``block_size`` tokens each.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ..._checks import shape_of
from ...kvquant import QUANTIZED_DTYPES
from ...masks import Mask, SlidingWindow
from ...masks.reduced import ReducedSelection
from .kernel import available, decode_op
from .limits import MAX_HEAD_DIM, MAX_Q_LEN, MAX_V_HEAD_DIM, NO_CAUSAL, UNBOUNDED, interpreting

__all__ = ["available", "check_paged_args", "decode_attention", "interpreting", "paged_decode_attention",
           "MAX_Q_LEN", "NO_CAUSAL"]


def _renamed(value, old_value, old: str, new: str, fn: str):
    """``value``, or the value given under the deprecated keyword ``old`` (with a
    DeprecationWarning naming ``new``)."""
    if old_value is None:
        return value
    if value is not None:
        raise TypeError(f"{fn}() got both {new}= and its deprecated spelling {old}=; pass {new}= only")
    warnings.warn(f"{fn}({old}=...) is deprecated; use {new}=", DeprecationWarning, stacklevel=3)
    return old_value


def _per_sequence(x, name: str, B: int, device, default: Tensor | None = None) -> Tensor | None:
    """``x`` (an int or a (B,) int tensor) as a (B,) tensor on ``device``; ``default`` for None."""
    if x is None:
        return default
    t = torch.as_tensor(x, device=device)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.shape not in ((B,), ()):
        raise ValueError(f"{name} must be an int or a ({B},) int tensor, got {t.dtype} of shape {tuple(t.shape)}")
    return t.expand(B)


def paged_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor | None, block_table: Tensor, lengths=None,
                           *, q_start=None, scale: float | None = None, v_head_dim: int | None = None,
                           max_len: int | None = None, num_splits: int = 0, check: bool = True,
                           softcap: float | None = None, alibi_slopes: Tensor | None = None, alibi_q_start=None,
                           sinks: Tensor | None = None, k_scale: Tensor | None = None,
                           v_scale: Tensor | None = None, window: tuple[int | None, int | None] | None = None,
                           window_q_start=None, selection=None, seq_lens=None, alibi_start=None,
                           window_start=None) -> Tensor:
    """Attention of a few new queries per sequence over a paged KV cache, in one fused kernel.

    Args:
        q: (B, Hq, S, D), S <= 16 query tokens per sequence (decode, speculative verification).
        k_pool: (N, block_size, Hkv, D) key blocks in q's dtype, or int8 / fp8 e4m3 with
            ``k_scale``; Hq must be a multiple of Hkv.
        v_pool: (N, block_size, Hkv, Dv) value blocks of k_pool's dtype, or None: V is
            ``k_pool[..., :v_head_dim]`` (MLA), scaled by ``k_scale`` when quantized.
        block_table: (B, max_blocks) int: sequence b's token t lives in block
            ``block_table[b, t // block_size]`` at slot ``t % block_size``.
        lengths: (B,) or int: keys per sequence (including this step's tokens).
        q_start: (B,) or int position of each sequence's first query; default ``lengths - S``
            (causal). Query j sees keys ``< min(q_start + j + 1, lengths)``.
        scale: default 1 / sqrt(D).
        v_head_dim: Dv when ``v_pool`` is None (required then).
        max_len: max(lengths) if known on the host (saves a device sync).
        num_splits: context splits per sequence (0: the wave rule of
            :func:`attnkit.backends.triton.plan.split_plan`, from the GPU's SM count; one split
            writes the output directly, with no merge).
        check: validate lengths and block table entries against the pool (a device sync); callers
            that built them on the host (the caches, the ``triton`` backend) pass False.
        softcap: c of ``c * tanh(score / c)`` on the scaled scores (Gemma 2).
        alibi_slopes: (Hq,) ALiBi slopes, with ``alibi_q_start`` (B,) or int: the ALiBi position of
            each sequence's first query (default ``q_start``); adds ``slope * (key - query)``.
        sinks: logits joining each row's softmax denominator: (Hq,), one per query head (gpt-oss),
            or (B|1, Hq, S) / (B|1, Hq, S, 1), one per query row (Inkling 2).
        k_scale: (N, block_size, Hkv) fp32 scales of quantized ``k_pool`` rows
            (:mod:`attnkit.kvquant`): attention over ``k_pool * k_scale[..., None]``; any strides.
        v_scale: (N, block_size, Hkv) fp32 scales of quantized ``v_pool`` rows (None with v_pool
            None).
        window: ``(left, right)`` extents (ints >= 0, None: unbounded) of a sliding window
            (:class:`attnkit.masks.SlidingWindow`): query j also sees only the keys within
            ``[w - left, w + right]`` of its window position ``w = window_q_start + j``.
        window_q_start: (B,) or int window position of each sequence's first query; default
            ``lengths - S`` (bottom-right).
        selection: a mask holding one per-query selection (:class:`attnkit.masks.SelectedKeys`,
            :class:`attnkit.masks.SelectedBlocks`), alone, ORed with one interval mask (a
            :class:`~attnkit.masks.SlidingWindow`: "the listed blocks and the local ones") and
            ANDed with interval masks (causal, padding, windows), over Sk = ``max_len`` keys; or
            that mask's reduction (``ReducedMask.selection``). Query j then sees only the keys
            the selection allows, within the limits above: the kernel walks each query's list
            (ids ascending, a block's keys in a row) and reads no other key.
        seq_lens, alibi_start, window_start: deprecated spellings of ``lengths``,
            ``alibi_q_start`` and ``window_q_start``.

    Returns:
        (B, Hq, S, Dv) in q's dtype; a query that sees no key gets 0.
    """
    fn = "paged_decode_attention"
    lengths = _renamed(lengths, seq_lens, "seq_lens", "lengths", fn)
    alibi_q_start = _renamed(alibi_q_start, alibi_start, "alibi_start", "alibi_q_start", fn)
    window_q_start = _renamed(window_q_start, window_start, "window_start", "window_q_start", fn)
    if lengths is None:
        raise TypeError(f"{fn}() missing its argument 'lengths' (keys per sequence)")
    why = available(q.device if isinstance(q, Tensor) else None)
    if why:
        raise RuntimeError(f"{fn}: {why}")
    Dv = check_paged_args(q, k_pool, v_pool, block_table, v_head_dim, k_scale, v_scale,
                          any_q_len=selection is not None)
    B, _, S, D = q.shape
    block_size = k_pool.shape[1]
    lens = _per_sequence(lengths, "lengths", B, q.device)
    qs = _per_sequence(q_start, "q_start", B, q.device, default=lens - S)
    if check and B and not torch.compiler.is_compiling():
        _check_table(lens, block_table, k_pool, max_len)
    if max_len is None:
        max_len = int(lens.max()) if B else 0
    if scale is None:
        scale = D ** -0.5
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_pool = k_pool if k_pool.stride(-1) == 1 else k_pool.contiguous()
    if v_pool is not None and v_pool.stride(-1) != 1:
        v_pool = v_pool.contiguous()
    # The kernel indexes these as contiguous int32 rows.
    slopes = alibi_qs = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=torch.float32).contiguous()
        alibi_qs = _per_sequence(alibi_q_start, "alibi_q_start", B, q.device, default=qs).to(torch.int32).contiguous()
    sinks = _kernel_sinks(sinks, q)
    w_qs, w_left, w_right = None, 0, 0
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2 or any(
                w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 0) for w in window):
            raise ValueError(f"window must be (left, right), each an int >= 0 or None, got {window!r}")
        w_left, w_right = (UNBOUNDED if w is None else min(w, UNBOUNDED) for w in window)
        w_qs = _per_sequence(window_q_start, "window_q_start", B, q.device, default=lens - S)
        w_qs = w_qs.clamp(-NO_CAUSAL, NO_CAUSAL).to(torch.int32).contiguous()
    elif window_q_start is not None:
        raise ValueError("window_q_start is given without a window")
    k_scale = None if k_scale is None else k_scale.detach()
    v_scale = None if v_scale is None else v_scale.detach()
    sel = {}
    if selection is not None:  # every limit folds into the selection's per-token bounds
        sel = _selection_args(selection, q, int(max_len), check, qs, lens, w_qs, w_left, w_right)
        w_qs = None
    return decode_op(q, k_pool, v_pool, block_table.to(torch.int32).contiguous(),
                     qs.clamp(-NO_CAUSAL, NO_CAUSAL).to(torch.int32).contiguous(), lens.to(torch.int32).contiguous(),
                     float(scale), int(Dv), int(max_len), int(num_splits), float(softcap or 0.0), slopes, alibi_qs,
                     sinks, k_scale, v_scale, w_qs, int(w_left), int(w_right), **sel)


def _kernel_sinks(sinks, q: Tensor) -> Tensor | None:
    """``sinks`` as the kernel reads them: None, (Hq,) or (B|1, Hq, S) fp32 contiguous; an error
    naming the shapes for any other (the kernel would read past a shorter tensor)."""
    if sinks is None:
        return None
    B, Hq, S, _ = q.shape
    want = f"(Hq,) = ({Hq},) or (B|1, Hq, S[, 1]) = ({B}|1, {Hq}, {S}[, 1])"
    if not isinstance(sinks, Tensor) or not sinks.dtype.is_floating_point:
        raise TypeError(f"sinks must be a floating tensor {want}, got {getattr(sinks, 'dtype', type(sinks).__name__)}")
    rows = sinks.squeeze(-1) if sinks.dim() == 4 and sinks.shape[-1] == 1 else sinks
    if not (tuple(rows.shape) == (Hq,) or (rows.dim() == 3 and rows.shape[0] in (1, B)
                                          and tuple(rows.shape[1:]) == (Hq, S))):
        raise ValueError(f"sinks must be {want}, got shape {shape_of(sinks)} for q {shape_of(q)}")
    return rows.detach().to(device=q.device, dtype=torch.float32).contiguous()


def _selection_args(selection, q: Tensor, kv_len: int, check: bool, q_start: Tensor, lengths: Tensor,
                    w_qs: Tensor | None, w_left: int, w_right: int) -> dict:
    """The kernel's selection arguments (:func:`attnkit.backends.triton.kernel.launch`) from a
    mask holding a selection or its :class:`~attnkit.masks.reduced.ReducedSelection`, over
    ``kv_len`` keys, with the call's limits (q_start, lengths (B,); the window's w_qs (B,) | None
    and extents) folded into each query token's bounds. Checks the shapes; with ``check``, the
    ids against ``kv_len`` (a sync)."""
    B, Hq, S, _ = q.shape
    if isinstance(selection, ReducedSelection):
        rs = selection
    elif isinstance(selection, Mask):
        rs = ReducedSelection.of(selection, B, S, kv_len)
        if rs is None:
            raise ValueError(f"selection must hold one SelectedKeys / SelectedBlocks, alone, ORed with one interval "
                             f"mask and ANDed with interval masks (causal, padding, windows), got {selection!r}")
    else:
        raise TypeError(f"selection must be an attnkit mask holding a selection, got {type(selection).__name__}")
    ids = rs.mask.ids
    shape = tuple(ids.shape)
    if ids.shape[0] not in (1, B) or ids.shape[-2] != S or Hq % rs.heads:
        raise ValueError(f"selection ids of shape {shape} do not fit q {shape_of(q)}: (B|1, [Hs,] S, n) with "
                         f"B={B}, S={S} and Hs dividing Hq={Hq}")
    if ids.device != q.device and ids.device.type != "cpu":
        raise TypeError(f"selection ids are on {ids.device}, q on {q.device}")
    if check and not torch.compiler.is_compiling():
        rs.mask.check_range(kv_len)
    dev = q.device
    n = ids.shape[-1]
    sel_ids = rs.ids(dev).expand(B, -1, -1, -1)
    sel_counts = rs.counts(dev).expand(B, -1, -1)
    # [lo, hi): R AND the call's limits (causal, lengths, window) AND [0, kv_len); W within it.
    j = torch.arange(S, device=dev)
    lo, hi = (t.to(dev).long().expand(B, S) for t in rs.within(dev))
    hi = torch.minimum(hi, torch.minimum(q_start.to(dev).long()[:, None] + j + 1, lengths.to(dev).long()[:, None]))
    hi = hi.clamp(max=kv_len)
    lo = lo.clamp(min=0)
    if w_qs is not None:
        w = w_qs.to(dev).long()[:, None] + j
        lo, hi = torch.maximum(lo, w - w_left), torch.minimum(hi, w + w_right + 1)
    union = rs.union(dev)
    if union is None:
        ulo = uhi = lo
    else:
        ulo = torch.maximum(union[0].to(dev).long().expand(B, S), lo)
        uhi = torch.maximum(torch.minimum(union[1].to(dev).long().expand(B, S), hi), ulo)
    bounds = torch.stack([lo, hi, ulo, uhi], -1).clamp(-NO_CAUSAL, NO_CAUSAL).to(torch.int32).contiguous()
    # Entries one row walks: the union's keys (at most its window's width), then n blocks.
    joined = rs.union_part
    u_span = 0 if joined is None else kv_len
    if type(joined) is SlidingWindow and joined.left is not None and joined.right is not None:
        u_span = min(kv_len, joined.left + joined.right + 1)
    bs = rs.block_size
    span = u_span + min(n, -(-kv_len // bs)) * bs
    return dict(sel_ids=sel_ids, sel_counts=sel_counts, sel_bounds=bounds, sel_block_size=int(bs), sel_span=int(span))


def check_paged_args(q: Tensor, k_pool: Tensor, v_pool: Tensor | None, block_table: Tensor,
                     v_head_dim: int | None = None, k_scale: Tensor | None = None,
                     v_scale: Tensor | None = None, *, any_q_len: bool = False) -> int:
    """Check :func:`paged_decode_attention`'s tensors against each other and the kernel's limits
    (shapes, dtypes, devices; nothing that needs a device sync) and return Dv. Raises
    ValueError / TypeError naming the argument and the shapes."""
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q must be (B, Hq, S, D), got shape {shape_of(q)}")
    if not isinstance(k_pool, Tensor) or k_pool.dim() != 4:
        raise ValueError(f"k_pool must be (N, block_size, Hkv, D), got shape {shape_of(k_pool)}")
    B, Hq, S, D = q.shape
    N, block_size, Hkv, Dk = k_pool.shape
    if Dk != D:
        raise ValueError(f"q {shape_of(q)} and k_pool {shape_of(k_pool)} must share the head dim")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}, q {shape_of(q)}) must be a multiple of KV heads ({Hkv}, k_pool "
                         f"{shape_of(k_pool)})")
    if S > MAX_Q_LEN and not any_q_len:  # a selection's programs take one query token each: any S
        raise ValueError(f"q has {S} tokens per sequence (shape {shape_of(q)}); this kernel takes at most {MAX_Q_LEN} "
                         f"(any number with a selection)")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head dim {D} (q {shape_of(q)}) is above the kernel's {MAX_HEAD_DIM}")
    if v_pool is None:
        if v_head_dim is None or not 0 < v_head_dim <= D:
            raise ValueError(f"with v_pool=None (V = K[..., :Dv]) v_head_dim must be in [1, D={D}], got {v_head_dim}")
        Dv = v_head_dim
    else:
        if not isinstance(v_pool, Tensor) or v_pool.dim() != 4 or v_pool.shape[:3] != k_pool.shape[:3]:
            raise ValueError(f"v_pool must be (N, block_size, Hkv, Dv) matching k_pool {shape_of(k_pool)}, got "
                             f"{shape_of(v_pool)}")
        if v_head_dim is not None and v_head_dim != v_pool.shape[3]:
            raise ValueError(f"v_head_dim={v_head_dim} but v_pool {shape_of(v_pool)}")
        Dv = v_pool.shape[3]
    if Dv > MAX_V_HEAD_DIM:
        raise ValueError(f"value head dim {Dv} is above the kernel's {MAX_V_HEAD_DIM}")
    if k_scale is not None or v_scale is not None or k_pool.dtype in QUANTIZED_DTYPES:
        _check_quantized(q, k_pool, v_pool, k_scale, v_scale)
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool)):
        if t is not None and ((t.dtype != q.dtype and k_scale is None) or t.device != q.device):
            raise TypeError(f"{name} is {t.dtype} on {t.device}, q is {q.dtype} on {q.device}")
    if not isinstance(block_table, Tensor) or block_table.dim() != 2 or block_table.shape[0] != B \
            or block_table.dtype.is_floating_point or block_table.dtype == torch.bool:
        raise ValueError(f"block_table must be a (B={B}, max_blocks) int tensor, got "
                         f"{getattr(block_table, 'dtype', type(block_table).__name__)} of shape {shape_of(block_table)}")
    return Dv


def _check_table(lengths: Tensor, block_table: Tensor, k_pool: Tensor, max_len: int | None) -> None:
    """The checks that read values on the device (one sync): every length within the table's
    blocks and below ``max_len``, and every table entry that holds tokens inside the pool."""
    N, block_size = k_pool.shape[:2]
    room = block_table.shape[1] * block_size
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo < 0 or hi > room:
        raise ValueError(f"lengths must be in [0, max_blocks * block_size = {room}] (block_table "
                         f"{shape_of(block_table)}, block_size {block_size}), got {lengths.tolist()}")
    if max_len is not None and max_len < hi:
        raise ValueError(f"max_len={max_len} is below the longest sequence ({hi} keys): keys would be skipped")
    used = torch.arange(block_table.shape[1], device=block_table.device)[None] < (-(-lengths // block_size))[:, None]
    bad = used & ((block_table < 0) | (block_table >= N))
    if bool(bad.any()):  # entries past a sequence's last block (padding such as -1) are never read
        raise ValueError(f"block_table entries holding tokens must be in [0, N={N}) (k_pool {shape_of(k_pool)}, "
                         f"block_table {shape_of(block_table)}), got {block_table[bad].tolist()[:8]}")


def _check_quantized(q: Tensor, k_pool: Tensor, v_pool: Tensor | None, k_scale, v_scale) -> None:
    """Quantized pools: int8 / fp8 data of one dtype, with fp32 scales of shape ``pool.shape[:3]``."""
    names = " or ".join(str(d).replace("torch.", "") for d in QUANTIZED_DTYPES)
    if k_scale is None:
        raise ValueError(f"k_pool is {k_pool.dtype} (quantized): pass k_scale, fp32 of shape k_pool.shape[:3] = "
                         f"{tuple(k_pool.shape[:3])}")
    if k_pool.dtype not in QUANTIZED_DTYPES:
        raise TypeError(f"k_scale is given, so k_pool must be quantized ({names}), got {k_pool.dtype}")
    if v_pool is not None and v_pool.dtype != k_pool.dtype:
        raise TypeError(f"v_pool is {v_pool.dtype}, k_pool {k_pool.dtype}: quantized K/V share one dtype")
    if (v_pool is None) != (v_scale is None):
        raise ValueError("v_scale must be given with a quantized v_pool and None without one (V read from K uses "
                         "k_scale)")
    for name, sc, pool in (("k_scale", k_scale, k_pool), ("v_scale", v_scale, v_pool)):
        if pool is None:
            continue
        if not isinstance(sc, Tensor) or sc.dtype != torch.float32 or sc.device != q.device:
            raise TypeError(f"{name} must be an fp32 tensor on {q.device}, got "
                            f"{getattr(sc, 'dtype', type(sc).__name__)} on {getattr(sc, 'device', '-')}")
        if sc.shape != pool.shape[:3]:
            raise ValueError(f"{name} must have shape {tuple(pool.shape[:3])} (one scale per row of "
                             f"{shape_of(pool)}), got {shape_of(sc)}")


def decode_attention(q: Tensor, k: Tensor, v: Tensor | None, *, lengths=None, q_start=None,
                     scale: float | None = None, v_head_dim: int | None = None, num_splits: int = 0,
                     check: bool = True, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                     seq_lens=None, **modifiers) -> Tensor:
    """:func:`paged_decode_attention` over a contiguous cache: k (B, Hkv, L, D), v (B, Hkv, L, Dv)
    or None (V = ``k[..., :v_head_dim]``). ``lengths`` defaults to L and ``q_start`` to
    ``lengths - S`` (bottom-right causal); pass ``q_start=NO_CAUSAL`` for no causality.
    Quantized (int8 / fp8 e4m3) k and v take k_scale (B, Hkv, L) and v_scale (B, Hkv, L) | None.
    ``seq_lens`` is the deprecated spelling of ``lengths``; ``modifiers`` are
    :func:`paged_decode_attention`'s (softcap, alibi_slopes, alibi_q_start, sinks, window,
    window_q_start, selection)."""
    lengths = _renamed(lengths, seq_lens, "seq_lens", "lengths", "decode_attention")
    if not isinstance(k, Tensor) or k.dim() != 4 or not isinstance(q, Tensor) or q.dim() != 4 or k.shape[0] != q.shape[0]:
        raise ValueError(f"q must be (B, Hq, S, D) and k (B, Hkv, L, D) with the same B, got q {shape_of(q)}, "
                         f"k {shape_of(k)}")
    if v is not None and (not isinstance(v, Tensor) or v.dim() != 4 or v.shape[:3] != k.shape[:3]):
        raise ValueError(f"v must be (B, Hkv, L, Dv) matching k {shape_of(k)}, got {shape_of(v)}")
    B, L = k.shape[0], k.shape[2]
    table = torch.arange(B, dtype=torch.int32, device=k.device)[:, None]
    if L == 0:  # nothing cached: a block of one empty slot keeps the kernel's indexing valid
        if lengths is not None and bool((torch.as_tensor(lengths) != 0).any()):
            raise ValueError(f"lengths must be 0 for an empty cache (k {shape_of(k)}), got {lengths}")
        k = k.new_zeros(B, k.shape[1], 1, k.shape[3])
        v = None if v is None else v.new_zeros(B, v.shape[1], 1, v.shape[3])
        k_scale, v_scale = (None if t is None else t.new_zeros(B, t.shape[1], 1) for t in (k_scale, v_scale))
        lengths = 0
    lens = torch.full((B,), L, device=k.device) if lengths is None else lengths
    t12 = lambda t: None if t is None else t.transpose(1, 2)  # noqa: E731 - (B, Hkv, L, ...) as (B, L, Hkv, ...)
    for name, sc, rows in (("k_scale", k_scale, k), ("v_scale", v_scale, v)):
        if isinstance(sc, Tensor) and rows is not None and sc.shape != rows.shape[:3]:
            raise ValueError(f"{name} must have shape {tuple(rows.shape[:3])} (one scale per row of "
                             f"{shape_of(rows)}), got {shape_of(sc)}")
    return paged_decode_attention(q, t12(k), t12(v), table, lens,
                                  q_start=q_start, scale=scale, v_head_dim=v_head_dim,
                                  max_len=L if lengths is None or not check else None, num_splits=num_splits,
                                  check=check, k_scale=t12(k_scale), v_scale=t12(v_scale), **modifiers)
