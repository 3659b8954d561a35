"""attnkit ``Decoder.generate`` against Hugging Face ``LlamaForCausalLM.generate``, same weights.

Config (the issue's): hidden 512, 4 layers, 8 heads, 2 KV heads, intermediate 1376, vocab
4096, fp32; prompts of 32 tokens, 128 new tokens, greedy, batch 1 and batch 8, and (full run) a
batch-1 prompt of 1920 tokens, where each step reads a long cache as well. Contenders run
interleaved (alternating order) in one process; the table gives medians of end-to-end tokens/s
(B x new tokens / wall time of the whole call, prefill included) and whether each produced
exactly Hugging Face's tokens. The compiled static-cache decode step is timed after its
compilation, which is reported separately (with a warm inductor cache it is seconds; the first
compile on a machine takes longer). "Weights only" applies every weight matrix of the model to the
batch once per token and nothing else: the memory traffic any fp32 implementation pays per decode
step, so an upper bound on tokens/s (batch-1 decoding on a CPU is bound by it).

Roofline (a Llama of hidden 1024, 8 layers, 16 heads, 4 KV heads, intermediate 2816,
vocab 32000), batch 1, fp32 and bf16: the steady decode rate, (N - 1) tokens over the time a
generation of N tokens takes beyond one of a single token (prefill cancels), for attnkit and
Hugging Face side by side, against the weight-streaming roofline: the bytes of the weights a step
reads (every Linear and norm; one embedding row) over the read bandwidth of a plain sum over a
buffer that size, measured in the same interleaved runs.

    python benchmarks/bench_generate.py           # full: 128 new tokens, 5 repetitions, compile
    python benchmarks/bench_generate.py --quick   # 16 new tokens, 2 repetitions, no compile
"""

from __future__ import annotations

import sys
import time

import torch

from _common import bench_main, interleaved_medians, machine, require
from attnkit.models import Decoder, config_from_hf

HIDDEN, LAYERS, HEADS, KV_HEADS, INTER, VOCAB, PROMPT = 512, 4, 8, 2, 1376, 4096, 32
#: The long row's prompt: with the new tokens, the model's 2048 positions.
LONG_PROMPT = 1920
EAGER = ("attnkit_dynamic", "attnkit_static")


#: The roofline rows' model (hidden, layers, heads, KV heads, intermediate, vocab); --quick: tiny.
ROOF, ROOF_QUICK = (1024, 8, 16, 4, 2816, 32000), (256, 2, 4, 2, 688, 4096)


def build(shape=(HIDDEN, LAYERS, HEADS, KV_HEADS, INTER, VOCAB), dtype=torch.float32):
    import transformers
    hidden, layers, heads, kv_heads, inter, vocab = shape
    cfg = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                                   initializer_range=0.1)  # decisive logits: greedy ties are unlikely
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval().to(dtype)
    hf.generation_config.eos_token_id = None  # always generate every token
    hf.generation_config.pad_token_id = 0
    ours = Decoder(config_from_hf(cfg), init_std=None).eval().to(dtype)
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def step_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter but the embedding table, of
    which it reads one row (an untied head counts whole, as a Linear)."""
    emb = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    total = 0
    for p in {id(p): p for p in model.parameters()}.values():
        total += p.shape[1] * p.element_size() if p is emb else p.numel() * p.element_size()
    return total


def roofline(quick: bool) -> list[dict]:
    """Batch-1 steady decode tokens/s of attnkit and Hugging Face against bytes / read bandwidth."""
    new, reps = (8, 2) if quick else (64, 3)
    rows = []
    for dname, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        hf, ours = build(ROOF_QUICK if quick else ROOF, dt)
        ids = torch.randint(0, hf.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
        nbytes = step_bytes(hf)
        probe = torch.ones(nbytes // 4)

        def hf_gen(n):
            def fn():
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False)
                    return time.perf_counter() - t0
            return fn

        def ours_gen(n):
            def fn():
                t0 = time.perf_counter()
                ours.generate(ids, n, cache="dynamic")
                return time.perf_counter() - t0
            return fn

        def read():
            t0 = time.perf_counter()
            probe.sum()
            return time.perf_counter() - t0

        secs = interleaved_medians({"hf_n": hf_gen(new), "hf_1": hf_gen(1), "ours_n": ours_gen(new),
                                    "ours_1": ours_gen(1), "read": read}, reps, warmup=1)
        bw = nbytes / secs["read"]
        roof = bw / nbytes
        row = {"dtype": dname, "weights_mb": nbytes / 2**20, "read_gb_s": bw / 1e9, "roofline_tok_s": roof,
               "new_tokens": new}
        for name in ("hf", "ours"):
            row[f"{name}_tok_s"] = (new - 1) / max(1e-9, secs[f"{name}_n"] - secs[f"{name}_1"])
            row[f"{name}_share"] = row[f"{name}_tok_s"] / roof
        rows.append(row)
        del hf, ours, probe
    return rows


def run(quick: bool) -> dict:
    require("transformers", "'attnkit[bench]'")
    new, reps = (16, 2) if quick else (128, 5)
    hf, ours = build()
    rows = []
    for B, P in [(1, PROMPT), (8, PROMPT)] + ([] if quick else [(1, LONG_PROMPT)]):
        g = torch.Generator().manual_seed(B)
        ids = torch.randint(0, VOCAB, (B, P), generator=g)
        outs: dict[str, list] = {}

        def hf_run():
            with torch.inference_mode():
                t0 = time.perf_counter()
                o = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                min_new_tokens=new, do_sample=False)
                dt = time.perf_counter() - t0
            outs["hf"] = o[:, P:].tolist()
            return dt

        def ours_run(name, **kw):
            def fn():
                t0 = time.perf_counter()
                res = ours.generate(ids, new, **kw)
                dt = time.perf_counter() - t0
                outs[name] = res.tokens
                return dt
            return fn

        # The bound: every weight matrix applied to B rows once per token (what any fp32
        # implementation streams from memory each step), with nothing else.
        mats = [mod.weight for mod in ours.modules() if isinstance(mod, torch.nn.Linear)]
        inputs = {w.shape[1]: torch.randn(B, w.shape[1]) for w in mats}

        def floor_run():
            with torch.inference_mode():
                t0 = time.perf_counter()
                for _ in range(new):
                    for w in mats:
                        torch.nn.functional.linear(inputs[w.shape[1]], w)
                return time.perf_counter() - t0

        contenders = {"hf": hf_run, "attnkit_dynamic": ours_run("attnkit_dynamic", cache="dynamic"),
                      "attnkit_static": ours_run("attnkit_static", cache="static"), "floor": floor_run}
        compile_s = None
        if not quick:
            t0 = time.perf_counter()
            ours.generate(ids, new, cache="static", compile=True)  # compiles the decode step
            compile_s = time.perf_counter() - t0
            contenders["attnkit_compiled"] = ours_run("attnkit_compiled", cache="static", compile=True)
        secs = interleaved_medians(contenders, reps, warmup=1)
        row = {"batch": B, "prompt": P, "new_tokens": new}
        for name, s in secs.items():
            row[f"{name}_tok_s"] = B * new / s
            if name not in ("hf", "floor"):
                row[f"{name}_matches_hf"] = outs[name] == outs["hf"]
        best = max(EAGER, key=lambda n: row[f"{n}_tok_s"])
        row["best_eager"] = best
        row["eager_speedup"] = row[f"{best}_tok_s"] / row["hf_tok_s"]
        if compile_s is not None:
            row["compile_s"] = compile_s
            row["compiled_speedup"] = row["attnkit_compiled_tok_s"] / row["hf_tok_s"]
        rows.append(row)
    return {"machine": machine(), "quick": quick, "roofline": roofline(quick),
            "roofline_config": dict(zip(("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"),
                                        ROOF_QUICK if quick else ROOF)),
            "config": {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS,
                       "intermediate": INTER, "vocab": VOCAB, "dtype": "fp32"},
            "rows": rows}


def to_markdown(res: dict) -> str:
    m = res["machine"]
    c = res["config"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), torch {m['torch']}, "
             f"attnkit {m['attnkit']}. Llama config: hidden {c['hidden']}, {c['layers']} layers, {c['heads']} heads, "
             f"{c['kv_heads']} KV heads, intermediate {c['intermediate']}, vocab {c['vocab']}, {c['dtype']}; greedy; "
             "end-to-end tokens/s (prefill included), medians of interleaved runs. "
             "✓ = same tokens as Hugging Face. Weights-only bound: the weight matrices alone, applied to the batch "
             "once per token (the memory traffic every fp32 implementation pays per step; no attention, no cache, "
             "no Python around it): an upper bound on decode tokens/s.", "",
             "| batch | prompt | new | HF generate tok/s | attnkit dynamic tok/s | attnkit static tok/s | "
             "attnkit compiled static tok/s | weights-only bound tok/s | eager speedup | compiled speedup | "
             "compile time s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(r, name):
        if f"{name}_tok_s" not in r:
            return "-"
        ok = " ✓" if r.get(f"{name}_matches_hf") else " ✗"
        return f"{r[f'{name}_tok_s']:.0f}{ok}"

    for r in res["rows"]:
        comp = f"{r['compiled_speedup']:.2f}x" if "compiled_speedup" in r else "-"
        cs = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
        lines.append(f"| {r['batch']} | {r['prompt']} | {r['new_tokens']} | {r['hf_tok_s']:.0f} | "
                     f"{cell(r, 'attnkit_dynamic')} | {cell(r, 'attnkit_static')} | {cell(r, 'attnkit_compiled')} | "
                     f"{r['floor_tok_s']:.0f} | {r['eager_speedup']:.2f}x | {comp} | {cs} |")
    if res.get("roofline"):
        rc = res["roofline_config"]
        lines += ["", f"Roofline: Llama hidden {rc['hidden']}, {rc['layers']} layers, {rc['heads']} heads, "
                  f"{rc['kv_heads']} KV heads, intermediate {rc['intermediate']}, vocab {rc['vocab']}; batch 1, "
                  f"prompt {PROMPT}; steady decode tokens/s = (N - 1) / (time of N new tokens - time of 1), "
                  f"N = {res['roofline'][0]['new_tokens']}; roofline = read bandwidth (a plain sum over a buffer "
                  "the size of the weights, same runs) / weight bytes per step.", "",
                  "| dtype | weights MiB | read GB/s | roofline tok/s | HF tok/s | HF share | attnkit tok/s | "
                  "attnkit share | attnkit / HF |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in res["roofline"]:
            lines.append(f"| {r['dtype']} | {r['weights_mb']:.0f} | {r['read_gb_s']:.1f} | {r['roofline_tok_s']:.1f} | "
                         f"{r['hf_tok_s']:.1f} | {100 * r['hf_share']:.0f}% | {r['ours_tok_s']:.1f} | "
                         f"{100 * r['ours_share']:.0f}% | {r['ours_tok_s'] / r['hf_tok_s']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """``--quick`` / ``--out``: run, print, write ``generate[_quick].{md,json,png}``."""
    return bench_main(argv, __doc__, "generate", run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
