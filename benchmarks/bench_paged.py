"""Paged KV cache vs a contiguous cache: memory held on a ragged batch, and decode step time
side by side in one run.

Memory: 64 sequences with lengths drawn uniformly in [16, 4096] (seeded), 4 KV heads of head dim
64, block size 16: blocks in use x block bytes (internal fragmentation: the unused tail slots of
each sequence's last block) against the (64, max_len) buffers a contiguous cache must hold.

Decode: a GQA layer (16 query heads over 4 KV heads, head dim 64) appends one token to each of B
sequences of 4096 tokens and attends, for B 1 and 8, block sizes 16 and 64, fp32 and bf16:

* contiguous: ``DynamicCache.attend`` (the same step on one (B, Hkv, L, D) buffer);
* paged: ``PagedKVCache.attend`` with block tables allocated in order;
* paged, scattered: every block table a random permutation of the pool (no two consecutive
  blocks adjacent), the worst case for locality.

Kernel alone: the same K/V contiguous, in pages in order and in scattered pages, one engine call
each (no cache step around it): what of a step's gap is the kernel's.

Both paged contenders run the ``paged`` backend (the split-K engine reading pages in place), the
contiguous one the ``decode`` backend (the same engine over strided rows). Timings: medians of
interleaved steps; every step's outputs are checked equal across the three.

    python benchmarks/bench_paged.py            # the full workload
    python benchmarks/bench_paged.py --quick    # short sequences, seconds
"""

from __future__ import annotations

import random
import sys

import torch

from _common import bench_main, interleaved_medians, machine, timed
from attnkit.backends.decode import splitk
from attnkit.caches import BlockAllocator, DynamicCache, PagedKVCache
from attnkit.caches import memory as cache_memory
from attnkit.masks import KeyPadding

HQ, HKV, D = 16, 4, 64


def scattered_allocator(num_blocks: int, block_size: int, seed: int) -> BlockAllocator:
    """Free blocks that come out in a random order: each block is cached as a full prefix block
    (its ids confirmed) and freed in a shuffled order; allocations then evict them in that order."""
    alloc = BlockAllocator(num_blocks, block_size, prefix_caching=True)
    sids = []
    for i in range(num_blocks):
        s = alloc.add_sequence()
        alloc.append(s, token_ids=list(range(i * block_size, (i + 1) * block_size)))
        sids.append(s)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    for i in order:
        alloc.free(sids[i])
    return alloc


def memory(seed: int = 0, quick: bool = False) -> dict:
    n_seq, max_len, bs = (8, 512, 16) if quick else (64, 4096, 16)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(16, max_len + 1, (n_seq,), generator=g)
    alloc = BlockAllocator(int(((lens + bs - 1) // bs).sum()), bs)
    for n in lens.tolist():
        alloc.append(alloc.add_sequence(), n)
    tok = HKV * 2 * D * 4  # fp32 K and V of one token, one layer
    live = int(lens.sum())
    L = int(lens.max())
    return {"n_seq": n_seq, "max_len": L, "live_tokens": live, "blocks_used": alloc.num_used, "block_size": bs,
            "paged_bytes": alloc.num_used * bs * tok, "live_bytes": live * tok, "contiguous_bytes": n_seq * L * tok,
            "fragmentation_pct": 100 * (1 - live / (alloc.num_used * bs))}


def decode_row(dtype, batch: int, ctx: int, block_size: int, steps: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    k0 = torch.randn(batch, HKV, ctx, D, generator=g).to(dtype)
    v0 = torch.randn(batch, HKV, ctx, D, generator=g).to(dtype)
    blocks = batch * -(-(ctx + steps + 2) // block_size)
    caches = {
        "contiguous": DynamicCache(HKV, D, dtype=dtype),
        "paged": PagedKVCache(HKV, D, num_blocks=blocks, block_size=block_size, dtype=dtype),
        "scattered": PagedKVCache(HKV, D, allocator=scattered_allocator(blocks, block_size, seed), dtype=dtype),
    }
    for c in caches.values():
        c.update(k0, v0)
    del k0, v0
    n_steps = steps + 1
    qs = torch.randn(n_steps, batch, HQ, 1, D, generator=g).to(dtype)
    kn = torch.randn(n_steps, batch, HKV, 1, D, generator=g).to(dtype)
    vn = torch.randn(n_steps, batch, HKV, 1, D, generator=g).to(dtype)
    outs = {name: [] for name in caches}

    def step(name):
        i = len(outs[name])
        outs[name].append(caches[name].attend(qs[i], kn[i], vn[i]))

    with torch.inference_mode():
        t = interleaved_medians({name: timed(lambda n=name: step(n)) for name in caches}, steps, warmup=1)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for i in range(n_steps):  # same tokens, same answers
        torch.testing.assert_close(outs["paged"][i], outs["contiguous"][i], **tol)
        torch.testing.assert_close(outs["scattered"][i], outs["contiguous"][i], **tol)
    return {"dtype": str(dtype).replace("torch.", ""), "batch": batch, "context": ctx, "block_size": block_size,
            "steps": steps, "engine": splitk.implementation(),
            **{f"{k}_ms": v * 1e3 for k, v in t.items()}}


def in_cache_memory(x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` copied into the memory a cache allocates its buffers from (huge pages where the
    system gives them), optionally with its rows sent to ``rows`` (a permutation of dim 0)."""
    out = cache_memory.zeros(x.shape, dtype=x.dtype)
    return out.copy_(x) if rows is None else out.index_copy_(0, rows, x)


def kernel_row(dtype, batch: int, ctx: int, block_size: int, reps: int, seed: int = 0) -> dict:
    """The engine call alone on the same K/V laid out three ways: contiguous (B, Hkv, L, D), pages
    in order, pages scattered (a random permutation of the pool). Splits a step's gap into the
    kernel's share and the cache step's (begin, write, commit: the decode table minus this)."""
    g = torch.Generator().manual_seed(seed)
    nb = batch * ctx // block_size
    q = torch.randn(batch, HQ, 1, D, generator=g).to(dtype)
    k_pool = torch.randn(nb, block_size, HKV, D, generator=g).to(dtype)
    v_pool = torch.randn(nb, block_size, HKV, D, generator=g).to(dtype)
    tables = {"in order": torch.arange(nb).view(batch, -1),
              "scattered": torch.randperm(nb, generator=g).view(batch, -1)}
    order = tables["scattered"].flatten()  # the scattered pools hold the same tokens elsewhere
    pools = {"in order": tuple(in_cache_memory(p) for p in (k_pool, v_pool)),
             "scattered": tuple(in_cache_memory(p, order) for p in (k_pool, v_pool))}
    dense = tuple(in_cache_memory(p.view(batch, ctx, HKV, D).transpose(1, 2)) for p in (k_pool, v_pool))
    lengths = torch.full((batch,), ctx, dtype=torch.long)
    mask = KeyPadding(lengths)
    scale = D ** -0.5

    def call(name):
        if name == "contiguous":
            return splitk.splitk_attention(q, *dense, scale=scale)[0]
        kp, vp = pools[name]
        return splitk.splitk_attention(q, kp, vp, scale=scale, mask=mask, block_table=tables[name], kv_len=ctx)[0]

    names = ("contiguous", "in order", "scattered")
    want = call("contiguous")
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for name in names[1:]:  # the same keys, the same answer (up to the order of the slices' merge)
        torch.testing.assert_close(call(name), want, **tol)
    t = interleaved_medians({n: timed(lambda n=n: call(n)) for n in names}, reps, warmup=2)
    return {"dtype": str(dtype).replace("torch.", ""), "batch": batch, "context": ctx, "block_size": block_size,
            "reps": reps, **{f"{n.replace(' ', '_')}_ms": v * 1e3 for n, v in t.items()}}


def run(quick: bool) -> dict:
    ctx, steps = (512, 5) if quick else (4096, 201)  # a step is ~0.5 ms: many for a settled median
    shapes = [(dt, B, bs) for dt in (torch.float32, torch.bfloat16) for B in (1, 8) for bs in (16, 64)]
    rows = [decode_row(dt, B, ctx, bs, steps) for dt, B, bs in shapes]
    kernel = [kernel_row(dt, B, ctx, bs, steps) for dt, B, bs in shapes]
    return {"machine": machine(), "quick": quick, "heads": {"q": HQ, "kv": HKV, "head_dim": D},
            "memory": memory(quick=quick), "rows": rows, "kernel": kernel}


def to_markdown(res: dict) -> str:
    m, mem = res["machine"], res["memory"]
    mib = 1 / 2 ** 20
    h = res["heads"]
    lines = [
        f"Machine: {m['cpu']} ({m.get('isa', '?')}), {m['cores']} cores, torch {m['torch']}, attnkit {m['attnkit']}.",
        "",
        f"Memory: {mem['n_seq']} sequences of ragged lengths (longest {mem['max_len']}, {mem['live_tokens']} tokens), "
        f"{h['kv']} KV heads of dim {h['head_dim']}, fp32, block size {mem['block_size']}, one layer.",
        "",
        "| live K/V MiB | paged MiB (blocks in use) | internal fragmentation | contiguous (B, max_len) MiB | paged / contiguous |",
        "|---:|---:|---:|---:|---:|",
        f"| {mem['live_bytes'] * mib:.1f} | {mem['paged_bytes'] * mib:.1f} | {mem['fragmentation_pct']:.2f}% | "
        f"{mem['contiguous_bytes'] * mib:.1f} | {mem['paged_bytes'] / mem['contiguous_bytes']:.2f}x |",
        "",
        f"Decode step: {h['q']} query / {h['kv']} KV heads, head dim {h['head_dim']}, one new token per sequence "
        "written and attended; medians of interleaved steps; speed = contiguous time / paged time (>= 1: paged as "
        "fast). Scattered: every block table a random permutation of the pool.",
        "",
        "| dtype | batch | context | block | contiguous ms | paged ms | paged speed | scattered ms | scattered speed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['dtype']} | {r['batch']} | {r['context']} | {r['block_size']} | {r['contiguous_ms']:.2f} | "
                     f"{r['paged_ms']:.2f} | {r['contiguous_ms'] / r['paged_ms']:.2f}x | {r['scattered_ms']:.2f} | "
                     f"{r['contiguous_ms'] / r['scattered_ms']:.2f}x |")
    if res.get("kernel"):
        lines += ["", "Kernel alone: the same K/V contiguous and in pages (in order, scattered), one engine call "
                  "(`splitk_attention`) per layout, medians of interleaved calls; speed = contiguous / paged.", "",
                  "| dtype | batch | context | block | contiguous ms | in order ms | in order speed | scattered ms | "
                  "scattered speed |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in res["kernel"]:
            c = r["contiguous_ms"]
            lines.append(f"| {r['dtype']} | {r['batch']} | {r['context']} | {r['block_size']} | {c:.3f} | "
                         f"{r['in_order_ms']:.3f} | {c / r['in_order_ms']:.2f}x | {r['scattered_ms']:.3f} | "
                         f"{c / r['scattered_ms']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return bench_main(argv, __doc__, "paged", run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
