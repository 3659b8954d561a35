"""Sparse attention read in place: a per-query top-k key selection (DeepSeek-V3.2's DSA) against
dense attention over the same cache, on CPU.

Decode, batch 1, one query over a cache of C keys, each step attending to the top-k keys the
indexer picked (random distinct positions here; the kernels never look at how they were chosen):

* ``sparse``: ``attnkit.attention(q, k, v, SelectedKeys(ids) & Causal())``; ``auto`` runs the
  split-K engine, which walks the k selected keys (``decode[native, selection read in place]``).
* ``dense``: the same call without the selection, over all C keys (the engine too).
* ``dense k``: dense decode over a cache of only k keys: the floor a selection can reach.
* ``sdpa mask``: torch SDPA with the selection as a dense bool mask (1, 1, 1, C), built before
  the timing: transformers' sdpa path for DSA models, minus its mask build. For MLA's one latent
  head the 128 query heads go in as 128 queries of one head (SDPA would otherwise expand the
  latent to every head: gigabytes at 32k).

Three selections: top-k keys over GQA (Hq 32 / Hkv 8, D 128) and over absorbed MLA (128 heads over
one 512 + 64 latent, V the latent's first 512 channels), and the same k keys as whole blocks of 64
over GQA (MiniMax-M3's and NSA's block selection), bf16.

Quality, beside the speed: how far the sparse output is from dense attention over the same cache
when the selection is the top-k of the true scores (an exact indexer; DSA's indexer approximates
it), for attention with structure (each query has 32 keys it matches strongly, as in recall) and
without (random q and k: nearly uniform weights, the worst case for any top-k): the share of the
dense attention weight the selected keys hold, and the relative error ||sparse - dense|| / ||dense||.

Prefill of S tokens, each query with its own top-k keys among those before it (a query with fewer
than k keys before it sees all of them): ``sparse`` against SDPA's causal attention over the same
sequence (``enable_gqa``), and each call's peak memory, measured in a fresh process (the peak
resident set during the call, over the inputs it was handed; the output is part of the peak).

    python benchmarks/bench_sparse.py           # C 32k, top 2048; prefill 8k, top 2048
    python benchmarks/bench_sparse.py --quick   # small sizes, seconds
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

import attnkit
from _common import bench_main, interleaved_samples, machine, medians, paired_speedup, timed
from attnkit import masks as M

FULL = dict(context=32768, topk=2048, prefill=8192, prefill_topk=2048, reps=7, prefill_reps=2,
            gqa=(32, 8, 128), mla=(128, 512, 64))
QUICK = dict(context=4096, topk=256, prefill=512, prefill_topk=64, reps=3, prefill_reps=1,
             gqa=(8, 2, 64), mla=(16, 64, 16))


#: Keys per block of the block selection row.
BLOCK = 64


def _topk_ids(S: int, C: int, k: int, seed: int, block: int = 256) -> torch.Tensor:
    """(1, S, k) int64: query i of S (the last S of C positions) picks k random distinct keys
    among the C - S + i + 1 before it (all of them, then -1, when there are fewer), a block of
    queries at a time (no (S, C) tensor)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(1, S, k, dtype=torch.long)
    for i0 in range(0, S, block):
        i1 = min(S, i0 + block)
        scores = torch.rand(i1 - i0, C, generator=g)
        last = torch.arange(i0, i1)[:, None] + (C - S)
        scores = scores.masked_fill(torch.arange(C)[None] > last, -1.0)
        val, idx = scores.topk(min(k, C), -1)
        out[0, i0:i1] = torch.where(val >= 0, idx, -1)
    return out


def _decode_inputs(shape: str, cfg: dict, dtype=torch.bfloat16):
    """q (1, Hq, 1, D), k, v (v a view of k for MLA), the decode selection mask and its dense bool
    form (1, 1, 1, C)."""
    C, k_sel = cfg["context"], cfg["topk"]
    g = torch.Generator().manual_seed(1)
    if shape.startswith("gqa"):
        Hq, Hkv, D = cfg["gqa"]
        q = torch.randn(1, Hq, 1, D, generator=g).to(dtype)
        k = torch.randn(1, Hkv, C, D, generator=g).to(dtype)
        v = torch.randn(1, Hkv, C, D, generator=g).to(dtype)
    else:
        Hq, r, dr = cfg["mla"]
        q = torch.randn(1, Hq, 1, r + dr, generator=g).to(dtype)
        k = torch.randn(1, 1, C, r + dr, generator=g).to(dtype)
        v = k[..., :r]
    dense = torch.zeros(1, 1, 1, C, dtype=torch.bool)
    if shape == "gqa-blocks":  # k keys as k / BLOCK whole blocks (MiniMax-M3, NSA)
        blocks = torch.randperm(C // BLOCK, generator=g)[:k_sel // BLOCK]
        dense.view(C // BLOCK, BLOCK)[blocks] = True
        return q, k, v, M.SelectedBlocks(blocks.view(1, 1, -1), BLOCK) & M.Causal(), dense
    ids = _topk_ids(1, C, k_sel, seed=2)
    dense[0, 0, 0, ids[0, 0]] = True
    return q, k, v, M.SelectedKeys(ids) & M.Causal(), dense


def _sdpa_masked(q, k, v, mask, scale):
    """SDPA over a dense (1, 1, 1, C) mask: GQA through ``enable_gqa``; one KV head (MLA) with the
    query heads as queries of that head, so nothing is expanded per head."""
    if k.shape[1] == 1:
        B, H, _, _ = q.shape
        out = F.scaled_dot_product_attention(q.reshape(B, 1, H, -1), k, v, attn_mask=mask, scale=scale)
        return out.view(B, H, 1, -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _decode_row(shape: str, cfg: dict) -> dict:
    q, k, v, sel, dense_mask = _decode_inputs(shape, cfg)
    kk = cfg["topk"]
    k_small = k[:, :, :kk].contiguous()
    v_small = k_small[..., :v.shape[-1]] if v.data_ptr() == k.data_ptr() else v[:, :, :kk].contiguous()
    scale = q.shape[-1] ** -0.5
    with torch.inference_mode():
        got = attnkit.attention(q, k, v, sel, scale=scale)
        want = _sdpa_masked(q.float(), k.float(), v.float(), dense_mask, scale)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
        fns = {
            "sparse": timed(lambda: attnkit.attention(q, k, v, sel, scale=scale)),
            "dense": timed(lambda: attnkit.attention(q, k, v, causal=True, scale=scale)),
            "dense k": timed(lambda: attnkit.attention(q, k_small, v_small, causal=True, scale=scale)),
            "sdpa mask": timed(lambda: _sdpa_masked(q, k, v, dense_mask, scale)),
        }
        samples = interleaved_samples(fns, cfg["reps"], warmup=2)
    med = medians(samples)
    return {"shape": shape, "heads": list(q.shape[1:2]) + [k.shape[1]], "head_dim": [q.shape[-1], v.shape[-1]],
            "context": k.shape[2], "topk": kk, "kernel": attnkit.describe_call(q, k, v, sel, detail=True),
            **{f"{n}_ms": t * 1e3 for n, t in med.items()},
            "dense_over_sparse": paired_speedup(samples, "sparse", "dense") ** -1,
            "sparse_over_dense_k": paired_speedup(samples, "dense k", "sparse") ** -1,
            "sdpa_over_sparse": paired_speedup(samples, "sparse", "sdpa mask") ** -1}


def _quality_rows(cfg: dict) -> list[dict]:
    """Sparse against dense decode (GQA shape, fp32) with the selection the true scores' top-k
    (scores summed over a KV group's heads), with and without planted strong matches."""
    C = cfg["context"]
    Hq, Hkv, D = cfg["gqa"]
    rows = []
    for structure in ("32 strong matches per query", "none (random q, k)"):
        g = torch.Generator().manual_seed(5)
        q = torch.randn(1, Hq, 1, D, generator=g)
        k = torch.randn(1, Hkv, C, D, generator=g)
        v = torch.randn(1, Hkv, C, D, generator=g)
        if structure.startswith("32"):  # keys the group's queries match: scaled score 8 on average
            pos = torch.randperm(C, generator=g)[:32]
            mean_q = q.view(1, Hkv, Hq // Hkv, D).mean(2)  # (1, Hkv, D)
            k[:, :, pos] = (8 * D ** 0.5 * mean_q / mean_q.pow(2).sum(-1, keepdim=True))[:, :, None]
        with torch.inference_mode():
            dense, w = attnkit.attention(q, k, v, return_weights=True)  # w (1, Hq, 1, C)
            for kk in sorted({cfg["topk"] // 8, cfg["topk"]}):
                score = (q.view(1, Hkv, Hq // Hkv, D) @ k.transpose(-1, -2)).sum(2)  # (1, Hkv, C)
                ids = score.topk(kk, -1).indices[:, :, None]  # (1, Hkv, 1, k): per KV group
                sel = M.SelectedKeys(ids, num_heads=Hq)
                out = attnkit.attention(q, k, v, sel)
                chosen = torch.zeros(1, Hkv, C, dtype=torch.bool).scatter_(-1, ids[:, :, 0], True)
                mass = (w[:, :, 0] * chosen.repeat_interleave(Hq // Hkv, 1)).sum(-1).mean().item()
                rows.append({"structure": structure, "context": C, "topk": kk, "weight_share": mass,
                             "rel_error": ((out - dense).norm() / dense.norm()).item()})
    return rows


def _prefill_inputs(cfg: dict, dtype=torch.bfloat16):
    S, kk = cfg["prefill"], cfg["prefill_topk"]
    Hq, Hkv, D = cfg["gqa"]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, Hq, S, D, generator=g).to(dtype)
    k = torch.randn(1, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(1, Hkv, S, D, generator=g).to(dtype)
    return q, k, v, _topk_ids(S, S, kk, seed=4)


def _prefill_call(which: str, q, k, v, ids):
    if which == "sparse":
        return attnkit.attention(q, k, v, M.SelectedKeys(ids) & M.Causal())
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_child(which: str, cfg: dict) -> None:
    """In a fresh process: the call's peak resident memory over what it was handed (printed as
    JSON). The peak counter is reset (/proc/self/clear_refs) once the inputs exist."""
    small = dict(cfg, prefill=64, prefill_topk=8)
    with torch.inference_mode():
        _prefill_call(which, *_prefill_inputs(small))  # loads the kernels and the thread pool
        q, k, v, ids = _prefill_inputs(cfg)
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        out = _prefill_call(which, q, k, v, ids)
        peak = _status("VmHWM")
    handed = sum(t.numel() * t.element_size() for t in (q, k, v)) + (ids.numel() * ids.element_size()
                                                                     if which == "sparse" else 0)
    print(json.dumps({"extra": peak - before, "handed": handed, "output": out.numel() * out.element_size()}))


def _peak(which: str, cfg: dict) -> dict | None:
    if not os.path.exists("/proc/self/clear_refs"):
        return None
    res = subprocess.run([sys.executable, __file__, "--peak-child", which, json.dumps(cfg)], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    if res.returncode != 0:
        print(f"  peak memory of {which} not measured: {res.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


def _prefill_row(cfg: dict) -> dict:
    q, k, v, ids = _prefill_inputs(cfg)
    with torch.inference_mode():
        fns = {"sparse": timed(lambda: _prefill_call("sparse", q, k, v, ids)),
               "sdpa causal": timed(lambda: _prefill_call("sdpa", q, k, v, ids))}
        samples = interleaved_samples(fns, cfg["prefill_reps"], warmup=1)
    med = medians(samples)
    row = {"tokens": q.shape[2], "topk": ids.shape[-1], "heads": [q.shape[1], k.shape[1]], "head_dim": q.shape[-1],
           "kernel": attnkit.describe_call(q, k, v, M.SelectedKeys(ids) & M.Causal(), detail=True),
           **{f"{n}_s": t for n, t in med.items()},
           "sdpa_over_sparse": paired_speedup(samples, "sparse", "sdpa causal") ** -1}
    del q, k, v, ids
    for which in ("sparse", "sdpa"):
        p = _peak(which, cfg)
        if p is not None:
            row[f"{which}_peak_mb"] = (p["handed"] + p["extra"]) / 2 ** 20
            row[f"{which}_peak_over_io"] = (p["handed"] + p["extra"]) / (p["handed"] + p["output"])
    return row


def run(quick: bool) -> dict:
    cfg = QUICK if quick else FULL
    load_start = os.getloadavg()[0]
    decode = []
    for shape in ("gqa", "gqa-blocks", "mla"):
        decode.append(_decode_row(shape, cfg))
        print(f"  decode {shape}: " + ", ".join(f"{k} {v:.3g}" for k, v in decode[-1].items()
                                                if isinstance(v, float)), flush=True)
    quality = _quality_rows(cfg)
    prefill = _prefill_row(cfg)
    print("  prefill: " + ", ".join(f"{k} {v:.3g}" for k, v in prefill.items() if isinstance(v, float)), flush=True)
    return {"machine": machine(), "quick": quick, "config": cfg, "decode": decode, "quality": quality,
            "prefill": prefill,
            "load_average": [load_start, os.getloadavg()[0]]}


def to_markdown(res: dict) -> str:
    m = res["machine"]
    lines = [f"Machine: {m['cpu']} ({m['isa']}), {m['cores']} cores, torch {m['torch']}, attnkit {m['attnkit']}; "
             f"torch threads {m['torch_threads']}; 1-minute load average {res['load_average'][0]:.1f} at the start, "
             f"{res['load_average'][1]:.1f} at the end. bf16, batch 1; medians of interleaved runs, ratios the "
             "median of per-repetition ratios.", "",
             "Decode, one query over C keys, top-k selected:", "",
             "| shape | C | k | sparse ms | dense ms | dense over k keys ms | SDPA + dense mask ms "
             "| dense / sparse | sparse / dense-k | SDPA mask / sparse | kernel |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["decode"]:
        shape = (f"GQA {r['heads'][0]}/{r['heads'][1]}, D {r['head_dim'][0]}" if r["shape"].startswith("gqa") else
                 f"MLA {r['heads'][0]} heads, latent {r['head_dim'][1]} + {r['head_dim'][0] - r['head_dim'][1]}")
        if r["shape"] == "gqa-blocks":
            shape += f", {r['topk'] // BLOCK} blocks of {BLOCK}"
        lines.append(f"| {shape} | {r['context']} | {r['topk']} | {r['sparse_ms']:.3f} | {r['dense_ms']:.3f} | "
                     f"{r['dense k_ms']:.3f} | {r['sdpa mask_ms']:.3f} | {r['dense_over_sparse']:.1f}x | "
                     f"{r['sparse_over_dense_k']:.2f}x | {r['sdpa_over_sparse']:.1f}x | `{r['kernel']}` |")
    lines += ["", "Quality of the same decode (GQA shape, fp32) with the top-k of the true scores (an exact "
              "indexer) against dense attention:", "",
              "| structure | C | k | dense weight on the selected keys | relative error |", "|---|---:|---:|---:|---:|"]
    for r in res["quality"]:
        lines.append(f"| {r['structure']} | {r['context']} | {r['topk']} | {r['weight_share']:.3f} | "
                     f"{r['rel_error']:.2e} |")
    p = res["prefill"]
    lines += ["", f"Prefill of {p['tokens']} tokens, each query's top {p['topk']} keys among those before it "
              f"(GQA {p['heads'][0]}/{p['heads'][1]}, D {p['head_dim']}): sparse runs `{p['kernel']}`.", "",
              "| contender | seconds | peak memory of the call | peak / (inputs + output) |", "|---|---:|---:|---:|"]
    for name, key in (("attnkit sparse (top-k & causal)", "sparse"), ("SDPA causal (dense)", "sdpa")):
        secs = p["sparse_s" if key == "sparse" else "sdpa causal_s"]
        peak = p.get(f"{key}_peak_mb")
        over = p.get(f"{key}_peak_over_io")
        lines.append(f"| {name} | {secs:.3f} | {'n/a' if peak is None else f'{peak:.0f} MB'} | "
                     f"{'n/a' if over is None else f'{over:.2f}'} |")
    lines += ["", f"SDPA causal / sparse: {p['sdpa_over_sparse']:.2f}x (above 1: sparse is faster)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--peak-child":
        _peak_child(sys.argv[2], json.loads(sys.argv[3]))
        sys.exit(0)
    sys.exit(bench_main(sys.argv[1:], __doc__, "sparse", run, to_markdown))
