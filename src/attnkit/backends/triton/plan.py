"""How the ``triton`` decode kernel cuts each sequence's keys into splits: a pure function of the
call's shape and the device's size, so the decision is tested on CPU for any GPU.

The rule is a wave rule: the kernel's ``batch x num_kv_heads x row_tiles`` programs are split
along the keys only while they do not fill one wave of resident programs
(``num_sms x programs_per_sm``); then the chunk is the smallest one, at least ``min_chunk`` keys
and a multiple of the key tile, that keeps every program of the call inside one wave. A split
costs a partial output and a merge, so chunks shorter than ``min_chunk`` keys do not amortize it,
and a call that fills the wave already gains nothing from splitting. One split means the kernel
writes the normalized output itself (no partials, no merge).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MIN_CHUNK", "split_plan"]

#: Fewest keys in one split: below this a split's merge costs more than the parallelism it adds.
MIN_CHUNK = 128


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def split_plan(batch: int, num_kv_heads: int, row_tiles: int, lengths: int | Sequence[int], num_sms: int,
               programs_per_sm: int, block_n: int, min_chunk: int = MIN_CHUNK,
               max_splits: int = 1024) -> tuple[int, int]:
    """``(num_splits, chunk)`` for one decode call.

    Args:
        batch, num_kv_heads, row_tiles: the unsplit grid (``row_tiles`` query-row tiles per KV
            head).
        lengths: keys each sequence's splits cover: one int (the longest, for every sequence)
            or one per sequence. With per-sequence lengths only a sequence's own chunks count
            toward the wave (a program past a short sequence's end exits at once).
        num_sms, programs_per_sm: the device's SM count and how many of the kernel's programs
            one SM holds at once; their product is one wave.
        block_n: keys per kernel tile; a chunk is a whole number of tiles.
        min_chunk: fewest keys in a chunk (rounded up to whole tiles).
        max_splits: most splits per sequence (the merge's limit).

    Returns:
        ``num_splits`` (>= 1; chunks of the longest sequence, never more) and ``chunk``, the keys
        per split (a multiple of ``block_n``; covers the longest sequence when there is one split).
    """
    lens = [lengths] * batch if isinstance(lengths, int) else [int(n) for n in lengths]
    if any(n < 0 for n in lens) or min(block_n, num_sms, programs_per_sm) < 1:
        raise ValueError(f"split_plan: lengths >= 0 and block_n, num_sms, programs_per_sm >= 1, got {lengths!r}, "
                         f"{block_n}, {num_sms}, {programs_per_sm}")
    longest = max(lens, default=0)
    whole = max(block_n, _ceil(max(1, longest), block_n) * block_n)  # one chunk for the longest
    per_seq = num_kv_heads * row_tiles
    wave = num_sms * programs_per_sm
    least = max(block_n, _ceil(max(1, min_chunk), block_n) * block_n)
    if len(lens) * per_seq >= wave or whole <= least:
        return 1, whole

    def programs(chunk: int) -> int:
        return per_seq * sum(max(1, _ceil(n, chunk)) for n in lens)

    # programs() falls as chunk grows (ceil of n / chunk); find the fewest tiles that fit a wave.
    lo, hi = _ceil(least, block_n), _ceil(whole, block_n)
    while lo < hi:
        mid = (lo + hi) // 2
        if programs(mid * block_n) <= wave:
            hi = mid
        else:
            lo = mid + 1
    chunk = lo * block_n
    splits = _ceil(max(1, longest), chunk)
    if splits > max_splits:
        splits = max_splits
        chunk = _ceil(_ceil(longest, splits), block_n) * block_n
        splits = _ceil(longest, chunk)
    return (1, whole) if splits <= 1 else (splits, chunk)
