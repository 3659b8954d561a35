"""A Hugging Face transformers model generating with attn_implementation "attnkit" against
"sdpa" and "eager": same model object and weights, same machine, same run, interleaved.

Model: a random Llama (hidden 512, 4 layers, 8 heads, 2 KV heads (GQA 4), head dim 64,
intermediate 1376, vocab 4096), batch 1, greedy, long prompts (2k and 8k tokens; "eager" only up to
4k: it materializes (H, S, S) fp32 scores per layer), 32 new tokens. For each contender:
prefill = wall time from the ``generate`` call to the first step's logits; decode tokens/s =
(new - 1) / time from there to the last step's logits (one ``generate`` call gives both).
Medians of interleaved repetitions (alternating order). ✓: the contender produced exactly the
"sdpa" run's tokens.

    python benchmarks/bench_integration.py           # full: 2k and 8k prompts, fp32 and bf16
    python benchmarks/bench_integration.py --quick   # a tiny model and prompt: seconds
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from _common import bench_main, interleaved_medians, machine, require

FULL = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            intermediate_size=1376, vocab_size=4096, max_position_embeddings=16384)
QUICK = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=256, max_position_embeddings=512)
CONTENDERS = ("attnkit", "sdpa", "eager")
EAGER_MAX_PROMPT = 4096  # beyond this, eager's (H, S, S) fp32 scores per layer take gigabytes


def build(cfg: dict, dtype: torch.dtype):
    import transformers
    import attnkit.integrations.transformers  # noqa: F401  (registers "attnkit")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, initializer_range=0.1)).eval()
    model.generation_config.eos_token_id = None  # always generate every token
    model.generation_config.pad_token_id = 0
    return model.to(dtype)


class _Stamps:
    """A logits processor that only notes when each step's logits arrive: the first after the
    prefill forward, then one per decode step."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def measure(model, ids: torch.Tensor, new: int, reps: int, contenders) -> tuple[dict, dict]:
    """Median prefill seconds and decode tokens/s per contender (from one generate call per
    repetition), and each one's tokens."""
    from transformers import LogitsProcessorList
    tokens: dict[str, list] = {}
    prefill: dict[str, list] = {c: [] for c in contenders}
    am = torch.ones_like(ids)

    def gen(impl: str):
        def run() -> float:
            model.set_attn_implementation(impl)
            stamps = _Stamps()
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = model.generate(ids, attention_mask=am, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                     logits_processor=LogitsProcessorList([stamps]))
            tokens[impl] = out[0, ids.shape[1]:].tolist()
            prefill[impl].append(stamps.times[0] - t0)
            return stamps.times[-1] - stamps.times[0]  # the new - 1 decode steps
        return run

    decode = interleaved_medians({impl: gen(impl) for impl in contenders}, reps=reps, warmup=1)
    stats = {impl: {"prefill_s": statistics.median(prefill[impl][1:] or prefill[impl]),
                    "decode_tok_s": (new - 1) / decode[impl]} for impl in contenders}
    return stats, tokens


def run(quick: bool) -> dict:
    require("transformers", "'attnkit[bench]'")
    cfg = QUICK if quick else FULL
    new, reps = (8, 2) if quick else (32, 3)
    cases = [("fp32", 64), ("bf16", 64)] if quick else [("fp32", 2048), ("fp32", 8192), ("bf16", 2048), ("bf16", 8192)]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = []
    for dname, prompt in cases:
        model = build(cfg, dtypes[dname])
        g = torch.Generator().manual_seed(prompt)
        ids = torch.randint(3, cfg["vocab_size"], (1, prompt), generator=g)
        contenders = [c for c in CONTENDERS if c != "eager" or prompt <= EAGER_MAX_PROMPT]
        print(f"   {dname} prompt {prompt}: {', '.join(contenders)}", file=sys.stderr, flush=True)
        stats, tokens = measure(model, ids, new, reps, contenders)
        row = {"dtype": dname, "batch": 1, "prompt": prompt, "new_tokens": new}
        for impl in CONTENDERS:
            st = stats.get(impl)
            row[f"{impl}_prefill_ms"] = None if st is None else 1e3 * st["prefill_s"]
            row[f"{impl}_decode_tok_s"] = None if st is None else st["decode_tok_s"]
            row[f"{impl}_matches_sdpa"] = None if st is None else tokens[impl] == tokens["sdpa"]
        row["decode_speedup_vs_sdpa"] = row["attnkit_decode_tok_s"] / row["sdpa_decode_tok_s"]
        row["prefill_speedup_vs_sdpa"] = row["sdpa_prefill_ms"] / row["attnkit_prefill_ms"]
        rows.append(row)
        del model
    import transformers
    return {"machine": machine(), "quick": quick, "transformers": transformers.__version__,
            "model": {"arch": "Llama (random weights)", "hidden": cfg["hidden_size"], "layers": cfg["num_hidden_layers"],
                      "heads": cfg["num_attention_heads"], "kv_heads": cfg["num_key_value_heads"],
                      "intermediate": cfg["intermediate_size"], "vocab": cfg["vocab_size"]},
            "rows": rows}


def to_markdown(res: dict) -> str:
    m = res["machine"]
    md = res["model"]
    lines = [f"Machine: {m['cpu']} ({m.get('isa', '?')}), {m['cores']} cores ({m['torch_threads']} torch threads), "
             f"torch {m['torch']}, transformers {res['transformers']}, attnkit {m['attnkit']}"
             f"{' (--quick: tiny sizes, a smoke test)' if res['quick'] else ''}. "
             f"{md['arch']}: hidden {md['hidden']}, {md['layers']} layers, {md['heads']} heads, "
             f"{md['kv_heads']} KV heads, intermediate {md['intermediate']}, vocab {md['vocab']}; batch 1, "
             "greedy. Prefill: generate() call to the first logits; decode: tokens/s of the remaining steps. Medians "
             "of interleaved runs. ✓ = the same tokens as \"sdpa\"; n/a = not run (eager above "
             f"{EAGER_MAX_PROMPT} tokens).", "",
             "| dtype | prompt | new | attnkit prefill ms | sdpa prefill ms | eager prefill ms | attnkit decode tok/s "
             "| sdpa decode tok/s | eager decode tok/s | decode attnkit / sdpa | prefill attnkit / sdpa |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(r, impl, key, fmt):
        v = r[f"{impl}_{key}"]
        if v is None:
            return "n/a"
        ok = "" if impl == "sdpa" or key != "decode_tok_s" else (" ✓" if r[f"{impl}_matches_sdpa"] else " ✗")
        return fmt.format(v) + ok

    for r in res["rows"]:
        lines.append(f"| {r['dtype']} | {r['prompt']} | {r['new_tokens']} | "
                     + " | ".join(cell(r, i, "prefill_ms", "{:.0f}") for i in CONTENDERS) + " | "
                     + " | ".join(cell(r, i, "decode_tok_s", "{:.1f}") for i in CONTENDERS)
                     + f" | {r['decode_speedup_vs_sdpa']:.2f}x | {r['prefill_speedup_vs_sdpa']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return bench_main(argv, __doc__, "integration", run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
