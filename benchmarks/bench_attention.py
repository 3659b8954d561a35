"""attnkit.attention side by side with torch SDPA and a textbook implementation.

Prefill (causal, Sq = Sk), MLA-shaped prefill (K wider than V: D 192, Dv 128; the peer pads V to
D, as a user of SDPA must) and decode (Sq = 1 over a KV cache, GQA 32/8 heads), fp32 and bf16.
Each repetition runs every contender once, in turn, so they share the machine's noise; the
table reports medians and ratios, which backend and strategy attnkit ran
(``describe_call(detail=True)``), plus the decode path's KV read bandwidth against the machine's
own read bandwidth measured in the same run.

    python benchmarks/bench_attention.py            # full table -> benchmarks/results/
    python benchmarks/bench_attention.py --quick    # small sizes, seconds (CI smoke test)
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

import attnkit
from _common import bench_main, interleaved_medians, machine, read_probe, timed


def textbook(q, k, v, causal: bool):
    """What the tutorials write: K/V repeated per head, materialized scores, a -1e9 mask."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        Sq, Sk = q.shape[2], k.shape[2]
        keep = torch.ones(Sq, Sk, dtype=torch.bool).tril(Sk - Sq)
        scores = scores.masked_fill(~keep, -1e9)
    return torch.softmax(scores, dim=-1) @ v


def sdpa(q, k, v, causal: bool):
    """The peer as a user would call it. Decode (Sq=1) needs no mask; prefill has Sq == Sk."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal and q.shape[2] > 1,
                                          enable_gqa=q.shape[1] != k.shape[1])


def ours(q, k, v, causal: bool):
    return attnkit.attention(q, k, v, causal=causal)


def sdpa_padded(q, k, v, causal: bool):
    """SDPA for K wider than V as a user gets it onto the fused kernel: V zero-padded to D, the
    output sliced back."""
    D, Dv = q.shape[-1], v.shape[-1]
    out = F.scaled_dot_product_attention(q, k, F.pad(v, (0, D - Dv)), is_causal=causal,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[..., :Dv]


CONTENDERS = {"attnkit": ours, "torch_sdpa": sdpa, "textbook": textbook}


def run(quick: bool) -> dict:
    torch.manual_seed(0)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = []
    # Prefill: B=1, 8 heads, D=64, causal, Sq = Sk = S.
    prefill_sizes = [256, 512] if quick else [512, 2048, 8192]
    for S in prefill_sizes:
        for dname, dt in dtypes.items():
            q, k, v = (torch.randn(1, 8, S, 64, dtype=dt) for _ in range(3))
            fns = {n: timed(lambda f=f: f(q, k, v, True)) for n, f in CONTENDERS.items()}
            if S > 4096:  # the textbook's (8, S, S) fp32 scores alone are 2 GB
                fns.pop("textbook")
            # Short calls get more repetitions: a 1 ms call's median needs many to settle on a shared VM.
            reps = 3 if quick else {512: 101, 2048: 31}.get(S, 7)
            with torch.inference_mode():
                t = interleaved_medians(fns, reps, warmup=1)
            rows.append({"case": "prefill causal", "shape": f"B1 H8 S{S} D64", "dtype": dname,
                         "backend": attnkit.describe_call(q, k, v, causal=True, detail=True),
                         **{f"{n}_ms": t[n] * 1e3 for n in t}})
    # MLA-shaped prefill: 16 heads, K 192 wide (128 nope + 64 rope), V 128.
    for S in ([256] if quick else [2048]):
        for dname, dt in dtypes.items():
            q, k = (torch.randn(1, 16, S, 192, dtype=dt) for _ in range(2))
            v = torch.randn(1, 16, S, 128, dtype=dt)
            fns = {"attnkit": timed(lambda: ours(q, k, v, True)), "torch_sdpa": timed(lambda: sdpa_padded(q, k, v, True))}
            with torch.inference_mode():
                t = interleaved_medians(fns, 3 if quick else 7, warmup=1)
            rows.append({"case": "prefill causal, K wider than V", "shape": f"B1 H16 S{S} D192 Dv128", "dtype": dname,
                         "backend": attnkit.describe_call(q, k, v, causal=True, detail=True),
                         **{f"{n}_ms": t[n] * 1e3 for n in t}})
    # Decode: B=1, 32 query heads over 8 KV heads, D=128, one new token over the cache.
    contexts = [1024, 4096] if quick else [4096, 32768]
    for ctx in contexts:
        for dname, dt in dtypes.items():
            q = torch.randn(1, 32, 1, 128, dtype=dt)
            k, v = (torch.randn(1, 8, ctx, 128, dtype=dt) for _ in range(2))
            kv_bytes = k.numel() * k.element_size() * 2
            fns = {n: timed(lambda f=f: f(q, k, v, True)) for n, f in CONTENDERS.items()}
            fns["read"] = timed(read_probe(kv_bytes))
            with torch.inference_mode():
                t = interleaved_medians(fns, 5 if quick else (51 if ctx <= 4096 else 15), warmup=2)
            bw = kv_bytes / t.pop("read") / 1e9
            rows.append({"case": "decode", "shape": f"B1 Hq32 Hkv8 ctx{ctx} D128", "dtype": dname,
                         "backend": attnkit.describe_call(q, k, v, causal=True, detail=True),
                         **{f"{n}_ms": t[n] * 1e3 for n in t},
                         "attnkit_GBps": kv_bytes / t["attnkit"] / 1e9, "read_GBps": bw,
                         })
    for r in rows:
        r["speedup_vs_sdpa"] = r["torch_sdpa_ms"] / r["attnkit_ms"]
        if "textbook_ms" in r:
            r["speedup_vs_textbook"] = r["textbook_ms"] / r["attnkit_ms"]
    return {"machine": machine(), "quick": quick, "rows": rows}


def to_markdown(res: dict) -> str:
    m = res["machine"]
    lines = [
        f"Machine: {m['cpu']} ({m.get('isa', '?')}), {m['cores']} cores ({m['torch_threads']} torch threads), "
        f"torch {m['torch']}, attnkit {m['attnkit']}, Python {m['python']}. Medians of interleaved runs; ratio > 1 "
        "means attnkit is faster. attnkit backend: `describe_call(detail=True)` (decode[native]: the compiled "
        "split-K kernel). K wider than V: the SDPA column pads V to D (what reaches SDPA's fused kernel). "
        "Machine read GB/s: a plain sum over a buffer the size of the KV cache, timed in the same interleaved runs. "
        "Textbook: not run at S 8192 (its scores alone are 2 GB) nor for K wider than V.",
        "",
        "| case | shape | dtype | attnkit backend | attnkit ms | torch SDPA ms | textbook ms | vs SDPA | vs textbook | attnkit KV read GB/s | machine read GB/s | share |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        tb = f"{r['textbook_ms']:.2f}" if "textbook_ms" in r else "-"
        vt = f"{r['speedup_vs_textbook']:.2f}x" if "speedup_vs_textbook" in r else "-"
        bw = (f"{r['attnkit_GBps']:.1f} | {r['read_GBps']:.1f} | {100 * r['attnkit_GBps'] / r['read_GBps']:.0f}%"
              if "attnkit_GBps" in r else "- | - | -")
        lines.append(f"| {r['case']} | {r['shape']} | {r['dtype']} | {r['backend']} | {r['attnkit_ms']:.2f} | "
                     f"{r['torch_sdpa_ms']:.2f} | {tb} | {r['speedup_vs_sdpa']:.2f}x | {vt} | {bw} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return bench_main(argv, __doc__, "attention", run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
