"""``flash``: the optional flash-attn package (FlashAttention-2), ``pip install 'attnkit[flash]'``.

Notation: B batch, Hq / Hkv query / key-value heads, Sq / Sk query / key lengths, D / Dv head
dims. attnkit's tensors are (B, H, S, D); flash-attn wants (B, S, H, D), which is a
``transpose(1, 2)`` view (flash-attn only needs the last dim contiguous), and packed
(total, H, D) tokens for its variable-length entry point.

``flash_attn`` is imported on first use, never when attnkit is imported. :meth:`available`
says why the backend cannot run (package missing or failing to import, too old, no CUDA
device, a GPU older than sm80).

Masks it runs (anything else is refused, with the reason):

* None;
* ``Causal()`` (bottom-right, no offsets): ``causal=True``; flash-attn >= 2.1 aligns causal to
  the bottom-right corner, as attnkit does;
* ``SlidingWindow(left, right)`` (bottom-right, no offsets): ``window_size=(left, right)``,
  None -> -1 (unbounded). flash-attn's documented rule, query i sees key j iff
  ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``, is attnkit's ``p - left <= j <= p + right``
  with ``p = i + Sk - Sq``; :func:`flash_window` does the translation;
* an AND of those (the intersection: the smaller extent on each side);
* ``KeyPadding`` and ``QueryPadding``, alone or ANDed with the above, through
  ``flash_attn_varlen_func`` on the valid tokens packed by :func:`unpad` (and scattered back by
  :func:`pad`; padded queries get exactly 0). flash-attn aligns the causal/window diagonal of
  each packed sequence on that sequence's own lengths: packed key ``j - ks`` and query
  ``i - qs`` (``ks``/``qs``: where the sequence's valid keys / queries start, ``Lk``/``Lq`` how
  many there are) meet iff ``j - i`` lies in ``[ks - qs + Lk - Lq - left, ... + right]``, which
  is attnkit's ``[Sk - Sq - left, Sk - Sq + right]`` iff ``ks - qs + Lk - Lq == Sk - Sq``. That
  holds for left padding on both axes, or right padding with ``Lk - Lq == Sk - Sq``; with a
  causal or window part the backend requires it for every sequence (and one contiguous run of
  valid tokens each) and refuses the call otherwise. Padding alone has no such condition.

Rows with no key to attend to come out as exactly 0 (flash-attn documents "If the row of the
mask is all zero, the output will be zero"; sequences with no valid key are not sent at all).
Dropout is flash-attn's own (``dropout_p``; a different random stream from SDPA's), grouped
heads are passed unrepeated (query head h reads KV head h // (Hq // Hkv), as attnkit), and the
backward is deterministic when ``torch.use_deterministic_algorithms(True)`` is on.

Not in ``auto`` (registered ``auto=False``): torch's SDPA already runs FlashAttention-2 (its
vendored copy) or cuDNN for no mask and causal masks, so the package buys nothing measurable
there; for padding, the gather/scatter of :func:`unpad` / :func:`pad` and the host syncs it
needs (``max_seqlen``) compete with SDPA's masked fused kernel, a trade-off with no measurement
behind it in ``benchmarks/results/``; and installing an optional package should not silently change which
kernel (and which dropout stream) every CUDA call uses. Force it with ``backend="flash"`` for
sliding windows and heavily padded batches on fp16/bf16 CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec

import torch
import torch.nn.functional as F
from torch import Tensor

from ..masks import And, Causal, KeyPadding, Mask, QueryPadding, SlidingWindow
from ..reference import attention_math
from .registry import AttentionCall, BackendBase

#: Oldest flash-attn whose interface this backend uses (``window_size`` arrived in 2.3, the
#: ``deterministic`` keyword, passed under ``torch.use_deterministic_algorithms``, in 2.4.1).
MIN_VERSION = (2, 4, 1)
MAX_HEAD_DIM = 256
_HALF = (torch.float16, torch.bfloat16)

_IMPORTED: tuple | None = None  # (module or None, reason or None), after the first import attempt


def _version_tuple(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def _flash_attn():
    """(flash_attn module, None), or (None, why it cannot be used); imports on the first call."""
    global _IMPORTED
    if _IMPORTED is None:
        try:
            import flash_attn
        except Exception as e:  # ImportError, or a CUDA/ABI mismatch raised while loading the kernels
            _IMPORTED = (None, f"flash_attn failed to import ({type(e).__name__}: {e})")
        else:
            version = getattr(flash_attn, "__version__", "0")
            if _version_tuple(version) < MIN_VERSION:
                _IMPORTED = (None, f"flash_attn {version} is older than "
                                   f"{'.'.join(map(str, MIN_VERSION))} (needed for window_size and deterministic)")
            else:
                _IMPORTED = (flash_attn, None)
    return _IMPORTED


def _find_flash_attn() -> bool:
    try:
        return find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


#: Looked up once, at import: ``available()`` runs under torch.compile traces, and dynamo
#: (torch 2.11) refuses to trace ``importlib.util.find_spec``.
_INSTALLED = _find_flash_attn()


def _installed() -> bool:
    return _INSTALLED


# ---------------------------------------------------------------------------- translation


def flash_window(mask: Mask | None, q_len: int, kv_len: int) -> tuple[bool, tuple[int, int]] | None:
    """flash-attn's ``(causal, window_size)`` for a mask made of causal / window parts, or None
    when the mask is anything else (padding, offsets, documents, dense tensors, ...).

    ``window_size = (left, right)``, -1 = unbounded; ``causal`` is True exactly when the right
    extent is 0 (then ``right`` is 0 as well). Query i sees key j iff
    ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (flash-attn's documented rule); top-left
    aligned parts are accepted only where they coincide with bottom-right (Sq == Sk).

    >>> from attnkit.masks import Causal, SlidingWindow
    >>> flash_window(Causal() & SlidingWindow(3), 5, 9)
    (True, (3, 0))
    >>> flash_window(SlidingWindow(2, right=None), 4, 4)
    (False, (2, -1))
    """
    if mask is None:
        return False, (-1, -1)
    parts = mask.masks if isinstance(mask, And) else (mask,)
    left = right = None  # None = unbounded
    for p in parts:
        if isinstance(p, Causal):
            p_left, p_right = None, 0
        elif isinstance(p, SlidingWindow):
            p_left, p_right = p.left, p.right
        else:
            return None
        if p.q_start is not None or (p.align != "bottom_right" and q_len != kv_len):
            return None
        left = p_left if left is None else (left if p_left is None else min(left, p_left))
        right = p_right if right is None else (right if p_right is None else min(right, p_right))
    return right == 0, (-1 if left is None else left, -1 if right is None else right)


def clamp_changes_window(lq: Tensor, lk: Tensor, left: int, right: int) -> Tensor:
    """Per sequence (lq queries, lk keys), whether flash-attn 2's handling of ``window_size``
    hides keys that attnkit's window (bottom-right, -1 = unbounded) allows.

    flash-attn sets a side >= seqlen_k to -1, then gives a one-sided window's open side seqlen_k.
    A changed left side never matters (its bound is already below key 0). The right side matters
    when it becomes seqlen_k while the left stays bounded and the true right side is unbounded or
    > lk (then rows near the top lose keys once lq > lk + 1), or when both become unbounded but the
    true right side r >= lk still bounded the top rows (lq > r + 1)."""
    left_kept = (left >= 0) & (left < lk)
    right_wide = (right < 0) | (right > lk)
    case_a = left_kept & right_wide & (lq > lk + 1)
    case_b = ~left_kept & (right >= 0) & (right >= lk) & (lq > right + 1)
    return case_a | case_b


def unpad(x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """Pack the valid tokens of a padded batch, for ``flash_attn_varlen_func``.

    Args:
        x: (B, S, ...) tokens (any strides).
        valid: (B|1, S) bool, True = keep; or (B,) integer lengths, keeping the first
            ``lengths[b]`` tokens (right padding).

    Returns:
        packed (total, ...) tokens, sequence after sequence, in order;
        indices (total,) int64, each token's position in the flattened (B * S) batch;
        cu_seqlens (B + 1,) int32, ``[0, L0, L0 + L1, ...]``;
        max_seqlen, the longest sequence (an int: one host sync).

    Equivalent code::

        packed = torch.cat([x[b][valid[b]] for b in range(B)])
    """
    B, S = x.shape[:2]
    valid = valid.to(x.device)
    if valid.dtype != torch.bool:
        valid = torch.arange(S, device=x.device) < valid.reshape(-1, 1)
    valid = valid.expand(B, S)
    lengths = valid.sum(1, dtype=torch.int32)
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    indices = valid.reshape(-1).nonzero().squeeze(1)
    packed = x[indices // S, indices % S]
    max_seqlen = int(lengths.max()) if B else 0
    return packed, indices, cu_seqlens, max_seqlen


def pad(packed: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """Inverse of :func:`unpad`: (total, ...) tokens back to (B, S, ...), zeros at padded
    positions; differentiable in ``packed``."""
    out = packed.new_zeros(batch * seqlen, *packed.shape[1:])
    return out.index_copy(0, indices, packed).reshape(batch, seqlen, *packed.shape[1:])


@dataclass(frozen=True)
class FlashPlan:
    """How a call maps onto flash-attn: the window, and (varlen) which keys / queries are valid."""

    causal: bool
    window: tuple[int, int]
    key_valid: Tensor | None  # (B, Sk) bool
    query_valid: Tensor | None  # (B, Sq) bool

    @property
    def varlen(self) -> bool:
        return self.key_valid is not None or self.query_valid is not None


def _axis_valid(parts: list[Mask], batch: int, q_len: int, kv_len: int, device, axis: int) -> Tensor | None:
    """AND of padding parts along one axis (-1 keys, -2 queries) as (B, S) bool, or None."""
    if not parts:
        return None
    out = parts[0].materialize(batch, q_len, kv_len, device)
    for p in parts[1:]:
        out = out & p.materialize(batch, q_len, kv_len, device)
    size = kv_len if axis == -1 else q_len
    return out.reshape(out.shape[0], size).expand(batch, size)


def _runs(valid: Tensor) -> tuple[Tensor, Tensor, bool]:
    """(start (B,), length (B,), every row is one contiguous run) of a (B, S) bool tensor."""
    length = valid.sum(1)
    start = valid.int().argmax(1)  # 0 for an empty row
    pos = torch.arange(valid.shape[1], device=valid.device)
    block = (pos >= start[:, None]) & (pos < (start + length)[:, None])
    return start, length, bool((block == valid).all())


def plan_call(call: AttentionCall, device=None) -> FlashPlan | str:
    """The :class:`FlashPlan` for ``call``'s mask, or a sentence saying why flash cannot run it.
    With padding and a causal/window part this checks each sequence's alignment (a host sync
    when the lengths live on the GPU)."""
    device = call.device if device is None else device
    positional, keys, queries = [], [], []
    for p in call.reduced.parts:
        if isinstance(p, (Causal, SlidingWindow)):
            if not p.allows_all(call.q_len, call.kv_len):  # Causal() with Sq = 1 masks nothing
                positional.append(p)
        elif isinstance(p, KeyPadding):
            keys.append(p)
        elif isinstance(p, QueryPadding):
            queries.append(p)
        else:
            return (f"mask {p!r} (flash runs Causal, SlidingWindow, KeyPadding, QueryPadding "
                    "and their AND only)")
    pos_mask = None if not positional else positional[0] if len(positional) == 1 else And(*positional)
    win = flash_window(pos_mask, call.q_len, call.kv_len)
    if win is None:
        return (f"mask {pos_mask!r} (per-sequence offsets, or top-left alignment with Sq != Sk: flash "
                "aligns causal/window bottom-right)")
    causal, window = win
    B, Sq, Sk = call.batch, call.q_len, call.kv_len
    bounded_window = window not in ((-1, -1), (-1, 0))
    if bounded_window and bool(clamp_changes_window(torch.tensor([Sq]), torch.tensor([Sk]), *window).any()):
        return (f"sliding window {window} with Sq={Sq}, Sk={Sk}: flash-attn clamps window sides to the key "
                "length, which here hides keys the window allows")
    key_valid = _axis_valid(keys, B, Sq, Sk, device, -1)
    query_valid = _axis_valid(queries, B, Sq, Sk, device, -2)
    if key_valid is None and query_valid is None:
        return FlashPlan(causal, window, None, None)
    if key_valid is None:
        key_valid = torch.ones(B, Sk, dtype=torch.bool, device=device)
    if query_valid is None:
        query_valid = torch.ones(B, Sq, dtype=torch.bool, device=device)
    # A sequence without a valid key gives zeros: send none of its queries either.
    query_valid = query_valid & key_valid.any(1, keepdim=True)
    if causal or window != (-1, -1):
        ks, lk, k_run = _runs(key_valid)
        qs, lq, q_run = _runs(query_valid)
        used = (lq > 0) & (lk > 0)
        aligned = bool(((ks - qs + lk - lq == Sk - Sq) | ~used).all())
        if bounded_window and bool((clamp_changes_window(lq, lk, *window) & used).any()):
            return (f"mask {call.mask!r}: flash-attn clamps window sides to each sequence's key length, which for some "
                    "sequence here hides keys the window allows")
        if not (k_run and q_run and aligned):
            return (f"mask {call.mask!r}: padding with a causal/window part that flash would align per "
                    "sequence differently (each sequence needs one contiguous run of valid tokens and "
                    "key_start - query_start + Lk - Lq == Sk - Sq, e.g. left padding)")
    return FlashPlan(causal, window, key_valid, query_valid)


# ---------------------------------------------------------------------------- backend


class FlashBackend(BackendBase):
    name = "flash"

    def available(self) -> str | None:
        cuda = torch.cuda.is_available()
        if not _installed():
            return ("flash_attn is not installed (pip install 'attnkit[flash]')"
                    + ("" if cuda else "; and there is no CUDA device, which it needs"))
        if not cuda:
            return "no CUDA device (torch.cuda.is_available() is False); flash_attn runs on CUDA only"
        _, why = _flash_attn()
        if why:
            return why
        major, minor = torch.cuda.get_device_capability()
        if major < 8:
            return (f"{torch.cuda.get_device_name()} is sm{major}{minor}; FlashAttention-2 needs sm80 or "
                    "newer (Ampere, Ada, Hopper)")
        return None

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        why = []
        if call.device_type != "cuda":
            why.append(f"device {call.device_type} (flash_attn runs on CUDA only)")
        if call.dtype not in _HALF:
            why.append(f"dtype {call.dtype} (flash_attn takes fp16 or bf16)")
        if call.head_dim > MAX_HEAD_DIM or call.head_dim % 8:
            why.append(f"head_dim D={call.head_dim} (flash_attn needs D <= {MAX_HEAD_DIM} and a multiple of 8)")
        if call.head_dim != call.v_head_dim:
            why.append(f"D={call.head_dim} != Dv={call.v_head_dim} (flash_attn needs equal K and V widths)")
        if call.return_weights:
            why.append("return_weights=True (flash_attn does not return probabilities)")
        if call.modifiers:
            why.append(f"{', '.join(call.modifiers)} (not wired to flash_attn's arguments)")
            return why
        plan = plan_call(call)
        if isinstance(plan, str):
            why.append(plan)
        return why

    def kernel_name(self, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> str:
        """Which flash-attn entry point runs: "varlen" (packed valid tokens) or "dense"."""
        plan = plan_call(call, q.device)
        return "refused" if isinstance(plan, str) else "varlen" if plan.varlen else "dense"

    def run(self, q, k, v, call: AttentionCall):
        fa, why = _flash_attn()
        if fa is None:
            raise RuntimeError(why)
        plan = plan_call(call, q.device)
        if isinstance(plan, str):
            raise ValueError(plan)
        kwargs = dict(dropout_p=call.dropout_p, softmax_scale=call.scale, causal=plan.causal,
                      window_size=plan.window)
        if torch.are_deterministic_algorithms_enabled():
            kwargs["deterministic"] = True
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D) views
        if not plan.varlen:
            return fa.flash_attn_func(qt, kt, vt, **kwargs).transpose(1, 2), None
        # One query per sequence (decode): keep every sequence's slot, even a masked one, because
        # flash-attn's GQA decode fast path reshapes the packed queries to (B, Hkv, G, D); rows
        # of sequences without keys come back 0 from flash, masked queries are zeroed below.
        one_each = call.q_len == 1
        q_valid = torch.ones_like(plan.query_valid) if one_each else plan.query_valid
        q_packed, q_idx, cu_q, max_q = unpad(qt, q_valid)
        k_packed, k_idx, cu_k, max_k = unpad(kt, plan.key_valid)
        if not bool(plan.query_valid.any()):  # every query masked: the contract's zeros, with gradients
            return attention_math(q, k, v, call.mask, scale=call.scale)
        v_packed = vt[k_idx // call.kv_len, k_idx % call.kv_len]
        out = fa.flash_attn_varlen_func(q_packed, k_packed, v_packed, cu_q, cu_k, max_q, max_k, **kwargs)
        out = pad(out, q_idx, call.batch, call.q_len)  # (B, Sq, Hq, Dv)
        if one_each:
            out = out.masked_fill(~plan.query_valid[:, :, None, None], 0.0)
        return out.transpose(1, 2), None
