"""attnkit ``Decoder.generate`` against llama.cpp (the ``llama-cpp-python`` package) on one model.

Model: a random-weight Llama built with transformers from a seeded config (hidden 1024, 8 layers,
16 query heads, 4 KV heads, intermediate 2816, vocab 32000, untied head, ``initializer_range``
0.1 so that greedy choices are decisive), saved with ``save_pretrained`` and loaded by
:meth:`attnkit.models.Decoder.from_pretrained`, and written as GGUF F32 and F16 with the same
weights (tensor names and the q/k row permutation of llama.cpp's ``convert_hf_to_gguf.py``; a
generated SentencePiece-style vocabulary of control, byte and filler tokens: both sides are fed
token ids, never text).

Equality, before any timing: the logits of a prompt of ids from attnkit fp32 and from llama.cpp
on the F32 file (F32 K/V, so that both hold the model in fp32) are held to the tolerance rule R
against the fp64 model (``E <= 2 * E(transformers fp32) + floor``), and greedy generations from
the same prompt are compared token by token.

Timed settings, batch 1, greedy, every contender in one process, interleaved (alternating order):

- weights fp32 (attnkit fp32, GGUF F32) and 16-bit (attnkit bf16, GGUF F16);
- K/V 16-bit (llama.cpp f16; attnkit keeps K/V in the model's dtype, so fp32 beside fp32 weights)
  and 8-bit (llama.cpp ``q8_0``, which needs flash attention; attnkit ``kv_dtype="int8"``);
- llama.cpp with flash attention on and off (off only with f16 K/V), attnkit eager (the default
  dynamic cache) and ``compile=True`` (static cache; its compilation is done before timing);
- contexts prompt + new tokens of 512 + 128 and 8192 + 64.

Decode tokens/s excludes the prompt: (new - 1) tokens over the time after the first new token
(attnkit's ``Generation.decode_seconds``; the same split around llama.cpp's ``eval`` calls).
Prompt tokens/s: prompt tokens over the time to the first new token. Roofline share: the weight
bytes one decode step reads (every weight but the embedding table, of which one row) times decode
tokens/s over the read bandwidth of a plain sum over a 1 GiB fp32 buffer, timed in the same
interleaved repetitions. Each attnkit ratio is against the faster llama.cpp setting of its row.

    python benchmarks/bench_llamacpp.py           # full: both contexts, every setting
    python benchmarks/bench_llamacpp.py --quick   # tiny model, one setting, under a minute

Needs ``pip install 'attnkit[llamacpp]'`` (llama-cpp-python, built from source by pip, and gguf)
and transformers; without them the script says so and skips (``--quick`` exits 0).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import RESULTS, _installed, machine, read_probe, skip
from attnkit._sysinfo import cpu_flags

#: (hidden, layers, heads, KV heads, intermediate, vocab); --quick: a tiny one.
SHAPE, SHAPE_QUICK = (1024, 8, 16, 4, 2816, 32000), (256, 2, 4, 2, 688, 4096)
#: (prompt, new tokens, repetitions): the long rows run once each (a prefill of 8k tokens takes
#: most of a minute per contender on a small CPU); their decode rate is still a mean over 63 steps.
CONTEXTS, CONTEXTS_QUICK = ((512, 128, 3), (8192, 64, 1)), ((32, 16, 2),)
#: New tokens of the warm-up call each contender makes before the short rows' timing.
WARMUP_NEW = 8
#: Positions the model and llama.cpp's context allow (the long rows need 8256).
MAX_POSITIONS = 8192 + 256
READ_BYTES, READ_BYTES_QUICK = 1 << 30, 1 << 26
EQ_PROMPT, EQ_NEW = 32, 32
#: ggml_type values for llama.cpp's K/V cache.
GGML_F32, GGML_F16, GGML_Q8_0 = 0, 1, 8
#: The generated vocabulary: <unk>, <s>, </s>, then the 256 byte tokens, then filler.
N_CONTROL = 3
FIRST_ID = N_CONTROL + 256
#: CPU feature flags named in the table (those present).
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "avx_vnni", "amx_bf16", "amx_int8")

NEEDS = "pip install 'attnkit[llamacpp]' (llama-cpp-python, built from source by pip, and gguf) and transformers"


def missing() -> list[str]:
    return [m for m in ("llama_cpp", "gguf", "transformers") if not _installed(m)]


# ------------------------------------------------------------------------------------ model


def build_hf(shape):
    import transformers
    hidden, layers, heads, kv_heads, inter, vocab = shape
    cfg = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                                   max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
                                   initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """q/k rows from Hugging Face's rotate-half RoPE layout to llama.cpp's adjacent pairs (what
    ``convert_hf_to_gguf.py`` does for Llama: each head's two halves interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf, path: Path, f16: bool) -> None:
    """The Hugging Face model as a GGUF file: F32, or F16 for every 2-D weight (norms stay F32)."""
    import gguf
    import numpy as np
    c = hf.config
    head_dim = c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("attnkit-bench-random-llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
             [f"\u2581t{i}" for i in range(c.vocab_size - FIRST_ID)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + \
            [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (c.vocab_size - FIRST_ID)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * N_CONTROL + [0.0] * 256 + [-float(i) for i in range(c.vocab_size - FIRST_ID)])
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    sd = hf.state_dict()

    def put(name: str, t: torch.Tensor) -> None:
        a = t.detach().to(torch.float32).contiguous().numpy()
        w.add_tensor(name, a.astype(np.float16) if f16 and a.ndim == 2 else a)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(f"blk.{i}.attn_q.weight", permute_rope(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        put(f"blk.{i}.attn_k.weight", permute_rope(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    put("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def step_elements(hf) -> int:
    """Weights one decode step reads, in elements: every parameter but the embedding table, of
    which it reads one row (the untied head counts whole)."""
    emb = hf.get_input_embeddings().weight
    return sum(p.shape[1] if p is emb else p.numel() for p in {id(p): p for p in hf.parameters()}.values())


# ------------------------------------------------------------------------------- contenders


def open_llama(path: Path, n_ctx: int, *, flash: bool, kv: int, threads: int, logits_all: bool = False):
    from llama_cpp import Llama
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                 n_threads_batch=threads, flash_attn=flash, type_k=kv, type_v=kv, logits_all=logits_all,
                 n_gpu_layers=0, verbose=False, seed=0)


def llama_argmax(llm) -> int:
    import numpy as np
    return int(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),)).argmax())


def llama_generate(llm, prompt: list[int], new: int) -> tuple[float, float, list[int]]:
    """Greedy generation through ``Llama.eval``: (prompt seconds incl. the first token, seconds of
    the other ``new - 1`` tokens, the tokens)."""
    t0 = time.perf_counter()
    llm.reset()
    llm.eval(prompt)
    tok = llama_argmax(llm)
    t1 = time.perf_counter()
    out = [tok]
    for _ in range(new - 1):
        llm.eval([tok])
        tok = llama_argmax(llm)
        out.append(tok)
    return t1 - t0, time.perf_counter() - t1, out


def attnkit_generate(model, prompt: list[int], new: int, **kw) -> tuple[float, float, list[int]]:
    g = model.generate([prompt], new, **kw)
    return g.prefill_seconds, g.decode_seconds, g.tokens[0]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --------------------------------------------------------------------------------- equality


def check_equal(hf, ours, gguf_f32: Path, threads: int) -> dict:
    """Rule R on the prompt's logits (fp64 gold, transformers fp32 as base) for attnkit fp32 and
    llama.cpp F32 (F32 K/V, flash attention off), and greedy tokens of both."""
    import copy
    V = hf.config.vocab_size
    prompt = torch.randint(FIRST_ID, V, (EQ_PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        gold = copy.deepcopy(hf).to(torch.float64)(ids).logits[0]
        base = hf(ids).logits[0].double()
        mine = ours(ids)[0].double()
    llm = open_llama(gguf_f32, EQ_PROMPT + EQ_NEW + 8, flash=False, kv=GGML_F32, threads=threads, logits_all=True)
    llm.eval(prompt)
    theirs = torch.from_numpy(llm.scores[:EQ_PROMPT].copy()).double()
    _, _, llama_tokens = llama_generate(llm, prompt, EQ_NEW)
    del llm
    # The benchmark's own llama.cpp setting (f16 K/V, flash attention on) on the same prompt.
    llm = open_llama(gguf_f32, EQ_PROMPT + EQ_NEW + 8, flash=True, kv=GGML_F16, threads=threads, logits_all=True)
    llm.eval(prompt)
    theirs_f16kv = torch.from_numpy(llm.scores[:EQ_PROMPT].copy()).double()
    _, _, llama_tokens_f16kv = llama_generate(llm, prompt, EQ_NEW)
    del llm
    ours_tokens = ours.generate([prompt], EQ_NEW).tokens[0]
    floor = 2 * ((gold.float() + 0.3 - 0.3).double() - gold).abs().max().item()
    err = {name: (x - gold).abs().max().item() for name, x in
           (("transformers_fp32", base), ("attnkit_fp32", mine), ("llamacpp_f32", theirs),
            ("llamacpp_f32_f16kv", theirs_f16kv))}
    bound = 2 * err["transformers_fp32"] + floor
    return {"prompt_tokens": EQ_PROMPT, "new_tokens": EQ_NEW, "max_abs_logit": gold.abs().max().item(),
            "max_abs_error": err, "floor": floor, "bound": bound,
            "attnkit_passes_r": err["attnkit_fp32"] <= bound, "llamacpp_passes_r": err["llamacpp_f32"] <= bound,
            "attnkit_vs_llamacpp_max_abs": (mine - theirs).abs().max().item(),
            "tokens_attnkit": ours_tokens, "tokens_llamacpp": llama_tokens,
            "tokens_identical": ours_tokens == llama_tokens,
            "tokens_identical_llamacpp_f16kv_flash": ours_tokens == llama_tokens_f16kv}


# ---------------------------------------------------------------------------------- timing


def measure(contenders: dict, probe, reps: int) -> dict:
    """Each contender's (prompt s, decode s, tokens) per repetition, interleaved in alternating
    order, with one read-bandwidth sample per repetition."""
    out: dict = {name: {"prompt_s": [], "decode_s": [], "tokens": None} for name in contenders}
    read_s = []
    names = list(contenders)
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            p, d, toks = contenders[name]()
            out[name]["prompt_s"].append(p)
            out[name]["decode_s"].append(d)
            out[name]["tokens"] = toks
            print(f"    {name}: prompt {p:.2f} s, decode {d:.2f} s", flush=True)
        t0 = time.perf_counter()
        probe()
        read_s.append(time.perf_counter() - t0)
    out["_read_s"] = read_s
    return out


def run(quick: bool, on_row=None) -> dict:
    """The equality check and every row; ``on_row`` gets the result so far after each row."""
    threads = torch.get_num_threads()
    shape = SHAPE_QUICK if quick else SHAPE
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    from attnkit.models import Decoder
    with tempfile.TemporaryDirectory(prefix="attnkit-llamacpp-") as tmp:
        tmp = Path(tmp)
        hf = build_hf(shape)
        hf.save_pretrained(tmp / "hf")
        ggufs = {"fp32": tmp / "model-f32.gguf", "16-bit": tmp / "model-f16.gguf"}
        write_gguf(hf, ggufs["fp32"], f16=False)
        write_gguf(hf, ggufs["16-bit"], f16=True)
        models = {"fp32": Decoder.from_pretrained(tmp / "hf", dtype=torch.float32)}
        print("checking equality ...", flush=True)
        equality = check_equal(hf, models["fp32"], ggufs["fp32"], threads)

        def result(rows: list) -> dict:
            import llama_cpp
            hidden, layers, heads, kv_heads, inter, vocab = shape
            return {"machine": {**machine(), "cpu_flags": [f for f in FLAGS if f in cpu_flags()],
                                "llama_cpp_python": llama_cpp.__version__, "llama_threads": threads},
                    "quick": quick, "load_average_before": list(load_before),
                    "load_average_after": list(os.getloadavg()), "wall_s": time.perf_counter() - t_start,
                    "read_bytes": READ_BYTES_QUICK if quick else READ_BYTES,
                    "config": {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
                               "intermediate": inter, "vocab": vocab, "tied": False, "init_std": 0.1},
                    "equality": equality, "rows": list(rows)}

        print(json.dumps({k: v for k, v in equality.items() if not k.startswith("tokens_") or k.startswith(
            "tokens_identical")}, indent=1), flush=True)
        print(f"  attnkit   tokens: {equality['tokens_attnkit']}\n  llama.cpp tokens: {equality['tokens_llamacpp']}")
        elements = step_elements(hf)
        del hf
        gc.collect()
        if not quick:
            models["16-bit"] = Decoder.from_pretrained(tmp / "hf", dtype=torch.bfloat16)
        weight_bytes = {k: elements * m.dtype.itemsize for k, m in models.items()}
        probe = read_probe(READ_BYTES_QUICK if quick else READ_BYTES)
        probe()
        rows = []
        contexts = CONTEXTS_QUICK if quick else CONTEXTS
        for P, T, reps in contexts:
            prompt = torch.randint(FIRST_ID, shape[5], (P,), generator=torch.Generator().manual_seed(P)).tolist()
            n_ctx = P + T + 8
            for wname, model in models.items():
                for kvname in (("16-bit",) if quick else ("16-bit", "8-bit")):
                    print(f"context {P} + {T}, weights {wname}, K/V {kvname}", flush=True)
                    kv_llama = GGML_F16 if kvname == "16-bit" else GGML_Q8_0
                    kv_ours = None if kvname == "16-bit" else "int8"
                    llamas = {"llamacpp_fa_on": open_llama(ggufs[wname], n_ctx, flash=True, kv=kv_llama, threads=threads)}
                    if kvname == "16-bit" and not quick:  # quantized V needs flash attention
                        llamas["llamacpp_fa_off"] = open_llama(ggufs[wname], n_ctx, flash=False, kv=kv_llama,
                                                               threads=threads)
                    contenders = {name: (lambda n=T, llm=llm: llama_generate(llm, prompt, n))
                                  for name, llm in llamas.items()}
                    contenders["attnkit_eager"] = lambda n=T, m=model: attnkit_generate(m, prompt, n, kv_dtype=kv_ours)
                    if P <= 512:  # warm-up: first calls allocate buffers and load kernels
                        for fn in contenders.values():
                            fn(WARMUP_NEW)
                    compile_s = None
                    if not quick:
                        # The first call compiles the decode step for this batch and capacity
                        # (P + T rounded up), so it takes the row's own P and T.
                        t0 = time.perf_counter()
                        attnkit_generate(model, prompt, T, cache="static", compile=True, kv_dtype=kv_ours)
                        compile_s = time.perf_counter() - t0
                        contenders["attnkit_compiled"] = lambda m=model: attnkit_generate(
                            m, prompt, T, cache="static", compile=True, kv_dtype=kv_ours)
                    res = measure(contenders, probe, reps)
                    read_s = res.pop("_read_s")
                    bw = (READ_BYTES_QUICK if quick else READ_BYTES) / statistics.median(read_s)
                    row = {"prompt": P, "new_tokens": T, "weights": wname, "kv": kvname, "repetitions": reps,
                           "weight_bytes": weight_bytes[wname], "read_gb_s": bw / 1e9,
                           "roofline_tok_s": bw / weight_bytes[wname], "attnkit_compile_s": compile_s,
                           "llamacpp_kv": {GGML_F16: "f16", GGML_Q8_0: "q8_0"}[kv_llama],
                           "attnkit_kv": kv_ours or str(model.dtype).removeprefix("torch.")}
                    for name, r in res.items():
                        row[name] = {"prompt_tok_s": statistics.median(P / s for s in r["prompt_s"]),
                                     "decode_tok_s": statistics.median((T - 1) / s for s in r["decode_s"]),
                                     "decode_tok_s_all": [(T - 1) / s for s in r["decode_s"]],
                                     "prompt_tok_s_all": [P / s for s in r["prompt_s"]]}
                        row[name]["roofline_share"] = row[name]["decode_tok_s"] / row["roofline_tok_s"]
                    llama_names = [n for n in res if n.startswith("llamacpp")]
                    best_d = max(llama_names, key=lambda n: row[n]["decode_tok_s"])
                    best_p = max(llama_names, key=lambda n: row[n]["prompt_tok_s"])
                    row["llamacpp_best_decode"], row["llamacpp_best_prompt"] = best_d, best_p
                    for name in res:
                        if name.startswith("attnkit"):
                            row[name]["decode_ratio"] = row[name]["decode_tok_s"] / row[best_d]["decode_tok_s"]
                            row[name]["prompt_ratio"] = row[name]["prompt_tok_s"] / row[best_p]["prompt_tok_s"]
                            row[name]["first_token_difference_vs_llamacpp"] = first_difference(
                                res[name]["tokens"], res["llamacpp_fa_on"]["tokens"])
                    rows.append(row)
                    if on_row is not None:
                        on_row(result(rows))
                    for llm in llamas.values():
                        llm.close()
                    del llamas, contenders
                    gc.collect()
        del models, probe
    return result(rows)


# -------------------------------------------------------------------------------- the table


def to_markdown(res: dict) -> str:
    m, c, eq = res["machine"], res["config"], res["equality"]
    bws = [r["read_gb_s"] for r in res["rows"]]
    e = eq["max_abs_error"]
    lines = [
        f"Machine: {m['cpu']} ({m['isa']}; flags {', '.join(m['cpu_flags'])}), {m['cores']} cores; "
        f"{m['llama_threads']} threads for llama.cpp and torch. torch {m['torch']}, attnkit {m['attnkit']}, "
        f"llama-cpp-python {m['llama_cpp_python']} (built from source by pip). "
        f"Load average (1, 5, 15 min) before: {', '.join(f'{x:.1f}' for x in res['load_average_before'])}; "
        f"after: {', '.join(f'{x:.1f}' for x in res['load_average_after'])}.",
        "",
        f"Model: random-weight Llama, hidden {c['hidden']}, {c['layers']} layers, {c['heads']} heads, "
        f"{c['kv_heads']} KV heads, intermediate {c['intermediate']}, vocab {c['vocab']}, untied head; "
        "one transformers checkpoint loaded by `Decoder.from_pretrained` (fp32 or bf16) and the same weights "
        "as GGUF F32 and F16. Batch 1, greedy.",
        "",
        f"Equality (prompt of {eq['prompt_tokens']} ids; max |logit| {eq['max_abs_logit']:.2f}): max |error| "
        f"against the fp64 model: transformers fp32 {e['transformers_fp32']:.2e}, attnkit fp32 "
        f"{e['attnkit_fp32']:.2e}, llama.cpp F32 (F32 K/V) {e['llamacpp_f32']:.2e}; rule R bound "
        f"{eq['bound']:.2e}: attnkit {'passes' if eq['attnkit_passes_r'] else 'FAILS'}, llama.cpp "
        f"{'passes' if eq['llamacpp_passes_r'] else 'FAILS'}. llama.cpp F32 with its default f16 K/V and flash "
        f"attention: {e['llamacpp_f32_f16kv']:.2e}. Greedy, {eq['new_tokens']} new tokens: attnkit fp32 and "
        f"llama.cpp F32 {'identical' if eq['tokens_identical'] else 'DIFFERENT'} "
        f"({'identical' if eq['tokens_identical_llamacpp_f16kv_flash'] else 'different'} with llama.cpp's f16 "
        "K/V and flash attention).",
        "",
        "Decode tokens/s (prompt excluded; in parentheses the share of the weight-streaming roofline: weight "
        "bytes per step x tokens/s / the read bandwidth of a plain fp32 sum over "
        f"{res['read_bytes'] / 2**20:.0f} MiB in the same repetitions, "
        f"{min(bws):.1f}-{max(bws):.1f} GB/s over the rows). Ratios: attnkit / the faster llama.cpp setting "
        "of the row (FA = flash attention). K/V: llama.cpp / attnkit. Medians of the repetitions. A row's read "
        "bandwidth well below the others' means the machine was busy with other work during that row.",
        "",
        "| context | weights | K/V | llama.cpp FA on | llama.cpp FA off | attnkit eager | attnkit `compile=True` | "
        "eager / llama.cpp | compiled / llama.cpp | reps | read GB/s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(r, name, key="decode_tok_s", share=True):
        if name not in r:
            return "-"
        s = f"{r[name][key]:.1f}"
        return s + (f" ({100 * r[name]['roofline_share']:.0f}%)" if share else "")

    def ratio(r, name, key):
        return f"{r[name][key]:.2f}x" if name in r else "-"

    def ident(r):
        return f"{r['prompt']} + {r['new_tokens']}", r["weights"], f"{r['llamacpp_kv']} / {r['attnkit_kv']}"

    for r in res["rows"]:
        lines.append("| " + " | ".join([*ident(r), cell(r, "llamacpp_fa_on"), cell(r, "llamacpp_fa_off"),
                                         cell(r, "attnkit_eager"), cell(r, "attnkit_compiled"),
                                         ratio(r, "attnkit_eager", "decode_ratio"),
                                         ratio(r, "attnkit_compiled", "decode_ratio"), str(r["repetitions"]),
                                         f"{r['read_gb_s']:.1f}"]) + " |")
    lines += ["", "Prompt tokens/s (to the first new token; `compile=True` compiles only the decode step, so its "
              "prompt runs eagerly over a static cache).", "",
              "| context | weights | K/V | llama.cpp FA on | llama.cpp FA off | attnkit eager | "
              "attnkit `compile=True` | eager / llama.cpp | compiled / llama.cpp |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append("| " + " | ".join([*ident(r), *(cell(r, n, "prompt_tok_s", False) for n in
                                                      ("llamacpp_fa_on", "llamacpp_fa_off", "attnkit_eager",
                                                       "attnkit_compiled")),
                                         ratio(r, "attnkit_eager", "prompt_ratio"),
                                         ratio(r, "attnkit_compiled", "prompt_ratio")]) + " |")
    lines += ["", "Greedy tokens of each timed row against llama.cpp with flash attention on (the weights and "
              "K/V are stored differently, so a late divergence is expected): first differing step, "
              "eager / compiled: " + "; ".join(
                  f"{r['prompt']}+{r['new_tokens']} {r['weights']} {r['kv']}: "
                  + " / ".join(str(r[n]['first_token_difference_vs_llamacpp'] if r[n]['first_token_difference_vs_llamacpp']
                                   is not None else "none") for n in ("attnkit_eager", "attnkit_compiled") if n in r)
                  for r in res["rows"]) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, one setting, for a smoke test")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the tables (default: benchmarks/results)")
    args = p.parse_args(argv)
    lacking = missing()
    if lacking:
        reason = f"needs {', '.join(lacking)}: {NEEDS}"
        if args.quick and not os.environ.get("ATTNKIT_BENCH_SKIP_FILE"):
            print(f"skipped: {reason}", flush=True)
            return 0
        skip(reason)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "llamacpp_quick" if args.quick else "llamacpp"

    def write(res: dict) -> str:  # after every row, so a long run leaves its table so far
        md = to_markdown(res)
        (args.out / f"{stem}.json").write_text(json.dumps(res, indent=2))
        (args.out / f"{stem}.md").write_text(md)
        return md

    print(write(run(args.quick, on_row=write)))
    print(f"wrote {args.out / (stem + '.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
