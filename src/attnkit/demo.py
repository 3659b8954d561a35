"""``attnkit demo``: what MHA, GQA, MQA and MLA cost and buy, measured on one machine in minutes.

One small decoder per variant (:class:`attnkit.models.Decoder`, equal parameter budgets: the MLP
width absorbs the difference in attention parameters) is trained on generated **multi-query
associative recall** (MQAR): a context of key-value pairs, then queries whose answers must be
retrieved from the context,

    BOS  k1 v1  k2 v2 ... kN vN  SEP  q1 a1  q2 a2 ... qM aM        (a_j = the value paired with q_j)

the standard probe of attention's recall (Zoology, Arora et al. 2023). Keys are distinct and
values random, so only retrieval predicts an answer; the loss and the accuracy count the answer
tokens only, and there are fewer queries than pairs, so no answer follows by elimination.

Then each model is measured: recall accuracy on held-out examples, prefill latency (B=1),
decode tokens/s with the KV cache (a batch of long prompts, where reading the cache is real
work), KV-cache bytes per token, and the attention map of its best retrieval head; recall, decode
speed and bytes per token are measured again with an int8 KV cache (``kv_dtype="int8"``: one byte
per value and an fp32 scale per row, the same weights). Everything is
written to a new folder (report.md, report.json, PNG figures) that appears only when complete:
the work happens in a hidden sibling folder renamed at the end, so Ctrl-C leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ._sysinfo import cpu_name

__all__ = ["DemoError", "Task", "Plan", "make_mqar", "variant_configs", "train", "recall_accuracy",
           "measure_quantized", "run_demo", "add_demo_arguments"]

VARIANTS = ("mha", "gqa", "mqa", "mla")
#: The quantized KV cache each variant is measured with as well (``kv_dtype=``).
KV_QUANT = "int8"
FIGURES = ("accuracy_vs_kv_bytes.png", "decode_speed.png", "attention_maps.png", "mask_gallery.png",
           "training_curves.png")
REPORT_FILES = ("report.md", "report.json")


class DemoError(Exception):
    """A bad option or a missing prerequisite (the command prints it and exits with status 2)."""


# ---------------------------------------------------------------------------- the task


@dataclass(frozen=True)
class Task:
    """MQAR sizes. Vocabulary: 0 = BOS, 1 = SEP, then ``num_keys`` keys, then ``num_values`` values."""

    num_keys: int = 32
    num_values: int = 32
    num_pairs: int = 8
    num_queries: int = 4

    def __post_init__(self):
        if not 1 <= self.num_queries <= self.num_pairs <= self.num_keys:
            raise DemoError(f"need 1 <= queries ({self.num_queries}) <= pairs ({self.num_pairs}) <= keys "
                            f"({self.num_keys})")

    BOS = 0
    SEP = 1

    @property
    def vocab_size(self) -> int:
        return 2 + self.num_keys + self.num_values

    @property
    def seq_len(self) -> int:
        return 2 + 2 * self.num_pairs + 2 * self.num_queries

    @property
    def first_query(self) -> int:
        """Index of the first query token."""
        return 2 + 2 * self.num_pairs


def make_mqar(task: Task, n: int, generator: torch.Generator, *, pairs: int | None = None,
              queries: int | None = None) -> tuple[Tensor, Tensor]:
    """``n`` examples: ids (n, T) and targets (n, T) where ``targets[:, t]`` is the answer that
    follows query token t (-100 elsewhere: nothing else is predictable). ``pairs`` / ``queries``
    override the task's counts (the training curriculum starts with fewer pairs)."""
    K = task.num_keys
    N = task.num_pairs if pairs is None else pairs
    M = task.num_queries if queries is None else queries
    if not 1 <= M <= N <= K:
        raise ValueError(f"need 1 <= queries ({M}) <= pairs ({N}) <= keys ({K})")
    keys = torch.rand(n, K, generator=generator).argsort(-1)[:, :N] + 2  # distinct keys
    vals = torch.randint(0, task.num_values, (n, N), generator=generator) + 2 + K
    pick = torch.rand(n, N, generator=generator).argsort(-1)[:, :M]  # distinct queried pairs
    q, a = keys.gather(1, pick), vals.gather(1, pick)
    ids = torch.cat([torch.full((n, 1), task.BOS), torch.stack([keys, vals], -1).flatten(1),
                     torch.full((n, 1), task.SEP), torch.stack([q, a], -1).flatten(1)], 1)
    targets = torch.full_like(ids, -100)
    targets[:, 2 + 2 * N::2] = a
    return ids, targets


def curriculum(task: Task, step: int, steps: int) -> tuple[int, int]:
    """(pairs, queries) of training step ``step``: 2 pairs for the first 30% of the steps (a
    2-layer model forms its retrieval circuit there within a few hundred steps; on the full task
    from the start it lingers on shortcuts), then a linear ramp to the task's size at 70%."""
    N = task.num_pairs
    frac = step / max(steps, 1)
    if frac >= 0.7 or N <= 2:
        return N, task.num_queries
    n = 2 if frac < 0.3 else max(2, min(N, round(2 + (N - 2) * (frac - 0.3) / 0.4)))
    return n, max(1, n // 2)


# ---------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Plan:
    """Everything the demo does, fixed by ``--quick`` and the options (recorded in the report)."""

    quick: bool
    seed: int
    variants: tuple[str, ...]
    steps: int
    batch: int
    lr: float
    hidden: int
    layers: int
    heads: int
    eval_examples: int
    context: int  # prompt length of the speed measurements
    decode_batch: int
    decode_tokens: int
    threads: int
    figures: bool
    task: Task

    @property
    def eval_pairs(self) -> tuple[int, ...]:
        """Context sizes (pairs) recall is measured at: the trained one, 2x and 4x (within the keys)."""
        n, k = self.task.num_pairs, self.task.num_keys
        return tuple(dict.fromkeys(min(m * n, k) for m in (1, 2, 4)))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Plan":
        quick = bool(args.quick)
        variants = tuple(dict.fromkeys(v.strip().lower() for v in args.variants.split(",") if v.strip()))
        bad = [v for v in variants if v not in VARIANTS]
        if bad or not variants:
            raise DemoError(f"--variants must be a comma-separated subset of {','.join(VARIANTS)}, got "
                            f"{args.variants!r}")
        steps = args.steps if args.steps is not None else (240 if quick else 800)
        if steps < 1:
            raise DemoError(f"--steps must be >= 1, got {steps}")
        threads = args.threads
        if threads < 1:
            raise DemoError(f"--threads must be >= 1, got {threads}")
        pairs = args.pairs if args.pairs is not None else (2 if quick else 8)
        if pairs < 1:
            raise DemoError(f"--pairs must be >= 1, got {pairs}")
        vocab_side = max(16 if quick else 32, 4 * pairs)
        task = Task(num_keys=vocab_side, num_values=vocab_side, num_pairs=pairs, num_queries=max(1, pairs // 2))
        return cls(quick=quick, seed=args.seed, variants=variants, steps=steps, batch=64 if quick else 128,
                   lr=3e-3, hidden=64, layers=2, heads=4, eval_examples=128 if quick else 1024,
                   context=128 if quick else 1024, decode_batch=4, decode_tokens=12 if quick else 32,
                   threads=threads, figures=not args.no_figures, task=task)


def variant_configs(plan: Plan):
    """One :class:`DecoderConfig` per variant, the MLP width of each chosen so every model has
    (to within one MLP column) the parameters of the MHA model."""
    from .models import Decoder, DecoderConfig
    E, H = plan.hidden, plan.heads
    hd = E // H
    base = dict(vocab_size=plan.task.vocab_size, hidden_size=E, num_layers=plan.layers, num_heads=H,
                max_position_embeddings=4096)
    attn = {"mha": {}, "gqa": {"num_kv_heads": max(2, H // 2)}, "mqa": {},
            "mla": {"kv_lora_rank": 2 * hd, "qk_nope_head_dim": hd, "qk_rope_head_dim": hd // 2, "v_head_dim": hd}}
    inter0 = 2 * E
    meta = torch.device("meta")

    def count(name, inter):
        with meta:
            return Decoder(DecoderConfig(**base, attention=name, intermediate_size=inter, **attn[name]),
                           init_std=None).num_parameters()

    target = count("mha", inter0)
    configs = {}
    for name in plan.variants:
        # Parameters are affine in the MLP width: 3 * E per column per layer.
        per_col = 3 * E * plan.layers
        inter = max(8, inter0 + round((target - count(name, inter0)) / per_col))
        configs[name] = DecoderConfig(**base, attention=name, intermediate_size=inter, **attn[name])
    return configs


# ---------------------------------------------------------------------------- progress


class Progress:
    """A one-line progress bar on stderr (redrawn with \\r on a terminal; a few plain lines
    otherwise, so logs stay short)."""

    def __init__(self, total: int, label: str, stream=None):
        self.total, self.label, self.stream = max(total, 1), label, stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self._last_pct = -1

    def update(self, done: int, note: str = "", *, final: bool = False) -> None:
        frac = min(done / self.total, 1.0)
        pct = int(frac * 100)
        el = time.perf_counter() - self.t0
        if self.tty:
            bar = "#" * int(frac * 24)
            self.stream.write(f"\r{self.label:<14} [{bar:<24}] {pct:3d}% {el:5.1f}s {note:<28}")
            self.stream.flush()
        elif final or (pct // 25 > self._last_pct // 25 and pct < 100):
            self.stream.write(f"{self.label}: {pct}% {el:.1f}s {note}\n")
            self.stream.flush()
        self._last_pct = pct

    def close(self, note: str = "") -> None:
        self.update(self.total, note, final=True)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------------------- training and measuring


def train(model, plan: Plan, generator: torch.Generator, progress: Progress | None = None) -> list[float]:
    """AdamW with warmup and cosine decay on fresh MQAR batches; returns the loss per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=plan.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warm = max(1, plan.steps // 10)
    losses = []
    model.train()
    for step in range(plan.steps):
        scale = min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / plan.steps)))
        for g in opt.param_groups:
            g["lr"] = plan.lr * scale
        pairs, queries = curriculum(plan.task, step, plan.steps)
        ids, targets = make_mqar(plan.task, plan.batch, generator, pairs=pairs, queries=queries)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), targets[:, :-1].flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if progress is not None and (step % 10 == 0 or step == plan.steps - 1):
            progress.update(step + 1, f"loss {losses[-1]:.3f}")
    model.eval()
    return losses


@torch.inference_mode()
def recall_accuracy(model, ids: Tensor, targets: Tensor, batch: int = 256, *,
                    kv_dtype=None) -> tuple[float, list[float]]:
    """Fraction of answers predicted exactly (argmax at each query), overall and per query index.
    ``kv_dtype`` ("int8", "fp8_e4m3"): each example runs through a KV cache stored in it, so every
    position attends over quantized keys and values (what decoding with that cache attends to)."""
    hits = []
    for i in range(0, ids.shape[0], batch):
        x, y = ids[i:i + batch, :-1], targets[i:i + batch, :-1]
        caches = None if kv_dtype is None else model.new_caches("dynamic", kv_dtype=kv_dtype)
        pred = model(x, caches=caches).argmax(-1)
        cols = (y[0] != -100).nonzero().flatten()
        hits.append((pred[:, cols] == y[:, cols]).float())
    h = torch.cat(hits)
    return float(h.mean()), [float(v) for v in h.mean(0)]


def _median_seconds(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def measure_speed(model, plan: Plan, generator: torch.Generator, *, kv_dtype=None) -> dict:
    """Prefill latency (B=1, ``context`` tokens, into a fresh cache) and decode tokens/s (a batch
    of ``decode_batch`` prompts of ``context`` tokens, greedy, dynamic cache). With ``kv_dtype``
    the decode runs on a cache stored in it, over the same prompts (the prefill is not timed)."""
    V = model.config.vocab_size
    prompt = torch.randint(2, V, (1, plan.context), generator=generator)

    def prefill():
        model(prompt, caches=model.new_caches("dynamic"), logits_to_keep=1)

    out = {}
    if kv_dtype is None:
        out["prefill_ms"] = _median_seconds(prefill, 3 if plan.quick else 5) * 1e3
    prompts = torch.randint(2, V, (plan.decode_batch, plan.context), generator=generator)
    rates = []
    for _ in range(2 if plan.quick else 3):
        g = model.generate(prompts, plan.decode_tokens, cache="dynamic", kv_dtype=kv_dtype)
        rates.append(g.decode_tokens_per_second)
    out["decode_tok_s"] = statistics.median(rates)
    return out


def measure_quantized(model, plan: Plan, evals: dict, kv_dtype: str = KV_QUANT) -> dict:
    """The model again with its KV cache in ``kv_dtype``: bytes per token (data + scales), recall
    at every evaluated size, decode tokens/s (the float measurement's prompts)."""
    acc_at = {str(n): recall_accuracy(model, *evals[n], kv_dtype=kv_dtype)[0] for n in plan.eval_pairs}
    speed = measure_speed(model, plan, torch.Generator().manual_seed(plan.seed + 1), kv_dtype=kv_dtype)
    return {"kv_dtype": kv_dtype, "kv_bytes_per_token": model.kv_bytes_per_token(kv_dtype=kv_dtype),
            "accuracy": acc_at[str(plan.task.num_pairs)], "accuracy_at": acc_at, **speed}


@torch.inference_mode()
def retrieval_head(model, task: Task, ids: Tensor) -> dict:
    """The head that best attends from each query to the position of its answer's value (where
    retrieval reads), on one example: layer, head, score (mean weight on the right cell), the
    weights (S, S) of that head and the cells it should look at."""
    x = ids[None, :-1]
    _, weights = model(x, need_weights=True)
    T = x.shape[1]
    q_pos = list(range(task.first_query, T, 2))
    pairs = {int(ids[2 * i + 1]): 2 * i + 2 for i in range(task.num_pairs)}  # key -> its value's position
    cells = [(q, pairs[int(ids[q])]) for q in q_pos]
    best = None
    for layer, w in enumerate(weights):
        w = w[0]  # (H, S, S)
        score = torch.stack([w[:, q, k] for q, k in cells], -1).mean(-1)  # (H,)
        h = int(score.argmax())
        if best is None or float(score[h]) > best["score"]:
            best = {"layer": layer, "head": h, "score": float(score[h]), "weights": w[h].clone(), "cells": cells}
    return best


def _token_labels(task: Task, ids: Tensor) -> list[str]:
    out = []
    for t in ids.tolist():
        if t == task.BOS:
            out.append("<s>")
        elif t == task.SEP:
            out.append("|")
        elif t < 2 + task.num_keys:
            out.append(f"k{t - 2}")
        else:
            out.append(f"v{t - 2 - task.num_keys}")
    return out


# ---------------------------------------------------------------------------- report


def _fmt_bytes(n: float) -> str:
    return f"{n:,.0f} B"


def summary_table(rows: list[dict], plan: Plan) -> str:
    ctx, sizes = plan.context, plan.eval_pairs
    acc_cols = " | ".join(f"recall @ {n} pairs" + (" (trained)" if n == plan.task.num_pairs else "") for n in sizes)
    lines = [f"| variant | KV heads | params | KV bytes/token | {acc_cols} | "
             f"prefill ms (B=1, {ctx} tok) | decode tok/s (B={plan.decode_batch}, {ctx}-tok prompts) | train s |",
             "|---|---:|---:|---:|" + "---:|" * len(sizes) + "---:|---:|---:|"]
    for r in rows:
        accs = " | ".join(f"{r['accuracy_at'][str(n)]:.1%}" for n in sizes)
        lines.append(f"| {r['variant'].upper()} | {r['num_kv_heads']} | {r['params']:,} | {_fmt_bytes(r['kv_bytes_per_token'])} | "
                     f"{accs} | {r['prefill_ms']:.1f} | {r['decode_tok_s']:.0f} | {r['train_seconds']:.0f} |")
        qr = r.get("quantized_kv")
        if qr is not None:
            accs = " | ".join(f"{qr['accuracy_at'][str(n)]:.1%}" for n in sizes)
            lines.append(f"| {r['variant'].upper()}, {qr['kv_dtype']} KV | {r['num_kv_heads']} | (same) | "
                         f"{_fmt_bytes(qr['kv_bytes_per_token'])} | {accs} | | {qr['decode_tok_s']:.0f} | |")
    return "\n".join(lines)


def _terminal_table(rows: list[dict], plan: Plan) -> str:
    sizes = plan.eval_pairs
    head = ["variant", "params", "KV B/token", *(f"recall@{n}" for n in sizes), "prefill ms", "decode tok/s"]
    body = []
    for r in rows:
        body.append([r["variant"].upper(), f"{r['params']:,}", f"{r['kv_bytes_per_token']:,}",
                     *(f"{r['accuracy_at'][str(n)]:.1%}" for n in sizes), f"{r['prefill_ms']:.1f}",
                     f"{r['decode_tok_s']:.0f}"])
        qr = r.get("quantized_kv")
        if qr is not None:
            body.append([f"  {qr['kv_dtype']} KV", "", f"{qr['kv_bytes_per_token']:,}",
                         *(f"{qr['accuracy_at'][str(n)]:.1%}" for n in sizes), "", f"{qr['decode_tok_s']:.0f}"])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *(fmt(b) for b in body)])


def _reading(rows: list[dict], plan: Plan) -> list[str]:
    """Plain-language notes computed from the numbers (nothing here is a fixed claim)."""
    by = {r["variant"]: r for r in rows}
    out = []
    sizes = [str(n) for n in plan.eval_pairs]
    probe = sizes[1] if len(sizes) > 1 else sizes[0]  # the first size beyond training separates them best
    if "mha" in by and len(by) > 1:
        ref = by["mha"]
        parts = []
        for v, r in by.items():
            if v == "mha":
                continue
            parts.append(f"{v.upper()} caches {r['kv_bytes_per_token'] / ref['kv_bytes_per_token']:.0%} of MHA's bytes "
                         f"per token, recalls {r['accuracy'] - ref['accuracy']:+.1%} at the trained size and "
                         f"{r['accuracy_at'][probe] - ref['accuracy_at'][probe]:+.1%} at {probe} pairs, and decodes "
                         f"at {r['decode_tok_s'] / ref['decode_tok_s']:.2f}x its speed")
        out.append("- Against MHA: " + "; ".join(parts) + ".")
    far = str(plan.eval_pairs[-1])
    if len(plan.eval_pairs) > 1:
        best = max(rows, key=lambda r: r["accuracy_at"][far])
        worst = min(rows, key=lambda r: r["accuracy_at"][far])
        out.append(f"- With {far} pairs in the context ({int(far) // plan.task.num_pairs}x the trained count, positions "
                   f"never seen in training) recall ranges from {worst['accuracy_at'][far]:.1%} ({worst['variant'].upper()}) "
                   f"to {best['accuracy_at'][far]:.1%} ({best['variant'].upper()}).")
    quant = [(r["variant"], r["quantized_kv"]) for r in rows if r.get("quantized_kv")]
    if quant:
        kvd = quant[0][1]["kv_dtype"]
        parts = [f"{v.upper()} {q['kv_bytes_per_token'] / by[v]['kv_bytes_per_token']:.0%} of the bytes, recall "
                 f"{q['accuracy'] - by[v]['accuracy']:+.1%} at the trained size and "
                 f"{q['accuracy_at'][probe] - by[v]['accuracy_at'][probe]:+.1%} at {probe} pairs, decode "
                 f"{q['decode_tok_s'] / by[v]['decode_tok_s']:.2f}x" for v, q in quant]
        slower = [v.upper() for v, q in quant if q["decode_tok_s"] < by[v]["decode_tok_s"]]
        out.append(f"- An {kvd} KV cache (same weights; one byte per value and an fp32 scale per row): "
                   + "; ".join(parts) + "." + (
                       f" Slower for {', '.join(slower)}: at this width a decode step is mostly per-step overhead, "
                       "to which quantizing each step's K/V adds, while the bytes saved are few; the bytes are what "
                       "a long context buys." if slower else ""))
    if "mla" in by:
        out.append("- MLA's timings come from its module path at this tiny width: prefill expands the latent per "
                   "head, and its attention has a wider key (latent + rope dims) than value, which torch's SDPA runs "
                   "with its slower math kernel on CPU. Its cache is what it saves; the time it takes here is this "
                   "implementation's, not a property of MLA.")
    out.append(f"- One seed, tiny models: differences of a few points in recall are within seed-to-seed variation; "
               f"run with another --seed to see how stable they are. Decode speed at hidden {plan.hidden} is mostly "
               "per-step overhead plus reading the cache; the cache's share grows with context and batch, which is "
               "where the bytes-per-token column turns into speed.")
    return out


def _markdown(rows: list[dict], plan: Plan, meta: dict, files: list[str]) -> str:
    t = plan.task
    lines = [
        "# attnkit demo: MHA, GQA, MQA and MLA on multi-query associative recall", "",
        f"`{meta['command']}` on {meta['date']}: attnkit {meta['attnkit']}, torch {meta['torch']}, "
        f"{meta['machine']}, {plan.threads} torch thread(s), seed {plan.seed}; {meta['total_seconds']:.0f} s in all.", "",
        "## Task", "",
        f"Each example is `BOS k1 v1 ... kN vN SEP q1 a1 ... qM aM`: N distinct keys (of {t.num_keys}) with random "
        f"values (of {t.num_values}), then M = N / 2 of the keys again; the model must answer each with its value, "
        f"which only retrieval from the context can do (chance: {1 / t.num_values:.1%}); with M < N no answer "
        f"follows by elimination. Loss and accuracy count the answers only. Training: {plan.steps} steps of "
        f"{plan.batch} fresh examples, AdamW (lr {plan.lr:g}, warmup, cosine); N = 2 for the first 30% of the steps, "
        f"then growing to N = {t.num_pairs} by 70% (on the full task from the start, 2-layer models linger on "
        f"shortcuts). Recall: {plan.eval_examples} held-out examples per size, at the trained N = {t.num_pairs} "
        "and at larger N (longer contexts than any seen in training).", "",
        "## Results", "",
        summary_table(rows, plan), "",
        f"Models: {plan.layers} layers, hidden {plan.hidden}, {plan.heads} query heads; the MLP width of each "
        "variant is chosen so all have the MHA model's parameter count (within one MLP column). "
        "KV bytes/token: the whole model's cache per token per sequence, fp32, read from the caches. "
        f"Rows marked {KV_QUANT} KV: the same model with an {KV_QUANT} cache (data plus an fp32 scale per row; recall "
        "runs every example through that cache, decode as below). "
        f"Prefill: one {plan.context}-token prompt into an empty cache. Decode: "
        f"{plan.decode_tokens} greedy tokens after {plan.decode_batch} prompts of {plan.context} tokens "
        "(dynamic cache), tokens of the whole batch per second.", "",
        "Reading it:", "", *_reading(rows, plan), "",
        "Best retrieval head per model (mean attention from each query to its answer's value, one example):", "",
    ]
    for r in rows:
        h = r["retrieval_head"]
        lines.append(f"- {r['variant'].upper()}: layer {h['layer']}, head {h['head']}, score {h['score']:.2f}")
    lines.append("")
    if plan.figures:
        lines += ["## Figures", "",
                  "![recall against KV bytes per token](accuracy_vs_kv_bytes.png)", "",
                  "![decode speed per variant](decode_speed.png)", "",
                  "![attention map of a retrieval head](attention_maps.png)", "",
                  "![training curves](training_curves.png)", "",
                  "![the mask kinds of attnkit.masks](mask_gallery.png)", ""]
    lines += ["## Files", "", *(f"- `{f}`" for f in files), ""]
    return "\n".join(lines)


def _figures(rows: list[dict], plan: Plan, tmp: Path, example_labels: list[str]) -> None:
    from . import viz
    names = [r["variant"].upper() for r in rows]
    points = []
    for n in plan.eval_pairs:
        label = f"{n} pairs" + (" (trained)" if n == plan.task.num_pairs else "")
        for r in rows:
            points.append((r["kv_bytes_per_token"], r["accuracy_at"][str(n)], r["variant"].upper(), label))
            qr = r.get("quantized_kv")
            if qr is not None:
                points.append((qr["kv_bytes_per_token"], qr["accuracy_at"][str(n)],
                               f"{r['variant'].upper()} {qr['kv_dtype']}", label))
    viz.plot_scatter(points, tmp / "accuracy_vs_kv_bytes.png",
                     xlabel=f"KV-cache bytes per token (whole model, fp32 or {KV_QUANT} + scales)",
                     ylabel="recall accuracy", title="Recall against cache size", ylim=(0, 1.08), logx=True)
    speeds = {f"decode tok/s (B={plan.decode_batch}, {plan.context}-token prompts)": [r["decode_tok_s"] for r in rows]}
    if all(r.get("quantized_kv") for r in rows):
        speeds[f"{KV_QUANT} KV cache"] = [r["quantized_kv"]["decode_tok_s"] for r in rows]
    viz.plot_bars(names, speeds,
                  tmp / "decode_speed.png", ylabel="tokens / s", title="Decode speed with the KV cache")
    maps = torch.stack([r["_head_weights"] for r in rows])
    viz.plot_attention(maps, tmp / "attention_maps.png", tokens=example_labels,
                       head_titles=[f"{r['variant'].upper()} layer {r['retrieval_head']['layer']} head "
                                    f"{r['retrieval_head']['head']} ({r['retrieval_head']['score']:.2f})" for r in rows],
                       highlight=rows[0]["retrieval_head"]["cells"],
                       title="Retrieval heads on one example (red: where each answer's value sits)")
    viz.plot_lines({r["variant"].upper(): r["losses"] for r in rows}, tmp / "training_curves.png",
                   xlabel="step", ylabel="loss (answers)", title="Training", smooth=max(1, plan.steps // 50))
    viz.mask_gallery(tmp / "mask_gallery.png")


# ---------------------------------------------------------------------------- the command


def add_demo_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--quick", action="store_true", help="a smaller task and fewer steps (under a minute, for CI)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder to create for the report (default: ./attnkit-demo-<date>-<time>)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--seed", type=int, default=0, help="seed of data and weights (default 0)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of mha,gqa,mqa,mla (default: all)")
    p.add_argument("--steps", type=int, default=None, help="training steps per model (default: 800; --quick: 240)")
    p.add_argument("--pairs", type=int, default=None,
                   help="key-value pairs per example (default: 8; --quick: 2); queries: half as many")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: these models are small, one thread is about as fast and "
                        "is not slowed down by other work on the machine)")
    p.add_argument("--no-figures", action="store_true", help="skip the PNG figures (no matplotlib needed)")
    return p


def _out_dir(args) -> Path:
    out = args.out or Path(f"attnkit-demo-{datetime.now():%Y%m%d-%H%M%S}")
    out = out.expanduser().resolve()
    if out.exists() and not args.force:
        raise DemoError(f"--out {out} already exists; choose another folder or pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {out} is a file")
    if not out.parent.is_dir():
        raise DemoError(f"the parent folder of --out, {out.parent}, does not exist")
    if not os.access(out.parent, os.W_OK):
        raise DemoError(f"cannot write into {out.parent}")
    return out


def _commit(tmp: Path, out: Path) -> None:
    """Move the finished folder into place; an existing ``out`` (--force) goes only after."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def run_demo(args: argparse.Namespace, *, stream=None) -> Path:
    """Run the demo for parsed ``attnkit demo`` arguments; returns the report folder."""
    stream = stream or sys.stdout
    plan = Plan.from_args(args)
    if plan.figures:
        from .viz import require_matplotlib
        try:
            require_matplotlib()
        except ImportError as e:
            raise DemoError(f"{e}; or run `attnkit demo --no-figures` for the report without figures") from None
    out = _out_dir(args)
    from . import __version__
    from .models import Decoder

    t_start = time.perf_counter()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(plan.threads)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    tmp.mkdir()
    try:
        configs = variant_configs(plan)
        gen_eval = torch.Generator().manual_seed(plan.seed + 10_000)
        t = plan.task
        evals = {n: make_mqar(t, plan.eval_examples, gen_eval, pairs=n, queries=max(1, n // 2)) for n in plan.eval_pairs}
        example = evals[t.num_pairs][0][0]
        print(f"attnkit demo: {len(configs)} decoders ({', '.join(v.upper() for v in configs)}) on associative "
              f"recall ({t.num_pairs} pairs, {t.num_queries} queries), {plan.steps} steps each; report -> {out}",
              file=stream, flush=True)
        rows = []
        for i, (name, cfg) in enumerate(configs.items()):
            torch.manual_seed(plan.seed * 1000 + i)
            model = Decoder(cfg)
            gen = torch.Generator().manual_seed(plan.seed)  # every variant sees the same batches
            bar = Progress(plan.steps, f"train {name.upper()}")
            t0 = time.perf_counter()
            losses = train(model, plan, gen, bar)
            train_s = time.perf_counter() - t0
            bar.close(f"loss {losses[-1]:.3f}")
            acc_at = {str(n): recall_accuracy(model, *evals[n])[0] for n in plan.eval_pairs}
            acc, per_query = recall_accuracy(model, *evals[t.num_pairs])
            speed = measure_speed(model, plan, torch.Generator().manual_seed(plan.seed + 1))
            quant = measure_quantized(model, plan, evals)
            head = retrieval_head(model, t, example)
            rows.append({"variant": name, "num_kv_heads": cfg.num_kv_heads if name != "mla" else f"latent {cfg.kv_lora_rank}",
                         "params": model.num_parameters(), "kv_bytes_per_token": model.kv_bytes_per_token(),
                         "kv_bytes_per_token_per_layer": model.kv_bytes_per_token() // cfg.num_layers,
                         "accuracy": acc, "accuracy_at": acc_at, "accuracy_per_query": per_query, **speed,
                         "quantized_kv": quant, "train_seconds": train_s,
                         "final_loss": losses[-1], "losses": losses, "config": cfg.to_dict(),
                         "retrieval_head": {k: v for k, v in head.items() if k != "weights"},
                         "_head_weights": head["weights"]})
            print(f"  {name.upper():<4} recall {acc:.1%} (at " + ", ".join(
                      f"{n} pairs: {acc_at[str(n)]:.1%}" for n in plan.eval_pairs[1:]) + f"), decode "
                  f"{speed['decode_tok_s']:.0f} tok/s, "
                  f"KV {model.kv_bytes_per_token():,} B/token; {KV_QUANT} KV: recall {quant['accuracy']:.1%}, decode "
                  f"{quant['decode_tok_s']:.0f} tok/s, {quant['kv_bytes_per_token']:,} B/token", file=stream,
                  flush=True)
        if plan.figures:
            _figures(rows, plan, tmp, _token_labels(t, example[:-1]))
        files = [*REPORT_FILES, *(FIGURES if plan.figures else ())]
        meta = {"command": " ".join(["attnkit demo", *_argv_of(args)]), "date": f"{datetime.now():%Y-%m-%d %H:%M}",
                "attnkit": __version__, "torch": torch.__version__, "python": platform.python_version(),
                "machine": _machine(), "total_seconds": time.perf_counter() - t_start}
        clean = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
        (tmp / "report.md").write_text(_markdown(clean, plan, meta, files))
        plan_d = asdict(plan)
        (tmp / "report.json").write_text(json.dumps({"meta": meta, "plan": plan_d, "results": clean,
                                                      "files": files}, indent=2, default=str))
        _commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(old_threads)
    print("", file=stream)
    print(_terminal_table(clean, plan), file=stream)
    print(f"\nwrote {out}/ ({', '.join(files)}) in {time.perf_counter() - t_start:.0f} s", file=stream, flush=True)
    return out


def _argv_of(args) -> list[str]:
    parts = []
    if args.quick:
        parts.append("--quick")
    if args.out is not None:
        parts += ["--out", str(args.out)]
    if args.seed:
        parts += ["--seed", str(args.seed)]
    if args.variants != ",".join(VARIANTS):
        parts += ["--variants", args.variants]
    if args.steps is not None:
        parts += ["--steps", str(args.steps)]
    if args.pairs is not None:
        parts += ["--pairs", str(args.pairs)]
    if args.threads != 1:
        parts += ["--threads", str(args.threads)]
    if args.no_figures:
        parts.append("--no-figures")
    return parts


def _machine() -> str:
    return f"{cpu_name()}, {os.cpu_count()} cores"
