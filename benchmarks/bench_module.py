"""attnkit.MultiHeadAttention against Hugging Face LlamaAttention (eager and sdpa), same weights.

A Llama-shaped GQA layer (hidden 1024, 16 query heads, 4 KV heads, head_dim 64, RoPE):
prefill of S tokens, then a cached decode of 128 steps continuing it (HF's DynamicCache vs
attnkit's DynamicCache and StaticCache). Contenders run in alternating order; medians.

    python benchmarks/bench_module.py           # S=2048 prefill, then 128 decode steps
    python benchmarks/bench_module.py --quick   # small sizes, seconds
"""

from __future__ import annotations

import sys
import time

import torch

from _common import bench_main, interleaved_medians, machine, require, timed
from attnkit import DynamicCache, MultiHeadAttention, RotaryEmbedding, StaticCache


def build(impl: str, dtype):
    import transformers
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
    cfg = transformers.LlamaConfig(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                                   max_position_embeddings=8192)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    hf = LlamaAttention(cfg, layer_idx=0).eval().to(dtype)
    rope = LlamaRotaryEmbedding(cfg)
    ours = MultiHeadAttention(1024, 16, num_kv_heads=4, causal=True, rope=RotaryEmbedding.from_hf_config(cfg)).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return cfg, hf, rope, ours.to(dtype)


def hf_prefill(hf, rope, x):
    S = x.shape[1]
    pos = torch.arange(S)[None]
    return hf(x, position_embeddings=rope(x, pos), attention_mask=None, is_causal=True)[0]


def hf_decode(cfg, hf, rope, x, prompt, steps):
    import transformers
    cache = transformers.DynamicCache(config=cfg)
    hf(x[:, :prompt], position_embeddings=rope(x, torch.arange(prompt)[None]), cache=cache,
       attention_mask=None, is_causal=True)
    t0 = time.perf_counter()
    for t in range(prompt, prompt + steps):
        hf(x[:, t:t + 1], position_embeddings=rope(x, torch.tensor([[t]])), cache=cache, attention_mask=None)
    return (time.perf_counter() - t0) / steps


def ours_decode(ours, x, prompt, steps, cache):
    ours(x[:, :prompt], cache=cache)
    t0 = time.perf_counter()
    for t in range(prompt, prompt + steps):
        ours(x[:, t:t + 1], cache=cache)
    return (time.perf_counter() - t0) / steps


def run(quick: bool) -> dict:
    require("transformers", "'attnkit[bench]'")
    S, steps = (256, 16) if quick else (2048, 128)
    prompt = S  # decode continues the prefilled sequence
    rows = []
    for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        cfg, hf_eager, rope, ours = build("eager", dtype)
        _, hf_sdpa, _, _ = build("sdpa", dtype)
        hf_sdpa.load_state_dict(hf_eager.state_dict())
        x = torch.randn(1, max(S, prompt + steps), 1024, dtype=dtype)
        with torch.inference_mode():
            xp = x[:, :S]
            torch.testing.assert_close(ours(xp).float(), hf_prefill(hf_sdpa, rope, xp).float(),
                                       atol=1e-4 if dtype == torch.float32 else 5e-2, rtol=1e-3 if dtype == torch.float32 else 5e-2)
            # The close pair gets many interleaved repetitions; the far slower eager path a few.
            pre = interleaved_medians({
                "attnkit": timed(lambda: ours(xp)),
                "hf_sdpa": timed(lambda: hf_prefill(hf_sdpa, rope, xp)),
            }, 3 if quick else 15)
            pre.update(interleaved_medians({"hf_eager": timed(lambda: hf_prefill(hf_eager, rope, xp))}, 3))
            dec = interleaved_medians({
                "attnkit": lambda: ours_decode(ours, x, prompt, steps, DynamicCache(4, 64, dtype=dtype)),
                "attnkit_static": lambda: ours_decode(ours, x, prompt, steps,
                                                      StaticCache(4, 64, max_batch=1, max_len=prompt + steps, dtype=dtype)),
                "hf_sdpa": lambda: hf_decode(cfg, hf_sdpa, rope, x, prompt, steps),
                "hf_eager": lambda: hf_decode(cfg, hf_eager, rope, x, prompt, steps),
            }, 3)
        rows.append({"case": f"prefill S={S}", "dtype": dname, **{f"{k}_ms": v * 1e3 for k, v in pre.items()}})
        rows.append({"case": f"decode step ({prompt}-token prompt, {steps} steps)", "dtype": dname,
                     **{f"{k}_ms": v * 1e3 for k, v in dec.items()}})
    return {"machine": machine(), "quick": quick, "rows": rows}


def to_markdown(res: dict) -> str:
    m = res["machine"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, attnkit {m['attnkit']}. "
             "Llama-shaped GQA layer (hidden 1024, 16 q heads, 4 kv heads, head_dim 64, RoPE), B=1; "
             "medians of interleaved runs; ratio = HF time / attnkit time (> 1: attnkit faster).", "",
             "| case | dtype | attnkit ms | attnkit static-cache ms | HF sdpa ms | HF eager ms | vs HF sdpa | vs HF eager |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        st = f"{r['attnkit_static_ms']:.2f}" if "attnkit_static_ms" in r else "-"
        lines.append(f"| {r['case']} | {r['dtype']} | {r['attnkit_ms']:.2f} | {st} | {r['hf_sdpa_ms']:.2f} | "
                     f"{r['hf_eager_ms']:.2f} | {r['hf_sdpa_ms'] / r['attnkit_ms']:.2f}x | "
                     f"{r['hf_eager_ms'] / r['attnkit_ms']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return bench_main(argv, __doc__, "module", run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
