"""GPU fast paths side by side with their peers, one run, CUDA events, medians.

(a) prefill: ``attnkit.attention`` (auto) against torch SDPA forced to its flash and cuDNN
    kernels, causal, bf16, MHA and GQA (target: within 5% of the faster of the two);
(b) paged decode: the Triton split-K kernel over a paged cache (page 16, scattered block
    tables), batch 32 at 32k context, GQA 32/8, D 128, bf16: KV bytes read per second against the
    device-to-device copy bandwidth measured in the same run (target: at least 70% of it), and
    against torch SDPA decoding over a contiguous cache of the same tokens;
(c) absorbed-MLA decode at DeepSeek-V3 dimensions (128 heads, kv_lora_rank 512, rope 64, one
    latent head read once for all heads; paged and contiguous): latent bytes read per second
    against the copy bandwidth (target: at least 60% of it), and against SDPA over the same latent
    (K = latent, V = its first 512 channels) for reference;
(d) windowed decode over a paged cache, through ``attnkit.attention`` with the cache step's
    mask: a gpt-oss-like layer (window 128, sinks) and a Mistral-like one (window 4096), against
    what ``auto`` ran before the Triton kernel read windows (the pages gathered, then ``math``
    with sinks, SDPA without), forced;
(e) sparse decode (DeepSeek-V3.2's DSA: top 2048 keys per query, shared by the query heads) over a
    paged cache of 32k tokens, the kernel walking each query's list and reading no other key:
    absorbed MLA (128 heads over a 512 + 64 latent, bf16 and fp8 e4m3 latent; bf16 in the lean
    latent kernel, beside the shared kernel's time for the same call) in TFLOP/s of the
    selected keys (``2 x B x Hq x k x (576 + 512)`` per step, FlashMLA's count) against FlashMLA's
    published 410 TFLOP/s for its FP8 sparse decode (H800; target: at least half), and GQA 32/8 at
    D 128; each against dense decode over the whole cache and over a cache of only k keys (the
    floor a selection can reach).

Bandwidth counts the cache bytes a kernel must read once (K and V, or the latent once); copy
bandwidth is (read + write bytes) / time of ``dst.copy_(src)`` on a buffer larger than L2.

    python benchmarks/bench_gpu.py           # needs CUDA: writes results/gpu.md
    python benchmarks/bench_gpu.py --quick   # tiny shapes; on CPU in Triton's interpreter (a smoke test of the script)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import unittest.mock

import torch

if not torch.cuda.is_available():  # the smoke test runs the Triton kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from _common import bench_main, machine, skip  # noqa: E402
import attnkit  # noqa: E402
from attnkit.backends.triton import kernel as triton_kernel, latent as triton_latent, ops as triton_decode  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def median_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if CUDA:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def try_ms(fn, reps: int):
    """median_ms, or None when the contender cannot run (a kernel refusing the shape, out of memory)."""
    try:
        return median_ms(fn, reps)
    except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError
        print(f"   contender failed: {str(e).splitlines()[0][:150]}", file=sys.stderr)
        if CUDA:
            torch.cuda.empty_cache()
        return None


def kernel_call(q, k_pool, v_pool, table, seq_lens, q_start, scale: float, dv: int, max_len: int, k_scale=None):
    """The custom op itself, index tensors prebuilt: what a serving loop calls once per layer
    (no validation syncs, no conversions inside the timed region). ``k_scale``: the row scales of
    a quantized (V-from-K) pool."""
    args = (q, k_pool, v_pool, table.to(torch.int32).contiguous(), q_start.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(), float(scale), dv, max_len, 0)
    return lambda: torch.ops.attnkit.decode_attention(*args, k_scale=k_scale)


def max_diff(a, b) -> float | None:
    return None if a is None or b is None else (a.float() - b.float()).abs().max().item()


def copy_bandwidth(nbytes: int, reps: int) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written per second)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEV).normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), reps)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def scattered_pool(B: int, ctx: int, page: int, heads: int, dim: int, dtype, seed: int):
    """A pool holding B sequences of ctx tokens in randomly permuted pages, and its block table."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-ctx // page)
    perm = torch.randperm(B * nb, generator=g)
    table = perm.view(B, nb).to(torch.int32).to(DEV)
    pool = torch.empty(B * nb, page, heads, dim, dtype=dtype, device=DEV).normal_()
    return pool, table


def contiguous_from_pool(pool, table, ctx: int):
    """(B, heads, ctx, dim) copy of what the block table points at (for the SDPA contender)."""
    page = pool.shape[1]
    pos = torch.arange(ctx, device=DEV)
    rows = table.long()[:, pos // page] * page + pos % page
    return pool.flatten(0, 1)[rows].permute(0, 2, 1, 3).contiguous()


def prefill(quick: bool, reps: int) -> list[dict]:
    rows = []
    dtype = torch.bfloat16 if CUDA else torch.float32
    shapes = [(1, 4, 4, 64, 64)] if quick else [(4, 32, 32, 4096, 128), (4, 32, 8, 4096, 128), (1, 32, 8, 16384, 128)]
    for B, Hq, Hkv, S, D in shapes:
        q = torch.randn(B, Hq, S, D, dtype=dtype, device=DEV)
        k = torch.randn(B, Hkv, S, D, dtype=dtype, device=DEV)
        v = torch.randn(B, Hkv, S, D, dtype=dtype, device=DEV)
        gqa = Hq != Hkv
        row = {"shape": f"B={B} Hq={Hq} Hkv={Hkv} S={S} D={D}", "dtype": str(dtype).replace("torch.", ""),
               "auto_kernel": attnkit.describe_call(q, k, v, causal=True, detail=True)}
        row["attnkit_ms"] = median_ms(lambda: attnkit.attention(q, k, v, causal=True), reps)
        peers = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION} if CUDA else \
            {"sdpa": None}
        for name, kern in peers.items():
            def run(kern=kern):
                if kern is None:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
                with sdpa_kernel([kern]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            row[f"{name}_ms"] = try_ms(run, reps)  # None: that kernel cannot take this shape / dtype here
        peers_ms = [t for n, t in row.items() if n.endswith("_ms") and n != "attnkit_ms" and t is not None]
        row["attnkit_vs_best_peer"] = row["attnkit_ms"] / min(peers_ms) if peers_ms else None
        rows.append(row)
    return rows


def paged_decode(quick: bool, reps: int, copy_gbs: float) -> list[dict]:
    dtype = torch.bfloat16 if CUDA else torch.float32
    B, Hq, Hkv, D, page = (2, 8, 2, 32, 16) if quick else (32, 32, 8, 128, 16)
    rows = []
    for ctx in ([64] if quick else [4096, 32768]):
        kp, table = scattered_pool(B, ctx, page, Hkv, D, dtype, seed=1)
        vp, _ = scattered_pool(B, ctx, page, Hkv, D, dtype, seed=1)
        q = torch.randn(B, Hq, 1, D, dtype=dtype, device=DEV)
        seq = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
        kv_bytes = 2 * B * ctx * Hkv * D * kp.element_size()
        run = kernel_call(q, kp, vp, table, seq, seq - 1, D ** -0.5, D, ctx)
        ours = median_ms(run, reps)
        k = contiguous_from_pool(kp, table, ctx)
        v = contiguous_from_pool(vp, table, ctx)
        sdpa_fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        sdpa = try_ms(sdpa_fn, reps)
        contig = try_ms(lambda: triton_decode.decode_attention(q, k, v), reps)
        gbs = kv_bytes / (ours * 1e-3) / 1e9
        rows.append({"batch": B, "context": ctx, "heads": f"{Hq}/{Hkv}", "head_dim": D, "page": page,
                     "kv_MB": kv_bytes / 1e6, "paged_ms": ours, "paged_GBps": gbs, "vs_copy": gbs / copy_gbs,
                     "contiguous_triton_ms": contig, "sdpa_contiguous_ms": sdpa,
                     "sdpa_GBps": None if sdpa is None else kv_bytes / (sdpa * 1e-3) / 1e9,
                     "paged_vs_sdpa_speedup": None if sdpa is None else sdpa / ours,
                     "max_abs_diff_vs_sdpa": max_diff(run(), sdpa_fn() if sdpa is not None else None)})
    return rows


def mla_decode(quick: bool, reps: int, copy_gbs: float) -> list[dict]:
    dtype = torch.bfloat16 if CUDA else torch.float32
    H, r, dr = (8, 64, 16) if quick else (128, 512, 64)
    rows = []
    for B, ctx in ([(2, 64)] if quick else [(32, 4096), (32, 32768), (128, 4096)]):
        pool, table = scattered_pool(B, ctx, 16 if quick else 64, 1, r + dr, dtype, seed=2)
        q = torch.randn(B, H, 1, r + dr, dtype=dtype, device=DEV)
        seq = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
        scale = (192 if not quick else r + dr) ** -0.5
        nbytes = B * ctx * (r + dr) * pool.element_size()
        run = kernel_call(q, pool, None, table, seq, seq - 1, scale, r, ctx)
        paged = median_ms(run, reps)
        lat = contiguous_from_pool(pool, table, ctx)  # (B, 1, ctx, r + dr)
        contig = try_ms(lambda: triton_decode.decode_attention(q, lat, None, scale=scale, v_head_dim=r), reps)
        # SDPA has no fused kernel for D=576 / Dv=512: its math fallback may run out of memory.
        sdpa_fn = lambda: F.scaled_dot_product_attention(q, lat, lat[..., :r], scale=scale, enable_gqa=True)  # noqa: E731
        sdpa = try_ms(sdpa_fn, max(3, reps // 10))
        gbs = nbytes / (paged * 1e-3) / 1e9
        rows.append({"batch": B, "context": ctx, "heads": H, "latent": f"{r}+{dr}", "latent_MB": nbytes / 1e6,
                     "paged_ms": paged, "paged_GBps": gbs, "vs_copy": gbs / copy_gbs, "contiguous_ms": contig,
                     "contiguous_GBps": None if contig is None else nbytes / (contig * 1e-3) / 1e9, "sdpa_ms": sdpa,
                     "paged_vs_sdpa_speedup": None if sdpa is None else sdpa / paged,
                     "max_abs_diff_vs_sdpa": max_diff(run(), sdpa_fn() if sdpa is not None else None)})
    return rows


def windowed_decode(quick: bool, reps: int) -> list[dict]:
    """(d): one decode step of a windowed layer over a paged cache, auto against the gather path."""
    from attnkit import masks as M

    dtype = torch.bfloat16 if CUDA else torch.float32
    B, ctx, page = (2, 96, 16) if quick else (8, 32768, 16)
    layers = {"gpt-oss-like": (64, 8, 64, 127, True), "Mistral-like": (32, 8, 128, 4095, False)}
    if quick:
        layers = {"gpt-oss-like": (4, 2, 16, 15, True), "Mistral-like": (4, 2, 32, 31, False)}
    rows = []
    for name, (Hq, Hkv, D, left, sinks) in layers.items():
        kp, table = scattered_pool(B, ctx, page, Hkv, D, dtype, seed=3)
        vp, _ = scattered_pool(B, ctx, page, Hkv, D, dtype, seed=4)
        kv = attnkit.PagedKV(kp, vp, table, torch.full((B,), ctx, device=DEV))
        q = torch.randn(B, Hq, 1, D, dtype=dtype, device=DEV)
        old = torch.full((B,), ctx - 1, device=DEV)
        mask = M.Causal(q_start=old) & M.SlidingWindow(left, q_start=old)
        kw = {"sinks": torch.randn(Hq, device=DEV)} if sinks else {}
        before = "math" if sinks else "sdpa"
        ours_fn = lambda: attnkit.attention(q, kv, None, mask, **kw)  # noqa: E731
        peer_fn = lambda: attnkit.attention(q, kv, None, mask, backend=before, **kw)  # noqa: E731
        ours, peer = median_ms(ours_fn, reps), try_ms(peer_fn, reps)
        rows.append({"layer": name, "batch": B, "context": ctx, "window": left + 1, "heads": f"{Hq}/{Hkv}",
                     "head_dim": D, "sinks": sinks, "auto_kernel": attnkit.describe_call(q, kv, None, mask, **kw),
                     "attnkit_ms": ours, "before": f"gather + {before}", "before_ms": peer,
                     "speedup": None if peer is None else peer / ours,
                     "max_abs_diff": max_diff(ours_fn(), peer_fn() if peer is not None else None)})
    return rows


#: FlashMLA's published figure for its FP8 sparse MLA decode (H800 SXM5, top 2048 of 128k context):
#: TFLOP/s of the selected keys. The GPU goal for (e) is at least half of it.
FLASHMLA_SPARSE_DECODE_TFLOPS = 410.0


def _select_call(q, pool, v_pool, table, ctx: int, ids, scale: float, dv: int, k_scale=None):
    """The decode op over a selection, every index tensor prebuilt (what a serving loop calls per
    layer): ids (B, S, k) key positions, -1 unused."""
    from attnkit import masks as M
    from attnkit.backends.triton.ops import _selection_args

    B, _, S, _ = q.shape
    lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    qs = lens - S
    sel = _selection_args(M.SelectedKeys(ids), q, ctx, False, qs, lens, None, 0, 0)
    args = (q, pool, v_pool, table.to(torch.int32).contiguous(), qs.contiguous(), lens.contiguous(), float(scale), dv,
            ctx, 0)
    return lambda: torch.ops.attnkit.decode_attention(*args, k_scale=k_scale, **sel)


def _random_ids(B: int, S: int, ctx: int, k: int, seed: int):
    """(B, S, k) distinct random key positions per query among the ctx keys (each query sees them all)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(B * S, ctx - S, generator=g).topk(k, -1).indices
    return ids.view(B, S, k).to(DEV)


def sparse_decode(quick: bool, reps: int) -> list[dict]:
    """(e): top-k selected keys per query over a paged cache, MLA and GQA."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    ctx, topk = (256, 32) if quick else (32768, 2048)
    H, r, dr = (8, 64, 16) if quick else (128, 512, 64)
    rows = []
    name = str(dtype).removeprefix("torch.")
    mla_cases = [(2, name), (2, "fp8")] if quick else [(64, name), (128, name), (64, "fp8"), (128, "fp8")]
    for B, kv in mla_cases:
        page = 16 if quick else 64
        pool, table = scattered_pool(B, ctx, page, 1, r + dr, dtype, seed=5)
        small, stable = scattered_pool(B, topk, page, 1, r + dr, dtype, seed=6)
        q = torch.randn(B, H, 1, r + dr, dtype=dtype, device=DEV)
        scale = (192 if not quick else r + dr) ** -0.5
        ids = _random_ids(B, 1, ctx, topk, seed=7)
        k_scale = ks_small = None
        if kv == "fp8":  # scale 1: the stored values are the latent's (normal samples fit e4m3's range)
            pool, small = pool.to(torch.float8_e4m3fn), small.to(torch.float8_e4m3fn)
            k_scale = torch.ones(pool.shape[:3], dtype=torch.float32, device=DEV)
            ks_small = torch.ones(small.shape[:3], dtype=torch.float32, device=DEV)
        sparse_fn = _select_call(q, pool, None, table, ctx, ids, scale, r, k_scale)
        seq = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
        dense_fn = kernel_call(q, pool, None, table, seq, seq - 1, scale, r, ctx, k_scale)
        ss = torch.full((B,), topk, dtype=torch.int32, device=DEV)
        floor_fn = kernel_call(q, small, None, stable, ss, ss - 1, scale, r, topk, ks_small)
        sparse, dense, floor = median_ms(sparse_fn, reps), try_ms(dense_fn, reps), try_ms(floor_fn, reps)
        with unittest.mock.patch.object(triton_latent, "takes", lambda *a, **kw: False):
            shared = try_ms(sparse_fn, reps)  # the same selection in the shared kernel (32-row tiles)
        tflops = 2 * B * H * topk * (r + dr + r) / (sparse * 1e-3) / 1e12
        # exactness: SDPA over the selected latent rows, gathered (the heads as queries of one head)
        lat = pool.to(dtype)[table.long()].flatten(1, 2)  # (B, ctx, 1, r + dr)
        picked = lat.gather(1, ids[:, 0][:, :, None, None].expand(-1, -1, 1, r + dr)).permute(0, 2, 1, 3)
        want = F.scaled_dot_product_attention(q.float().reshape(B, 1, H, -1), picked.float(), picked[..., :r].float(),
                                              scale=scale).view(B, H, 1, r)
        rows.append({"layout": "MLA", "batch": B, "heads": H, "latent": f"{r}+{dr}", "kv": kv, "context": ctx,
                     "topk": topk, "sparse_ms": sparse, "TFLOPs": tflops, "shared_kernel_ms": shared,
                     "vs_flashmla": None if quick else tflops / FLASHMLA_SPARSE_DECODE_TFLOPS,
                     "dense_ms": dense, "dense_over_sparse": None if dense is None else dense / sparse,
                     "dense_k_ms": floor, "sparse_over_dense_k": None if floor is None else sparse / floor,
                     "max_abs_diff": max_diff(sparse_fn(), want)})
    Hq, Hkv, D = (4, 2, 32) if quick else (32, 8, 128)
    B, page = (2, 16) if quick else (32, 16)
    kp, table = scattered_pool(B, ctx, page, Hkv, D, dtype, seed=8)
    vp, _ = scattered_pool(B, ctx, page, Hkv, D, dtype, seed=9)
    q = torch.randn(B, Hq, 1, D, dtype=dtype, device=DEV)
    ids = _random_ids(B, 1, ctx, topk, seed=10)
    sparse_fn = _select_call(q, kp, vp, table, ctx, ids, D ** -0.5, D)
    seq = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    dense_fn = kernel_call(q, kp, vp, table, seq, seq - 1, D ** -0.5, D, ctx)
    ks, kt = scattered_pool(B, topk, page, Hkv, D, dtype, seed=11)
    vs, _ = scattered_pool(B, topk, page, Hkv, D, dtype, seed=12)
    ss = torch.full((B,), topk, dtype=torch.int32, device=DEV)
    floor_fn = kernel_call(q, ks, vs, kt, ss, ss - 1, D ** -0.5, D, topk)
    sparse, dense, floor = median_ms(sparse_fn, reps), try_ms(dense_fn, reps), try_ms(floor_fn, reps)
    rows_k = [kp[table.long()].flatten(1, 2).gather(1, ids[:, 0][:, :, None, None].expand(-1, -1, Hkv, D)),
              vp[table.long()].flatten(1, 2).gather(1, ids[:, 0][:, :, None, None].expand(-1, -1, Hkv, D))]
    want = F.scaled_dot_product_attention(q.float(), *(t.permute(0, 2, 1, 3).float() for t in rows_k),
                                          enable_gqa=True)
    rows.append({"layout": "GQA", "batch": B, "heads": f"{Hq}/{Hkv}", "latent": f"D {D}", "kv": name, "context": ctx, "topk": topk, "sparse_ms": sparse,
                 "TFLOPs": 4 * B * Hq * topk * D / (sparse * 1e-3) / 1e12,
                 "GBps": 2 * B * Hkv * topk * D * kp.element_size() / (sparse * 1e-3) / 1e9,
                 "dense_ms": dense, "dense_over_sparse": None if dense is None else dense / sparse,
                 "dense_k_ms": floor, "sparse_over_dense_k": None if floor is None else sparse / floor,
                 "max_abs_diff": max_diff(sparse_fn(), want)})
    return rows


def run(quick: bool) -> dict:
    if not CUDA and not quick:
        skip("needs CUDA (a GPU); --quick runs a CPU smoke test of the script in Triton's interpreter")
    # The contenders call the attnkit::decode_attention op directly (what a serving loop does),
    # which has no kernel to launch without triton: skip, rather than fail inside it.
    why = triton_decode.available(DEV)
    if why:
        skip("needs triton (pip install triton)" if triton_kernel.triton is None else why)
    torch.manual_seed(0)
    reps = 3 if quick else 30
    info = machine()
    if CUDA:
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
        import triton
        info["triton"] = triton.__version__
    copy_gbs = copy_bandwidth(1 << (20 if quick else 32), reps)
    return {"machine": info, "quick": quick, "copy_GBps": copy_gbs, "prefill": prefill(quick, reps),
            "paged_decode": paged_decode(quick, reps, copy_gbs), "mla_decode": mla_decode(quick, reps, copy_gbs),
            "windowed_decode": windowed_decode(quick, reps), "sparse_decode": sparse_decode(quick, reps)}


def _fmt(x) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"
    return str(x)


def _table(rows: list[dict], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def to_markdown(res: dict) -> str:
    m = res["machine"]
    head = f"Machine: {m.get('gpu', m['cpu'] + ' (CPU: Triton interpreter, a smoke test; timings meaningless)')}, " \
           f"torch {m['torch']}, triton {m.get('triton', '-')}, attnkit {m['attnkit']}. " \
           f"Copy bandwidth (read + write): {res['copy_GBps']:.0f} GB/s."
    pre = res["prefill"]
    peer_cols = [c for c in pre[0] if c.endswith("_ms") and c != "attnkit_ms"]
    parts = [head, "", "(a) Prefill, causal: attnkit auto vs SDPA's kernels forced (ms, medians).", "",
             _table(pre, ["shape", "dtype", "auto_kernel", "attnkit_ms"] + peer_cols + ["attnkit_vs_best_peer"]), "",
             "(b) Paged decode (one token per sequence, scattered block tables): KV bytes read per second.", "",
             _table(res["paged_decode"], ["batch", "context", "heads", "head_dim", "kv_MB", "paged_ms", "paged_GBps",
                                          "vs_copy", "contiguous_triton_ms", "sdpa_contiguous_ms",
                                          "paged_vs_sdpa_speedup", "max_abs_diff_vs_sdpa"]), "",
             "(c) Absorbed-MLA decode over the latent cache (one latent head for all query heads).", "",
             _table(res["mla_decode"], ["batch", "context", "heads", "latent", "latent_MB", "paged_ms", "paged_GBps",
                                        "vs_copy", "contiguous_ms", "contiguous_GBps", "sdpa_ms",
                                        "paged_vs_sdpa_speedup", "max_abs_diff_vs_sdpa"]), ""]
    if res.get("windowed_decode"):
        parts += ["(d) Windowed decode over a paged cache (one token per sequence, the cache step's mask), "
                  "attnkit.attention with auto against the path auto took before (pages gathered, then forced).", "",
                  _table(res["windowed_decode"], ["layer", "batch", "context", "window", "heads", "head_dim", "sinks",
                                                  "auto_kernel", "attnkit_ms", "before", "before_ms", "speedup",
                                                  "max_abs_diff"]), ""]
    if res.get("sparse_decode"):
        parts += [f"(e) Sparse decode, top-k keys per query (shared by the heads) over a paged cache: TFLOP/s of the "
                  f"selected keys; vs_flashmla against FlashMLA's published {FLASHMLA_SPARSE_DECODE_TFLOPS:.0f} "
                  f"TFLOP/s (FP8 sparse decode, H800); dense over the whole cache and over only k keys beside it.", "",
                  _table(res["sparse_decode"], ["layout", "batch", "heads", "latent", "kv", "context", "topk",
                                                "sparse_ms", "TFLOPs", "vs_flashmla", "shared_kernel_ms", "GBps",
                                                "dense_ms",
                                                "dense_over_sparse", "dense_k_ms", "sparse_over_dense_k",
                                                "max_abs_diff"]), ""]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(bench_main(sys.argv[1:], __doc__, "gpu", run, to_markdown))
