"""Quantized K/V (int8, fp8 e4m3; :class:`attnkit.QuantizedKV`): what it costs in accuracy and
what it buys in decode speed, on this CPU.

Speed: one decode step (B 1, Hq 32 / Hkv 8, D 128) over 4k and 32k keys, with the cache in fp32,
bf16, int8 and fp8, dense and paged (blocks of 16 in a shuffled pool), each read in place by
attnkit's split-K engine; beside them the peer a user of transformers' ``QuantizedCache`` gets
(dequantize the whole cache, then torch SDPA) and a plain sum over a buffer of the same bytes
(the machine's read bandwidth), all interleaved in one run; with every core, then with one core
at the longest context (a decode stream per core, as a server runs them).

Where the time goes: one core's nanoseconds per key and KV head with the cache read from memory
(32k keys) and with it sitting in the last-level cache (2k keys), net of the call's fixed cost
(16 keys): where the two are close, the step is bound by its arithmetic, not by the reads that
int8 halves.

Cache write: what quantizing a step's K and V costs a layer, the compiled one-pass quantizer
against the torch ops it replaces.

Quality: the attention output's error against fp64 attention over the unquantized K/V, relative
to the output's RMS, for Gaussian K/V and for K with outlier channels (a few channels 20x larger,
as in trained models' keys), with per-token scales, alone and with the fixed per-channel K scales
int8 caches set at their first write (what attnkit stores), and, for comparison, KIVI's
per-channel K scales over all the tokens (computed here, not stored by attnkit), plus a trained
model's own K/V when ``--model`` names a checkpoint folder.

    python benchmarks/bench_quantized.py            # full tables -> benchmarks/results/
    python benchmarks/bench_quantized.py --quick    # small sizes, seconds (CI smoke test)
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch
import torch.nn.functional as F

import attnkit
from attnkit import QuantizedKV
from attnkit.kvquant import QUANTIZED_DTYPES, channel_scale, dequantize, quantize
from _common import (bench_main, interleaved_medians, interleaved_samples, machine, medians, paired_speedup, timed,
                     torch_threads)

KV_DTYPES = [("int8", torch.int8)] + [("fp8", d) for d in QUANTIZED_DTYPES if d != torch.int8]


def _paged(x: torch.Tensor, block: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense (1, Hkv, S, D) -> pools (N, block, Hkv, D) in a shuffled order, and the (1, W) table."""
    _, H, S, D = x.shape
    W = S // block
    perm = torch.randperm(W, generator=g)
    pool = torch.empty(W, block, H, D, dtype=x.dtype)
    pool[perm] = x[0].reshape(H, W, block, D).permute(1, 2, 0, 3)
    return pool, perm.view(1, W)


def _speed(quick: bool) -> list[dict]:
    """Every core, then one core at the longest context: one core is what a decode stream gets
    when a server runs a stream per core, and there a compute-bound kernel (int8 widens and scales
    what it reads) and a bandwidth-bound one (bf16) compare differently than with every core
    pulling from memory at once."""
    g = torch.Generator().manual_seed(0)
    rows = []
    everyone = torch.get_num_threads()
    runs = [(1024, everyone), (4096, everyone), (4096, 1)] if quick else \
        [(4096, everyone), (32768, everyone), (32768, 1)]
    for ctx, threads in runs:
        with torch_threads(threads):
            rows += _speed_rows(ctx, threads, quick, g, peer=threads == everyone)
    return rows


def _speed_rows(ctx: int, threads: int, quick: bool, g: torch.Generator, peer: bool) -> list[dict]:
    """The rows of one context and thread count (``peer``: with the dequantize-then-SDPA peer)."""
    rows = []
    k32 = torch.randn(1, 8, ctx, 128, generator=g)
    v32 = torch.randn(1, 8, ctx, 128, generator=g)
    for layout in ("dense", "paged"):
        fns, nbytes, calls = {}, {}, {}
        for name, dt in [("fp32", torch.float32), ("bf16", torch.bfloat16)] + KV_DTYPES:
            qdt = torch.float32 if dt == torch.float32 else torch.bfloat16
            q = torch.randn(1, 32, 1, 128, generator=g).to(qdt)
            if dt in (torch.float32, torch.bfloat16):
                k, v = k32.to(dt), v32.to(dt)
                nbytes[name] = 2 * k.numel() * k.element_size()
                if layout == "paged":
                    kp, table = _paged(k, 16, torch.Generator().manual_seed(1))
                    vp, _ = _paged(v, 16, torch.Generator().manual_seed(1))
                    kv = attnkit.PagedKV(kp, vp, table, torch.tensor([ctx]), max_len=ctx, checked=True)
                    args = (q, kv, None)
                else:
                    args = (q, k, v)
            else:
                if layout == "paged":
                    kp, table = _paged(k32, 16, torch.Generator().manual_seed(1))
                    vp, _ = _paged(v32, 16, torch.Generator().manual_seed(1))
                    kv = dataclasses.replace(QuantizedKV.quantize(kp, vp, dt, block_table=table,
                                                                  lengths=torch.tensor([ctx]), max_len=ctx),
                                             checked=True)  # as the caches pass it, and the bf16 row
                else:
                    kv = QuantizedKV.quantize(k32, v32, dt)
                args = (q, kv, None)
                nbytes[name] = 2 * (kv.k.numel() + 4 * kv.k_scale.numel())
                if peer and layout == "dense" and name == "int8":  # the dequantize-then-SDPA peer
                    def peer(q=q, kv=kv):
                        kd, vd = kv.gather(q.dtype)
                        return F.scaled_dot_product_attention(q, kd, vd, enable_gqa=True)
                    fns["int8 dequantize+SDPA"] = timed(peer)
            fns[name] = timed(lambda a=args: attnkit.attention(*a))
            calls[name] = args
        read = torch.ones(nbytes["bf16"] // 4)
        fns["read"] = timed(lambda: read.sum())
        with torch.inference_mode():
            samples = interleaved_samples(fns, 5 if quick else (41 if ctx <= 4096 else 21), warmup=2)
        t = medians(samples)
        read_bw = nbytes["bf16"] / t["read"] / 1e9
        calls = {name: attnkit.describe_call(*a, detail=True) for name, a in calls.items()}  # after the runs
        for name in nbytes:
            rows.append({"ctx": ctx, "threads": threads, "layout": layout, "kv": name, "backend": calls[name],
                         "ms": t[name] * 1e3, "kv_bytes": nbytes[name],
                         "GBps": nbytes[name] / t[name] / 1e9, "read_GBps": read_bw,
                         "vs_bf16": paired_speedup(samples, "bf16", name)})
        if "int8 dequantize+SDPA" in t:
            rows.append({"ctx": ctx, "threads": threads, "layout": layout,
                         "kv": "int8 dequantize+SDPA (QuantizedCache-style)",
                         "backend": "torch SDPA", "ms": t["int8 dequantize+SDPA"] * 1e3,
                         "kv_bytes": nbytes["int8"], "GBps": nbytes["int8"] / t["int8 dequantize+SDPA"] / 1e9,
                         "read_GBps": read_bw, "vs_bf16": paired_speedup(samples, "bf16", "int8 dequantize+SDPA")})
    return rows


def _arithmetic(quick: bool) -> list[dict]:
    """One core, int8 and bf16 (dense, the speed table's shape): the fixed cost of a call (16 keys),
    then a cache-resident context's and a long one's step net of it, per key and KV head. Short
    contexts repeat the call so that every timing covers about as many keys as the longest."""
    g = torch.Generator().manual_seed(2)
    ctxs = [16, 512, 4096] if quick else [16, 2048, 32768]
    fns, nbytes = {}, {}
    for ctx in ctxs:
        k, v = torch.randn(1, 8, ctx, 128, generator=g), torch.randn(1, 8, ctx, 128, generator=g)
        q = torch.randn(1, 32, 1, 128, generator=g).bfloat16()
        kv = QuantizedKV.quantize(k, v, torch.int8)
        nbytes[(ctx, "bf16")] = 2 * k.numel() * 2
        nbytes[(ctx, "int8")] = 2 * (kv.k.numel() + 4 * kv.k_scale.numel())
        for name, args in (("bf16", (q, k.bfloat16(), v.bfloat16())), ("int8", (q, kv, None))):
            def calls(a=args, n=max(1, ctxs[-1] // ctx)) -> float:
                t0 = time.perf_counter()
                for _ in range(n):
                    attnkit.attention(*a)
                return (time.perf_counter() - t0) / n
            fns[(ctx, name)] = calls
    with torch_threads(1), torch.inference_mode():
        t = medians(interleaved_samples(fns, 5 if quick else 15, warmup=2))
    fixed, cached, memory = ctxs
    rows = []
    for name in ("bf16", "int8"):
        ns = {ctx: (t[(ctx, name)] - t[(fixed, name)]) * 1e9 / ((ctx - fixed) * 8) for ctx in (cached, memory)}
        rows.append({"kv": name, "fixed_us": t[(fixed, name)] * 1e6, "cached_ctx": cached, "memory_ctx": memory,
                     "cached_bytes": nbytes[(cached, name)], "memory_bytes": nbytes[(memory, name)],
                     "cached_ns": ns[cached], "memory_ns": ns[memory]})
    return rows


def per_channel_k(k: torch.Tensor, dt) -> torch.Tensor:
    """K quantized with one scale per (KV head, channel) over the tokens (KIVI), dequantized."""
    data, scale = quantize(k.transpose(-1, -2), dt)  # rows = channels
    return dequantize(data, scale, torch.float64).transpose(-1, -2)


def output_error(q, k, v, kd, vd) -> float:
    """max |out(kd, vd) - out(k, v)| / RMS(out(k, v)), fp64, causal decode-like rows."""
    want = attnkit.attention_reference(q, k, v, causal=True)
    got = attnkit.attention_reference(q, kd, vd, causal=True)
    return ((got - want).abs().max() / want.pow(2).mean().sqrt()).item()


def _quality(quick: bool) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    S = 256 if quick else 2048
    rows = []
    q = torch.randn(1, 32, 16, 128, generator=g, dtype=torch.float64)
    v = torch.randn(1, 8, S, 128, generator=g, dtype=torch.float64)
    k = torch.randn(1, 8, S, 128, generator=g, dtype=torch.float64)
    outlier = k.clone()
    chans = torch.randperm(128, generator=g)[:4]
    outlier[..., chans] *= 20
    for kname, kk in (("Gaussian", k), ("K with 4 outlier channels (20x)", outlier)):
        for name, dt in KV_DTYPES:
            vd = dequantize(*quantize(v, dt), torch.float64)
            bf = kk.bfloat16().double(), v.bfloat16().double()
            c = channel_scale(kk[:, :, :64])  # what a cache fixes at its first write (a 64-token prompt)
            smooth = QuantizedKV.quantize(kk, None, dt, v_head_dim=128, k_channel_scale=c).gather(torch.float64)[0]
            rows.append({"K": kname, "kv": name, "bf16_err": output_error(q, kk, v, *bf),
                         "per_token_err": output_error(q, kk, v, dequantize(*quantize(kk, dt), torch.float64), vd),
                         "channel_scaled_err": output_error(q, kk, v, smooth, vd),
                         "per_channel_k_err": output_error(q, kk, v, per_channel_k(kk, dt), vd)})
    return rows


def _write(quick: bool) -> list[dict]:
    """What a quantized cache adds to each layer's write: quantizing the step's K and V rows
    (bf16, Hkv 8, D 128), by the compiled one-pass quantizer and by the torch ops (the same
    arithmetic and bits; what runs under torch.compile, without the native library, and for more
    than ``NATIVE_MAX_ROWS`` rows), and which one ``quantize`` takes at that size."""
    from attnkit import kvquant, native

    ops = native.load()
    torch_ops = kvquant._native_applies
    rows = []
    for S in (1, 32, 512):
        x = torch.randn(1, 8, S, 128, dtype=torch.bfloat16)
        for name, dt in KV_DTYPES:
            kind = 0 if dt == torch.int8 else 1

            def compiled(x=x, kind=kind):
                t0 = time.perf_counter()
                ops.quantize_kv_rows(x, kind)  # K
                ops.quantize_kv_rows(x, kind)  # V
                return time.perf_counter() - t0

            def torch_path(x=x, dt=dt):
                kvquant._native_applies = lambda t: False
                try:
                    t0 = time.perf_counter()
                    quantize(x, dt)
                    quantize(x, dt)
                    return time.perf_counter() - t0
                finally:
                    kvquant._native_applies = torch_ops

            fns = {"torch": torch_path} if ops is None else {"native": compiled, "torch": torch_path}
            t = interleaved_medians(fns, reps=50 if quick else 300, warmup=5)
            rows.append({"tokens": S, "rows": 8 * S, "kv": name, "native_us": t.get("native", float("nan")) * 1e6,
                         "torch_us": t["torch"] * 1e6, "takes": "native" if torch_ops(x) else "torch"})
    return rows


def run(quick: bool) -> dict:
    torch.manual_seed(0)
    return {"machine": machine(), "quick": quick, "speed": _speed(quick), "arithmetic": _arithmetic(quick),
            "write": _write(quick), "quality": _quality(quick)}


def to_markdown(res: dict) -> str:
    m = res["machine"]
    lines = [
        f"Machine: {m['cpu']} ({m.get('isa', '?')}), {m['cores']} cores ({m['torch_threads']} torch threads), "
        f"torch {m['torch']}, attnkit {m['attnkit']}.",
        "",
        "**Decode speed** (B 1, Hq 32 / Hkv 8, D 128, one query; q in fp32 for the fp32 cache, else bf16). "
        "K/V bytes include the fp32 row scales. Machine read GB/s: a plain sum over the bf16 cache's bytes, "
        "interleaved with the contenders. Medians of interleaved runs; speed vs bf16: the median over runs of "
        "bf16's time / this one's in the same run (a drifting machine moves both).",
        "",
        "| context | threads | layout | K/V | attnkit backend | ms | K/V bytes | read GB/s | machine read GB/s | "
        "share | speed vs bf16 |",
        "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["speed"]:
        lines.append(f"| {r['ctx']} | {r.get('threads', m['torch_threads'])} | {r['layout']} | {r['kv']} | "
                     f"{r['backend']} | {r['ms']:.2f} | "
                     f"{r['kv_bytes'] / 2**20:.1f} MiB | {r['GBps']:.1f} | {r['read_GBps']:.1f} | "
                     f"{100 * r['GBps'] / r['read_GBps']:.0f}% | {r['vs_bf16']:.2f}x |")
    if res.get("arithmetic"):
        a0 = res["arithmetic"][0]
        lines += [
            "",
            f"**Where the time goes** (one core, dense, the shape above): nanoseconds per key and KV head of a "
            f"decode step net of the call's fixed cost (a 16-key call), with the cache at {a0['cached_ctx']} keys "
            f"(it sits in the last-level cache) and at {a0['memory_ctx']} keys (read from memory, where it is "
            "larger than that cache). Arithmetic share: the first over the second; near 100% the step is bound by "
            "its arithmetic, and halving the bytes it reads cannot halve its time.",
            "",
            f"| K/V | fixed cost (us) | bytes at {a0['cached_ctx']} / {a0['memory_ctx']} keys | "
            f"ns per key-head at {a0['cached_ctx']} | at {a0['memory_ctx']} | arithmetic share |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in res["arithmetic"]:
            lines.append(f"| {r['kv']} | {r['fixed_us']:.0f} | {r['cached_bytes'] / 2**20:.1f} / "
                         f"{r['memory_bytes'] / 2**20:.0f} MiB | {r['cached_ns']:.1f} | {r['memory_ns']:.1f} | "
                         f"{100 * r['cached_ns'] / r['memory_ns']:.0f}% |")
    lines += [
        "",
        "**Cache write**: quantizing one layer's new K and V rows (bf16, Hkv 8, D 128; a decode token, or a "
        "prompt) as a quantized cache's step does, by the compiled one-pass quantizer (`native/kvquant.cpp`) "
        "and by the torch ops (the same bits; what runs under torch.compile). `quantize` takes the compiled "
        "one up to `NATIVE_MAX_ROWS` rows. Medians of interleaved runs, microseconds for K and V together.",
        "",
        "| tokens | rows | K/V | compiled one pass (us) | torch ops (us) | torch / compiled | quantize takes |",
        "|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in res.get("write", []):
        lines.append(f"| {r['tokens']} | {r['rows']} | {r['kv']} | {r['native_us']:.1f} | {r['torch_us']:.1f} | "
                     f"{r['torch_us'] / r['native_us']:.2f}x | {r['takes']} |")
    lines += [
        "",
        "**Attention-output error** of a quantized cache: max |out - out_exact| / RMS(out_exact) over 16 causal "
        "query rows (Hq 32 / Hkv 8, D 128), fp64 arithmetic, so only the storage differs. bf16: the cache in bf16 "
        "(today's default). Per-token: one scale per token and KV head, K and V. + channel scales: K also "
        "divided by fixed per-channel scales taken from its first 64 tokens (`QuantizedKV(k_channel_scale=...)`; "
        "what int8 caches set at their first write by default). Per-channel K: one scale per channel of K over "
        "all the tokens (KIVI's K), V per token, for comparison (not a layout attnkit reads).",
        "",
        "| K | K/V | bf16 cache | per-token | per-token + channel scales (attnkit) | per-channel K (KIVI) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in res["quality"]:
        lines.append(f"| {r['K']} | {r['kv']} | {r['bf16_err']:.2e} | {r['per_token_err']:.2e} | "
                     f"{r['channel_scaled_err']:.2e} | {r['per_channel_k_err']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return bench_main(argv, __doc__, "quantized", run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
