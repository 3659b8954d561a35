"""attnkit ``Decoder.generate`` against Hugging Face ``LlamaForCausalLM.generate``, same weights.

Config (the issue's): hidden 512, 4 layers, 8 heads, 2 KV heads, intermediate 1376, vocab
4096, fp32; prompts of 32 tokens, 128 new tokens, greedy, batch 1 and batch 8. Contenders run
interleaved (alternating order) in one process; the table gives medians of end-to-end tokens/s
(B x new tokens / wall time of the whole call, prefill included) and whether each produced
exactly Hugging Face's tokens. The compiled static-cache decode step is timed after its
compilation, which is reported separately (with a warm inductor cache it is seconds; the first
compile on a machine takes longer). "Weights only" applies every weight matrix of the model to the
batch once per token and nothing else: the memory traffic any fp32 implementation pays per decode
step, so an upper bound on tokens/s (batch-1 decoding on a CPU is bound by it).

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
EAGER = ("attnkit_dynamic", "attnkit_static")


def build():
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                   num_key_value_heads=KV_HEADS, intermediate_size=INTER, vocab_size=VOCAB,
                                   initializer_range=0.1)  # decisive logits: greedy ties are unlikely
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.generation_config.eos_token_id = None  # always generate every token
    hf.generation_config.pad_token_id = 0
    ours = Decoder(config_from_hf(cfg), init_std=None).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def run(quick: bool) -> dict:
    require("transformers", "'attnkit[bench]'")
    new, reps = (16, 2) if quick else (128, 5)
    hf, ours = build()
    rows = []
    for B in (1, 8):
        g = torch.Generator().manual_seed(B)
        ids = torch.randint(0, VOCAB, (B, PROMPT), generator=g)
        outs: dict[str, list] = {}

        def hf_run():
            with torch.inference_mode():
                t0 = time.perf_counter()
                o = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                min_new_tokens=new, do_sample=False)
                dt = time.perf_counter() - t0
            outs["hf"] = o[:, PROMPT:].tolist()
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
        row = {"batch": B, "prompt": PROMPT, "new_tokens": new}
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
    return {"machine": machine(), "quick": quick,
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
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """``--quick`` / ``--out``: run, print, write ``generate[_quick].{md,json,png}``."""
    return bench_main(argv, __doc__, "generate", run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
