"""What a quantized KV cache (int8, fp8 e4m3; ``kv_dtype=``) does to trained models' outputs.

``bench_quantized.py`` measures the attention-output error on synthetic K/V. This suite asks the
question a user asks: does the model still answer the same? Three tables, all on models trained
here, in this process, from fixed seeds (nothing is downloaded):

1. **Recall of the demo's models.** ``attnkit demo``'s MHA / GQA / MQA / MLA decoders, trained as
   the demo trains them (:mod:`attnkit.demo`: same plan, seeds and data), and their recall on the
   demo's held-out associative-recall examples at the trained number of pairs and at twice as
   many, with the cache in the model's dtype, int8 and fp8, for the fp32 model and its bf16 cast.
2. **Greedy agreement of a small language model.** A byte-level Llama-style decoder (GQA, RoPE)
   trained for about a quarter of an hour on the Python standard library's own ``.py`` files (on
   every machine, offline; which files depends on the Python version, recorded in the result).
   Held-out prompts are continued greedily with each cache and compared token by token with the
   continuation from the model's own-dtype cache; then the reference continuation is fed through
   each cache (teacher forcing), which compares logits at every step without an early divergence
   hiding what comes after.
3. **That model's own K/V.** Each layer's post-RoPE q, K and V on held-out text, and the
   attention-output error of quantizing them (the metric of ``bench_quantized.py``'s quality
   table), with per-token scales and with fixed per-channel K scales, next to how outlying the
   layer's K channels are.

    python benchmarks/bench_quantized_quality.py           # full tables -> benchmarks/results/ (~20 min)
    python benchmarks/bench_quantized_quality.py --quick   # tiny models, under a minute (smoke test only)

Everything runs on one torch thread: results then do not depend on the machine's core count (a
reduction's order does), and the suite leaves a core to whatever else the machine is doing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import QuantizedKV
from attnkit.demo import Plan, make_mqar, recall_accuracy, train as train_mqar, variant_configs
from attnkit.kvquant import QUANTIZED_DTYPES, channel_scale, dequantize, dtype_name, quantize
from attnkit.models import Decoder, DecoderConfig
from bench_quantized import output_error, per_channel_k
from _common import bench_main, machine, torch_threads

#: The quantized caches measured, by their ``kv_dtype=`` names ("int8", "fp8_e4m3").
QUANT = tuple(dtype_name(d) for d in QUANTIZED_DTYPES)
#: One thread throughout (see the module docstring).
THREADS = 1
#: Query positions (the last of each context) whose attention output table 3 compares.
QUERY_ROWS = 64


def _dtype_label(dt: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dt]


def _cast(model: Decoder, dtype: torch.dtype) -> Decoder:
    """A copy of ``model`` in ``dtype`` (the original stays as it is)."""
    return copy.deepcopy(model).to(dtype).eval()


# ---------------------------------------------------------------------------- 1. the demo's models


def _demo_plan(quick: bool) -> Plan:
    """The demo's own plan: what ``attnkit demo`` (or ``--quick``) does, with its default seed.
    Quick mode keeps two variants and fewer steps, to stay a smoke test."""
    args = argparse.Namespace(quick=quick, seed=0, variants="gqa,mla" if quick else "mha,gqa,mqa,mla",
                              steps=120 if quick else None, threads=THREADS, pairs=None, no_figures=True)
    return Plan.from_args(args)


def _demo_recall(quick: bool) -> dict:
    plan = _demo_plan(quick)
    configs = variant_configs(plan)
    task = plan.task
    # The demo's held-out examples: one generator, sizes drawn in the demo's order (the trained
    # size first, then twice it), so these are the very examples its report scores.
    sizes = plan.eval_pairs[:2]
    gen_eval = torch.Generator().manual_seed(plan.seed + 10_000)
    evals = {n: make_mqar(task, plan.eval_examples, gen_eval, pairs=n, queries=max(1, n // 2)) for n in sizes}
    rows = []
    for i, (name, cfg) in enumerate(configs.items()):
        torch.manual_seed(plan.seed * 1000 + i)  # the demo's seeds: weights, then batches
        model = Decoder(cfg)
        losses = train_mqar(model, plan, torch.Generator().manual_seed(plan.seed))
        print(f"  demo {name.upper()}: final loss {losses[-1]:.3f}", file=sys.stderr, flush=True)
        for dt in (torch.float32, torch.bfloat16):
            m = model if dt == torch.float32 else _cast(model, dt)
            # kv_dtype=None runs without a cache: attention over K/V in the model's dtype, which is
            # exactly what a cache in that dtype stores.
            for kv in (None, *QUANT):
                rows.append({"variant": name, "model": _dtype_label(dt), "cache": kv or _dtype_label(dt),
                             "bytes_per_token": m.kv_bytes_per_token(kv_dtype=kv),
                             **{f"recall_{n}": recall_accuracy(m, *evals[n], kv_dtype=kv)[0] for n in sizes}})
    return {"plan": {"steps": plan.steps, "batch": plan.batch, "seed": plan.seed, "hidden": plan.hidden,
                     "layers": plan.layers, "heads": plan.heads, "eval_examples": plan.eval_examples,
                     "trained_pairs": task.num_pairs, "num_keys": task.num_keys, "num_values": task.num_values},
            "sizes": list(sizes), "rows": rows}


# ---------------------------------------------------------------------------- 2. a small language model


@dataclass(frozen=True)
class LMPlan:
    """The byte-level language model, its training, and what it is measured on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    seq: int  # training window (bytes); covers prompt + generated tokens and the K/V contexts
    batch: int
    steps: int
    lr: float
    prompts: int
    prompt_bytes: int
    new_tokens: int
    contexts: int  # held-out windows for the loss and for the K/V of table 3
    context_bytes: int
    holdout_every: int  # every n-th stdlib file (sorted by name) is held out
    seed: int = 0

    @classmethod
    def of(cls, quick: bool) -> "LMPlan":
        if quick:
            return cls(hidden=64, layers=2, heads=4, kv_heads=2, seq=128, batch=8, steps=30, lr=3e-3, prompts=2,
                       prompt_bytes=32, new_tokens=32, contexts=2, context_bytes=128, holdout_every=8)
        return cls(hidden=256, layers=4, heads=8, kv_heads=2, seq=512, batch=8, steps=800, lr=2e-3, prompts=8,
                   prompt_bytes=128, new_tokens=256, contexts=4, context_bytes=512, holdout_every=8)


def _corpus(p: LMPlan) -> tuple[Tensor, list[Tensor], list[Tensor], dict]:
    """The training bytes (N,), ``p.prompts`` prompts and ``p.contexts`` contexts (each a (L,)
    long tensor) from held-out files, and where they came from.

    The files are the standard library's top-level ``.py`` modules, sorted by name; every
    ``holdout_every``-th is held out. Each held-out window starts at the first line after the
    middle of its file (past the license header and imports, into code), one file per window."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.glob("*.py") if f.is_file())
    train_files = [f for i, f in enumerate(files) if i % p.holdout_every != p.holdout_every - 1]
    held = [f for i, f in enumerate(files) if i % p.holdout_every == p.holdout_every - 1]
    corpus = b"\n".join(f.read_bytes() for f in train_files)

    def window(f: Path, n: int) -> Tensor | None:
        data = f.read_bytes()
        start = data.find(b"\n", len(data) // 2) + 1
        return None if start <= 0 or start + n > len(data) else torch.tensor(list(data[start:start + n]))

    prompts, contexts, used = [], [], {"prompts": [], "contexts": []}
    for f in held:
        if len(prompts) < p.prompts and (w := window(f, p.prompt_bytes)) is not None:
            prompts.append(w)
            used["prompts"].append(f.name)
        elif len(contexts) < p.contexts and (w := window(f, p.context_bytes)) is not None:
            contexts.append(w)
            used["contexts"].append(f.name)
    if len(prompts) < p.prompts or len(contexts) < p.contexts:
        raise RuntimeError(f"{root} has too few held-out .py files for {p.prompts} prompts and {p.contexts} contexts")
    ids = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    info = {"stdlib": str(root), "files": len(files), "train_files": len(train_files), "train_bytes": len(corpus),
            **used}
    return ids, prompts, contexts, info


def _train_lm(p: LMPlan, corpus: Tensor) -> tuple[Decoder, list[float]]:
    """A GQA + RoPE decoder trained on random windows of ``corpus`` (AdamW, warmup, cosine)."""
    cfg = DecoderConfig(vocab_size=256, hidden_size=p.hidden, num_layers=p.layers, num_heads=p.heads,
                        attention="gqa", num_kv_heads=p.kv_heads, max_position_embeddings=1024)
    torch.manual_seed(p.seed)
    model = Decoder(cfg)
    g = torch.Generator().manual_seed(p.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, p.steps // 10)
    losses = []
    model.train()
    for step in range(p.steps):
        for group in opt.param_groups:
            group["lr"] = p.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / p.steps)))
        starts = torch.randint(0, corpus.numel() - p.seq - 1, (p.batch,), generator=g)
        x = torch.stack([corpus[s:s + p.seq + 1] for s in starts.tolist()])  # (B, seq + 1)
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if step % 50 == 0 or step == p.steps - 1:
            print(f"  LM step {step + 1}/{p.steps}: loss {losses[-1]:.3f}", file=sys.stderr, flush=True)
    return model.eval(), losses


@torch.inference_mode()
def _forced_logits(model: Decoder, seq: Tensor, first: int, kv_dtype) -> Tensor:
    """Teacher forcing: ``seq`` (B, T) through a fresh dynamic cache stored in ``kv_dtype`` (None:
    the model's dtype) in one step; logits (B, T - first, V) in fp32 of the positions that predict
    ``seq[:, first:]``. Every position attends over quantized K/V, as it would when decoding."""
    return model(seq[:, :-1], caches=model.new_caches("dynamic", kv_dtype=kv_dtype))[:, first - 1:].float()


def _heldout_loss(model: Decoder, contexts: Tensor, kv_dtype) -> float:
    """Mean next-byte cross-entropy (nats) over the held-out contexts (C, L), through the cache."""
    logits = _forced_logits(model, contexts, 1, kv_dtype)
    return float(F.cross_entropy(logits.flatten(0, 1), contexts[:, 1:].flatten()))


def _agreement(model: Decoder, prompts: Tensor, ref: Tensor, ref_model: Decoder, kv_dtype, T: int) -> dict:
    """Greedy continuation of ``prompts`` (N, P) with ``model``'s cache in ``kv_dtype``, against
    ``ref`` (N, T), the reference continuation (``ref_model``, own-dtype cache); then ``ref`` fed
    through both (teacher forcing) to compare their logits at every step."""
    got = torch.tensor(model.generate(prompts, T, cache="dynamic", kv_dtype=kv_dtype).tokens)  # (N, T)
    same = got == ref
    first = torch.where(same.all(1), T, (~same).int().argmax(1))  # first differing step; T: none
    seq = torch.cat([prompts, ref], 1)
    P = prompts.shape[1]
    want = _forced_logits(ref_model, seq, P, None)  # (N, T, V)
    have = _forced_logits(model, seq, P, kv_dtype)
    diff = (have - want).abs()
    return {"greedy_agree": float(same.float().mean()), "first_divergence_mean": float(first.float().mean()),
            "first_divergence_min": int(first.min()), "identical_prompts": int(same.all(1).sum()),
            "forced_top1_agree": float((have.argmax(-1) == want.argmax(-1)).float().mean()),
            "logit_diff_mean": float(diff.mean()), "logit_diff_max": float(diff.max()),
            "ref_logit_std": float(want.std())}


def _language_model(quick: bool) -> tuple[dict, Decoder, Tensor]:
    p = LMPlan.of(quick)
    corpus, prompts, contexts, data = _corpus(p)
    t0 = time.perf_counter()
    model, losses = _train_lm(p, corpus)
    train_seconds = time.perf_counter() - t0
    prompts, contexts = torch.stack(prompts), torch.stack(contexts)  # (N, P), (C, L)
    T = p.new_tokens
    models = {"fp32": model, "bf16": _cast(model, torch.bfloat16)}
    refs = {name: torch.tensor(m.generate(prompts, T, cache="dynamic").tokens) for name, m in models.items()}
    rows = []
    for name, m in models.items():
        rows.append({"model": name, "cache": name, "reference": "-", "bytes_per_token": m.kv_bytes_per_token(),
                     "heldout_loss": _heldout_loss(m, contexts, None)})
        for kv in QUANT:
            rows.append({"model": name, "cache": kv, "reference": f"{name} model, {name} cache",
                         "bytes_per_token": m.kv_bytes_per_token(kv_dtype=kv),
                         "heldout_loss": _heldout_loss(m, contexts, kv),
                         **_agreement(m, prompts, refs[name], m, kv, T)})
    # Context for the rows above: how far casting the weights (and the cache) to bf16 alone moves
    # the fp32 model's greedy output.
    rows.append({"model": "bf16", "cache": "bf16", "reference": "fp32 model, fp32 cache",
                 "bytes_per_token": models["bf16"].kv_bytes_per_token(),
                 "heldout_loss": _heldout_loss(models["bf16"], contexts, None),
                 **_agreement(models["bf16"], prompts, refs["fp32"], model, None, T)})
    res = {"plan": asdict(p), "data": data, "params": model.num_parameters(), "train_seconds": train_seconds,
           "final_loss": sum(losses[-10:]) / len(losses[-10:]), "losses": losses, "rows": rows}
    return res, model, contexts


# ---------------------------------------------------------------------------- 3. its own K/V


@contextlib.contextmanager
def _capture_qkv(model: Decoder):
    """Record each layer's (q (B, Hq, S, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv)) as its attention
    module hands them to attention (after QK-norm and RoPE), by wrapping the modules' ``project``
    for the duration of the block."""
    got: list[tuple[Tensor, Tensor, Tensor]] = []
    attns = [layer.self_attn for layer in model.model.layers]
    for attn in attns:
        def project(*args, _project=attn.project, **kwargs):
            q, k, v = _project(*args, **kwargs)
            got.append((q.detach().clone(), k.detach().clone(), v.detach().clone()))
            return q, k, v
        attn.project = project  # an instance attribute: shadows the method
    try:
        yield got
    finally:
        for attn in attns:
            del attn.project


def _own_kv(model: Decoder, contexts: Tensor) -> list[dict]:
    """Per layer and quantized dtype: the K channel absmax ratio and the attention-output errors
    of the last :data:`QUERY_ROWS` positions of the contexts (C, L), causal over all L keys."""
    if model.config.query_scale is not None:  # output_error scores with the default 1/sqrt(D)
        raise ValueError("the K/V error table assumes the default softmax scale")
    with torch.inference_mode(), _capture_qkv(model) as got:
        model(contexts)
    rows = []
    n = min(QUERY_ROWS, contexts.shape[1] // 2)
    for layer, (q, k, v) in enumerate(got):
        # Decode-like rows only: an early position attends over a handful of keys, and the first
        # one's output is its own V row, whose rounding would set the max of every K scheme alike.
        q, k, v = q[:, :, -n:].double(), k.double(), v.double()
        a = k.abs().amax(dim=(0, 2))  # (Hkv, D): each channel's absmax over the contexts
        ratio = float((a.amax(-1) / a.median(-1).values).max())
        c = channel_scale(k[:, :, :64])  # fixed at a cache's first write (a 64-token prompt)
        k_bf16, v_bf16 = k.bfloat16().double(), v.bfloat16().double()
        for kv in QUANT:
            k_quant = {"per_token": dequantize(*quantize(k, kv), torch.float64),
                       "channel_scaled": QuantizedKV.quantize(k, None, kv, v_head_dim=k.shape[-1],
                                                              k_channel_scale=c).gather(torch.float64)[0],
                       "per_channel_k": per_channel_k(k, kv)}
            v_quant = dequantize(*quantize(v, kv), torch.float64)
            # V's rounding is the same under every K scheme and can set the max; with V exact
            # ("K only") the K schemes' own differences show.
            for stored, vb, vq in (("K and V", v_bf16, v_quant), ("K only", v, v)):
                rows.append({"layer": layer, "kv": kv, "stored": stored, "k_channel_ratio": ratio,
                             "bf16_err": output_error(q, k, v, k_bf16, vb),
                             **{f"{name}_err": output_error(q, k, v, kd, vq) for name, kd in k_quant.items()}})
    return rows


# ---------------------------------------------------------------------------- the suite


def run(quick: bool) -> dict:
    with torch_threads(THREADS):
        t0 = time.perf_counter()
        m = machine()
        demo = _demo_recall(quick)
        t1 = time.perf_counter()
        lm, model, contexts = _language_model(quick)
        t2 = time.perf_counter()
        own = _own_kv(model, contexts)
        t3 = time.perf_counter()
    return {"machine": m, "quick": quick, "demo": demo, "lm": lm, "own_kv": own,
            "seconds": {"demo": t1 - t0, "lm": t2 - t1, "own_kv": t3 - t2, "total": t3 - t0}}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def to_markdown(res: dict) -> str:
    m, d, lm, sec = res["machine"], res["demo"], res["lm"], res["seconds"]
    dp, lp = d["plan"], lm["plan"]
    sizes = d["sizes"]
    lines = [
        f"Machine: {m['cpu']} ({m.get('isa', '?')}), {m['cores']} cores ({m['torch_threads']} torch threads), "
        f"torch {m['torch']}, attnkit {m['attnkit']}, Python {m['python']}. "
        f"{sec['total']:.0f} s in all{' (--quick: tiny models, figures mean nothing)' if res['quick'] else ''}.",
        "",
        "**Recall of the demo's models with a quantized cache.** `attnkit demo`'s decoders "
        f"({dp['layers']} layers, hidden {dp['hidden']}, {dp['heads']} query heads, equal parameter counts), trained "
        f"as the demo trains them ({dp['steps']} steps of {dp['batch']} associative-recall examples, seed "
        f"{dp['seed']}, {dp['trained_pairs']} key-value pairs), scored on the demo's {dp['eval_examples']} held-out "
        f"examples per size: the fraction of answers predicted exactly (chance {1 / dp['num_values']:.1%}), at the "
        f"trained {sizes[0]} pairs and at {sizes[-1]} (a longer context than any seen in training). Cache: "
        "what every position attends over: the model's own dtype (fp32, or bf16 for the model cast to bf16), or "
        "the same model with its cache in int8 / fp8 e4m3 (one fp32 scale per token and KV head; MLA: per token "
        "of its latent; int8 also divides K by per-channel scales fixed at the first write, the caches' default). "
        "Bytes/token: the whole model's cache per token of one sequence, scales included.",
        "",
        "| variant | model | cache | bytes/token | " + " | ".join(f"recall @{n} pairs" for n in sizes) + " |",
        "|---|---|---|---:|" + "---:|" * len(sizes),
    ]
    for r in d["rows"]:
        lines.append(f"| {r['variant'].upper()} | {r['model']} | {r['cache']} | {r['bytes_per_token']:,} | "
                     + " | ".join(_pct(r[f'recall_{n}']) for n in sizes) + " |")
    data = lm["data"]
    lines += [
        "",
        f"**Greedy agreement of a small language model.** A byte-level decoder ({lp['layers']} layers, hidden "
        f"{lp['hidden']}, {lp['heads']} query / {lp['kv_heads']} KV heads (GQA), RoPE, {lm['params'] / 1e6:.1f}M "
        f"parameters) trained in fp32 for {lp['steps']} steps of {lp['batch']} x {lp['seq']} bytes of the Python "
        f"{m['python']} standard library ({data['train_files']} of its {data['files']} top-level .py files, "
        f"{data['train_bytes'] / 1e6:.1f} MB; every {lp['holdout_every']}th file held out) in "
        f"{lm['train_seconds']:.0f} s; final training loss {lm['final_loss']:.3f} nats/byte (mean of the last 10 "
        f"steps). {lp['prompts']} prompts of {lp['prompt_bytes']} bytes from held-out files, each continued "
        f"greedily for {lp['new_tokens']} tokens (dynamic cache). Greedy: the share of the {lp['new_tokens']} "
        "steps whose token equals the reference's at that step, the mean and smallest first step where they differ "
        f"({lp['new_tokens']} when none does), and the prompts continued identically throughout. Teacher-forced: "
        "the reference continuation fed through both caches (one step each), so every position compares the two "
        "models' next-token logits on the same text: top-1 agreement, and the mean and max |logit difference| "
        "(reference logits' std beside them for scale). Held-out loss: next-byte cross-entropy over "
        f"{lp['contexts']} held-out windows of {lp['context_bytes']} bytes, through that cache. The last row is "
        "context: the bf16 cast (weights and cache) against the fp32 model.",
        "",
        "| model | cache | reference | bytes/token | held-out loss | greedy agree | first divergence (mean / min) | "
        "identical prompts | forced top-1 agree | forced \\|Δlogit\\| mean / max | ref logit std |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in lm["rows"]:
        if r["reference"] == "-":
            lines.append(f"| {r['model']} | {r['cache']} | (reference) | {r['bytes_per_token']:,} | "
                         f"{r['heldout_loss']:.4f} | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['cache']} | {r['reference']} | {r['bytes_per_token']:,} | "
                     f"{r['heldout_loss']:.4f} | {_pct(r['greedy_agree'])} | {r['first_divergence_mean']:.0f} / "
                     f"{r['first_divergence_min']} | {r['identical_prompts']} of {lp['prompts']} | "
                     f"{_pct(r['forced_top1_agree'])} | {r['logit_diff_mean']:.3f} / {r['logit_diff_max']:.3f} | "
                     f"{r['ref_logit_std']:.2f} |")
    lines += [
        "",
        "**That model's own K/V.** Each layer's q, K and V (after RoPE) of the fp32 model over the "
        f"{lp['contexts']} held-out windows of {lp['context_bytes']} bytes, and the attention-output error of "
        "storing K/V quantized: max |out - out_exact| / RMS(out_exact) over the last "
        f"{min(QUERY_ROWS, lp['context_bytes'] // 2)} query positions of each window (causal, over all its keys: "
        "decode-like rows), fp64 arithmetic, so only the storage differs (the metric of `bench_quantized.py`'s quality table). K channel "
        "ratio: the largest channel absmax of a KV head over its median channel absmax, the largest over the "
        "layer's heads (a few times 1 means no outlier channels). bf16: K/V stored in bf16. Per-token: one scale "
        "per token and KV head (what fp8 caches store, and int8 ones with `k_channel_scale=False`). + channel "
        "scales: K first divided by fixed per-channel scales from the first 64 tokens "
        "(`attnkit.kvquant.channel_scale`), what int8 caches store by default. Per-channel K (KIVI): one scale per channel over all tokens, for comparison. "
        "Quantized: K and V both (what a cache stores), or K alone with V exact, which isolates the K schemes "
        "(V's rounding is the same under each, and can set the max).",
        "",
        "| layer | K/V | quantized | K channel ratio | bf16 | per-token | per-token + channel scales | "
        "per-channel K (KIVI) |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in res["own_kv"]:
        lines.append(f"| {r['layer']} | {r['kv']} | {r['stored']} | {r['k_channel_ratio']:.1f} | {r['bf16_err']:.2e} | "
                     f"{r['per_token_err']:.2e} | {r['channel_scaled_err']:.2e} | {r['per_channel_k_err']:.2e} |")
    lines += ["", f"Time: demo models {sec['demo']:.0f} s, language model {sec['lm']:.0f} s (training "
              f"{lm['train_seconds']:.0f} s), K/V errors {sec['own_kv']:.0f} s."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return bench_main(argv, __doc__, "quantized_quality", run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
