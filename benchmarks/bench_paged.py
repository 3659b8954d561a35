"""Paged KV cache vs a contiguous (batch, max_len) cache on a ragged batch: memory held and
decode step time, side by side in one run.

Workload: 64 sequences with lengths drawn uniformly in [16, 4096] (seeded), a GQA layer with 16
query heads over 4 KV heads of head dim 64, block size 16. Each request is prefilled alone into
the paged cache (as a server admits them); the contiguous cache is a DynamicCache holding the
right-padded batch. A decode step appends one token to every sequence and attends:

* paged: ``PagedKVCache.attend(q, k, v)`` (writes the token, attention over the pages in place);
* contiguous: ``DynamicCache.update(k, v)`` + ``attnkit.attention(q, k_all, v_all,
  KeyPadding(lengths))``, what a user writes for a right-padded ragged batch;
* paged, scattered: the same paged step with every block table a random permutation (no two
  consecutive blocks adjacent in the pool): the worst case, where every key is gathered.

Memory: blocks in use x block bytes (internal fragmentation: the unused tail slots of each
sequence's last block) against the (64, max_len) buffers a contiguous cache must hold, and what
the DynamicCache actually holds after it grew. Timings: medians of interleaved steps.

    python benchmarks/bench_paged.py            # the full workload, fp32 and bf16
    python benchmarks/bench_paged.py --quick    # 8 short sequences, seconds
"""

from __future__ import annotations

import random
import sys

import torch

from _common import bench_main, interleaved_medians, machine, timed
import attnkit
from attnkit.caches import DynamicCache
from attnkit.caches.paged import BlockAllocator, PagedKVCache
from attnkit.masks import KeyPadding

HQ, HKV, D, BS = 16, 4, 64, 16


def scattered_allocator(num_blocks: int, seed: int) -> BlockAllocator:
    """Free blocks that come out in a random order: each block is cached as a full prefix block
    and freed in a shuffled order; allocations then evict them in that order."""
    alloc = BlockAllocator(num_blocks, BS, prefix_caching=True)
    sids = [alloc.add_sequence(token_ids=list(range(i * BS, (i + 1) * BS)) + [-1]) for i in range(num_blocks)]
    for s in sids:
        alloc.append(s, BS)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    for i in order:
        alloc.free(sids[i])
    return alloc


def prefill_paged(cache: PagedKVCache, ks, vs) -> None:
    """Each request alone, as a server admits them: one run of blocks per prompt."""
    sids = []
    for k, v in zip(ks, vs):
        sids.append(cache.allocator.add_sequence())
        cache.set_batch([sids[-1]])
        cache.update(k, v)
    cache.set_batch(sids)


def run_dtype(dtype, n_seq: int, max_len: int, steps: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(16, max_len + 1, (n_seq,), generator=g)
    L = int(lens.max())
    ks = [torch.randn(1, HKV, int(n), D, generator=g).to(dtype) for n in lens]
    vs = [torch.randn(1, HKV, int(n), D, generator=g).to(dtype) for n in lens]
    blocks = int(((lens + steps + 2 + BS - 1) // BS).sum())
    paged = PagedKVCache(HKV, D, num_blocks=blocks, block_size=BS, dtype=dtype)
    scattered = PagedKVCache(HKV, D, allocator=scattered_allocator(blocks, seed), dtype=dtype)
    for c in (paged, scattered):
        prefill_paged(c, ks, vs)
    dyn = DynamicCache(HKV, D, dtype=dtype)
    kp = torch.zeros(n_seq, HKV, L, D, dtype=dtype)
    vp = torch.zeros(n_seq, HKV, L, D, dtype=dtype)
    for b, (k, v) in enumerate(zip(ks, vs)):
        kp[b, :, :k.shape[2]] = k[0]
        vp[b, :, :v.shape[2]] = v[0]
    dyn.update(kp, vp, num_new=lens)
    del kp, vp, ks, vs

    live = int(lens.sum())
    tok = paged.bytes_per_token
    mem = {"live_tokens": live, "max_len": L, "blocks_used": paged.allocator.num_used,
           "paged_bytes": paged.nbytes_used, "live_bytes": live * tok, "contiguous_bytes": n_seq * L * tok}
    mem["fragmentation_pct"] = 100 * (1 - live / (paged.allocator.num_used * BS))

    # Decode: the same new tokens for every contender; step i of each uses inputs i.
    n_steps = steps + 1  # + one warm-up step (the DynamicCache grows its buffers there)
    qs = torch.randn(n_steps, n_seq, HQ, 1, D, generator=g).to(dtype)
    kn = torch.randn(n_steps, n_seq, HKV, 1, D, generator=g).to(dtype)
    vn = torch.randn(n_steps, n_seq, HKV, 1, D, generator=g).to(dtype)
    outs: dict[str, list] = {"paged": [], "contiguous": [], "scattered": []}

    def paged_step(cache, name):
        i = len(outs[name])
        outs[name].append(cache.attend(qs[i], kn[i], vn[i]))

    def contiguous_step():
        i = len(outs["contiguous"])
        k_all, v_all, _ = dyn.update(kn[i], vn[i])
        outs["contiguous"].append(attnkit.attention(qs[i], k_all, v_all, KeyPadding(dyn.lengths)))

    with torch.inference_mode():
        t = interleaved_medians({
            "paged": timed(lambda: paged_step(paged, "paged")),
            "contiguous": timed(contiguous_step),
            "scattered": timed(lambda: paged_step(scattered, "scattered")),
        }, steps, warmup=1)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for i in range(n_steps):  # same tokens, same answers
        torch.testing.assert_close(outs["paged"][i], outs["contiguous"][i], **tol)
        torch.testing.assert_close(outs["scattered"][i], outs["contiguous"][i], **tol)
    mem["dynamic_cache_bytes"] = dyn.nbytes
    return {"dtype": str(dtype).replace("torch.", ""), "n_seq": n_seq, "steps": steps, **mem,
            **{f"{k}_ms": v * 1e3 for k, v in t.items()}}


def run(quick: bool) -> dict:
    n_seq, max_len, steps = (8, 512, 5) if quick else (64, 4096, 21)
    rows = [run_dtype(dt, n_seq, max_len, steps) for dt in (torch.float32, torch.bfloat16)]
    return {"machine": machine(), "quick": quick, "heads": {"q": HQ, "kv": HKV, "head_dim": D},
            "block_size": BS, "rows": rows}


def to_markdown(res: dict) -> str:
    m, r0 = res["machine"], res["rows"][0]
    mib = 1 / 2 ** 20
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, attnkit {m['attnkit']}. "
        f"{r0['n_seq']} sequences, lengths uniform in [16, {4096 if not res['quick'] else 512}] "
        f"(longest {r0['max_len']}, {r0['live_tokens']} tokens in all), {res['heads']['q']} query / "
        f"{res['heads']['kv']} KV heads, head dim {res['heads']['head_dim']}, block size {res['block_size']}. "
        "Decode step: one new token per sequence, written and attended; medians of "
        f"{r0['steps']} interleaved steps; speed = contiguous time / paged time (> 1: paged faster).",
        "",
        "| dtype | live K/V MiB | paged MiB (blocks in use) | internal fragmentation | contiguous (B, max_len) MiB "
        "| DynamicCache held MiB | paged / contiguous memory |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['dtype']} | {r['live_bytes'] * mib:.1f} | {r['paged_bytes'] * mib:.1f} | "
                     f"{r['fragmentation_pct']:.2f}% | {r['contiguous_bytes'] * mib:.1f} | "
                     f"{r['dynamic_cache_bytes'] * mib:.1f} | {r['paged_bytes'] / r['contiguous_bytes']:.2f}x |")
    lines += ["", "| dtype | paged ms | contiguous ms (DynamicCache + KeyPadding) | paged speed | "
                  "paged, scattered tables ms | scattered speed |", "|---|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(f"| {r['dtype']} | {r['paged_ms']:.2f} | {r['contiguous_ms']:.2f} | "
                     f"{r['contiguous_ms'] / r['paged_ms']:.2f}x | {r['scattered_ms']:.2f} | "
                     f"{r['contiguous_ms'] / r['scattered_ms']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return bench_main(argv, __doc__, "paged", run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
