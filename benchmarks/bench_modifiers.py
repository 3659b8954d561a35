"""Score modifiers (soft-capping, sinks, ALiBi) against the plain call on the same shapes, and
against transformers' eager code of the model layer that uses each (Gemma 2, gpt-oss, BLOOM),
side by side in one run.

Decode: one query per sequence over a 4k cache (B 1, 32 query / 8 KV heads, D 128), fp32 and
bf16: the modifiers run inside the split-K engine (fused: nothing is materialized), so the goal is
at most 15% over the plain call. Prefill: causal S 1024 (B 1, 8 / 8 heads, D 64): softcap goes to
the math backend (SDPA cannot express it), sinks to SDPA's CPU flash kernel (its log-sum-exp
carries them), ALiBi to SDPA with its bias materialized.

    python benchmarks/bench_modifiers.py            # the table -> benchmarks/results/modifiers.*
    python benchmarks/bench_modifiers.py --quick    # small sizes, seconds
"""

from __future__ import annotations

import sys
import types

import torch

import attnkit
from attnkit import masks as M
from _common import bench_main, interleaved_medians, machine, timed


def _hf_eager():
    """transformers' eager attention functions of the three families (None when not installed)."""
    try:
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss
    except ImportError:
        return None
    return {"softcap": gemma2, "sinks": gpt_oss}


def _contenders(q, k, v, causal: bool):
    Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[-1]
    sinks = torch.randn(Hq, generator=torch.Generator().manual_seed(0))
    alibi = M.ALiBi(M.alibi_slopes(Hq))
    scale = D ** -0.5
    hf = _hf_eager()
    mod = types.SimpleNamespace(num_key_value_groups=Hq // Hkv, training=False, sinks=sinks.to(q.dtype),
                                config=types.SimpleNamespace())
    Sq, Sk = q.shape[2], k.shape[2]
    hf_mask = None
    if causal and Sq > 1:
        hf_mask = torch.full((Sq, Sk), float("-inf"), dtype=q.dtype).triu(Sk - Sq + 1)[None, None]
    slopes = M.alibi_slopes(Hq).to(q.dtype)
    alibi_bias = slopes[None, :, None, None] * torch.arange(Sk, dtype=q.dtype)  # BLOOM's form
    rows = {
        "plain": {"attnkit": lambda: attnkit.attention(q, k, v, causal=causal)},
        "softcap 30": {"attnkit": lambda: attnkit.attention(q, k, v, causal=causal, softcap=30.0)},
        "sinks": {"attnkit": lambda: attnkit.attention(q, k, v, causal=causal, sinks=sinks)},
        "ALiBi": {"attnkit": lambda: attnkit.attention(q, k, v, alibi, causal=causal)},
    }
    if hf is not None:
        rows["softcap 30"]["hf_eager"] = lambda: hf["softcap"](mod, q, k, v, hf_mask, dropout=0.0, scaling=scale,
                                                              softcap=30.0)
        rows["sinks"]["hf_eager"] = lambda: hf["sinks"](mod, q, k, v, hf_mask, scaling=scale)

    def bloom_eager():  # BLOOM's attention math: baddbmm of the alibi, fp32 softmax, K/V per head
        G = Hq // Hkv
        kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        s = (q @ kk.transpose(-1, -2)) * scale + alibi_bias
        if hf_mask is not None:
            s = s + hf_mask
        return torch.softmax(s.float(), -1).to(q.dtype) @ vv

    rows["ALiBi"]["hf_eager"] = bloom_eager
    return rows


def run(quick: bool) -> dict:
    torch.manual_seed(0)
    out = []
    cases = [("decode", 1, 32, 8, 1, 1024 if quick else 4096, 128, True),
             ("prefill causal", 1, 8, 8, 256 if quick else 1024, 256 if quick else 1024, 64, True)]
    for case, B, Hq, Hkv, Sq, Sk, D, causal in cases:
        for dname, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            q = torch.randn(B, Hq, Sq, D, dtype=dt)
            k, v = (torch.randn(B, Hkv, Sk, D, dtype=dt) for _ in range(2))
            rows = _contenders(q, k, v, causal)
            # Two interleaved groups: attnkit's calls among themselves (the cost of a modifier is a
            # ratio of neighbours in the same conditions; a call right after a 30x slower eager one
            # would start with cold caches), then the eager peers against the same calls.
            ours_fns = {f"{name}|attnkit": timed(r["attnkit"]) for name, r in rows.items()}
            hf_fns = {f"{name}|{who}": timed(fn) for name, r in rows.items() for who, fn in r.items()
                      if "hf_eager" in r}
            reps = 3 if quick else (25 if case == "decode" else 5)
            with torch.inference_mode():
                t = interleaved_medians(ours_fns, reps, warmup=1)
                vs_hf = interleaved_medians(hf_fns, 3 if quick else 5, warmup=1)
            plain = t["plain|attnkit"]
            for name, r in rows.items():
                ours = t[f"{name}|attnkit"]
                row = {"case": case, "shape": f"B{B} Hq{Hq} Hkv{Hkv} Sq{Sq} Sk{Sk} D{D}", "dtype": dname,
                       "modifier": name, "attnkit_ms": ours * 1e3, "vs_plain": ours / plain}
                if "hf_eager" in r:
                    row["hf_eager_ms"] = vs_hf[f"{name}|hf_eager"] * 1e3
                    row["speedup_vs_hf_eager"] = vs_hf[f"{name}|hf_eager"] / vs_hf[f"{name}|attnkit"]
                out.append(row)
    return {"machine": machine(), "quick": quick, "rows": out}


def to_markdown(res: dict) -> str:
    m = res["machine"]
    lines = [
        f"Machine: {m['cpu']} ({m.get('isa', '?')}), {m['cores']} cores ({m['torch_threads']} torch threads), "
        f"torch {m['torch']}, attnkit {m['attnkit']}. Medians of interleaved runs. cost = attnkit time with the "
        "modifier / the plain call's time (1.00x: free), attnkit's calls interleaved among themselves; vs HF eager "
        "> 1: attnkit faster than transformers' eager code of the same layer (Gemma 2 for softcap, gpt-oss for "
        "sinks, BLOOM's alibi math for ALiBi), interleaved with attnkit's same call in a second group.",
        "",
        "| case | shape | dtype | modifier | attnkit ms | cost vs plain | HF eager ms | vs HF eager |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        hf = (f"{r['hf_eager_ms']:.2f} | {r['speedup_vs_hf_eager']:.2f}x" if "hf_eager_ms" in r else "- | -")
        lines.append(f"| {r['case']} | {r['shape']} | {r['dtype']} | {r['modifier']} | {r['attnkit_ms']:.2f} | "
                     f"{r['vs_plain']:.2f}x | {hf} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return bench_main(argv, __doc__, "modifiers", run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
