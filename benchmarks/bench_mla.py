"""Multi-head latent attention decode: the absorbed latent cache vs two ways of keeping per-head K/V.

One DeepSeek-V2-Lite attention layer (hidden 2048, 16 heads, kv_lora_rank 512, rope 64, nope 128,
v 128, no query compression), batch 1, one decode step after a context of C tokens:

* ``absorbed``: attnkit's MultiHeadLatentAttention(mode="absorb") over the latent cache (576
  values per token): W_UK folded into the query, W_UV into the output, MQA over one latent head.
* ``expanded``: a per-head K/V cache (16 heads x (192 + 128) = 5,120 values per token), the layout
  Hugging Face's DeepSeek-V2 remote code and vLLM's non-MLA path keep: each step expands only the
  new token and attends over the stored per-head K/V (same attnkit attention core).
* ``re-expand``: the latent cache, re-expanded to per-head K/V every step (mode="naive"; what
  Hugging Face transformers 5.x's DeepseekV3Attention does with its cache).

Absorption's per-head matmuls (q_nope @ W_UK, out_latent @ W_UV^T) in bf16 at 16 and 128 heads
(DeepSeek-V3's), 1 to 256 rows: torch's bf16 GEMM against widening both operands to fp32 first;
"MLA runs" is this CPU's rule (``half_gemm_unit``: widen only without a 16-bit GEMM unit).

The cache is filled directly with random latents (a 16k-token prefill would dominate the run);
each measured step is rolled back with ``cache.crop(-1)`` so every repetition sees C tokens.
The three steps' outputs are checked to agree before timing. Contenders run interleaved; medians.

    python benchmarks/bench_mla.py           # contexts 1k, 4k, 16k; bf16 and fp32
    python benchmarks/bench_mla.py --quick   # small sizes, seconds
    python benchmarks/bench_mla.py --threads 1   # one torch thread (a busy shared machine)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from _common import bench_main, interleaved_medians, machine
from attnkit import DynamicCache
from attnkit.modules import mla as mla_module
from attnkit.modules.mla import MLAConfig, MultiHeadLatentAttention

LITE = dict(hidden_size=2048, num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, q_lora_rank=None)
QUICK = dict(hidden_size=256, num_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
             v_head_dim=32, q_lora_rank=None)


def _linear(x, w):
    """x @ w.T rounded once to x's dtype; fp32 compute for fp16/bf16 on CPU (no fast half GEMM
    there), so the expanded contender's per-token expansion is not handicapped."""
    if x.device.type == "cpu" and x.dtype in (torch.float16, torch.bfloat16):
        return torch.nn.functional.linear(x.float(), w.float()).to(x.dtype)
    return torch.nn.functional.linear(x, w)


class ExpandedDecoder:
    """Decode with a per-head K/V cache, built from the module's own weights and pieces."""

    def __init__(self, m: MultiHeadLatentAttention, latent: torch.Tensor):
        self.m = m
        c = m.config
        self.cache = DynamicCache(c.num_heads, c.qk_head_dim, c.v_head_dim, dtype=latent.dtype)
        r, H = c.kv_lora_rank, c.num_heads
        L = latent.shape[2]
        kv = _linear(latent[:, 0, :, :r], m.kv_b_proj.weight).view(1, L, H, -1).transpose(1, 2)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], -1)
        k = torch.cat((k_nope, latent[..., r:].expand(1, H, L, -1)), -1)
        self.cache.update(k, v.contiguous())

    def core(self, q_nope, q_pe, latent) -> torch.Tensor:
        """Between the projections: expand the new token, append it, attend -> (B, H, S, dv)."""
        m, c = self.m, self.m.config
        B, _, S, _ = latent.shape
        kv = _linear(latent[:, 0, :, :c.kv_lora_rank], m.kv_b_proj.weight).view(B, S, c.num_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], -1)
        k = torch.cat((k_nope, latent[..., c.kv_lora_rank:].expand(B, c.num_heads, S, -1)), -1)
        return self.cache.attend(torch.cat((q_nope, q_pe), -1), k, v.contiguous(), scale=c.softmax_scale)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        out = self.core(*self.m.project(x, self.cache.positions(x.shape[1])))
        return self.m.o_proj(out.transpose(1, 2).flatten(2))


def _random_latent(m: MultiHeadLatentAttention, ctx: int, dtype, seed: int) -> torch.Tensor:
    """(1, 1, ctx, r + dr): RMS-normalised c_kv (what kv_a_layernorm gives) and a rope key."""
    g = torch.Generator().manual_seed(seed)
    c = m.config
    c_kv = torch.randn(1, 1, ctx, c.kv_lora_rank, generator=g)
    k_pe = torch.randn(1, 1, ctx, c.qk_rope_head_dim, generator=g)
    return torch.cat((c_kv, k_pe), -1).to(dtype)


def _step_timer(fn, cache, *args):
    def run() -> float:
        t0 = time.perf_counter()
        fn(*args)
        dt = time.perf_counter() - t0
        cache.crop(-1)  # back to the same context for the next repetition (not timed)
        return dt
    return run


def run(quick: bool) -> dict:
    dims = QUICK if quick else LITE
    contexts = (256, 1024) if quick else (1024, 4096, 16384)
    reps, slow_reps = (3, 2) if quick else (15, 3)
    cfg = MLAConfig(**dims)
    rows = []
    load_start = os.getloadavg()[0]
    for dname, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        torch.manual_seed(0)
        m = MultiHeadLatentAttention(cfg, mode="absorb").to(dtype).eval()
        for ctx in contexts:
            latent = _random_latent(m, ctx, dtype, seed=ctx)
            x = torch.randn(1, 1, cfg.hidden_size, dtype=dtype)
            with torch.inference_mode():
                lat_a, lat_n = m.new_cache(), m.new_cache()
                lat_a.update(latent, None)
                lat_n.update(latent, None)
                exp = ExpandedDecoder(m, latent)
                proj = m.project(x, torch.tensor([[ctx]]))  # the new token's q_nope, q_pe, latent
                steps = {  # whole layer: x -> out (B, 1, E)
                    "absorbed": (lambda t: m(t, cache=lat_a), lat_a),
                    "expanded": (exp.step, exp.cache),
                    "re-expand": (lambda t: _naive_layer(m, t, lat_n), lat_n),
                }
                cores = {  # between the projections every contender shares
                    "absorbed": (lambda *p: m.attend_latent(*p, cache=lat_a, mode="absorb"), lat_a),
                    "expanded": (exp.core, exp.cache),
                    "re-expand": (lambda *p: m.attend_latent(*p, cache=lat_n, mode="naive"), lat_n),
                }
                outs = {}
                for name, (fn, cache) in steps.items():
                    outs[name] = fn(x)
                    cache.crop(-1)
                tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
                for name in ("expanded", "re-expand"):
                    torch.testing.assert_close(outs[name].float(), outs["absorbed"].float(), atol=tol, rtol=tol)
                row = {"dtype": dname, "context": ctx}
                for label, group, args in (("layer", steps, (x,)), ("core", cores, proj)):
                    t = interleaved_medians({n: _step_timer(fn, c, *args) for n, (fn, c) in group.items()
                                             if n != "re-expand"}, reps, warmup=2)
                    fn, c = group["re-expand"]
                    t.update(interleaved_medians({"re-expand": _step_timer(fn, c, *args)}, slow_reps, warmup=1))
                    row.update({f"{n}_{label}_ms": v * 1e3 for n, v in t.items()})
            for name, cache in (("absorbed", lat_a), ("expanded", exp.cache), ("re-expand", lat_n)):
                row[f"{name}_cache_mb"] = cache.bytes_per_token * ctx / 2 ** 20
            rows.append(row)
            print(f"  {dname} ctx={ctx}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k.endswith("_ms")),
                  flush=True)
            del exp, lat_a, lat_n
    # The load average says how shared the machine was (other jobs skew absolute times; the
    # interleaved ratios much less).
    return {"machine": machine(), "quick": quick, "dims": dims, "rows": rows, "per_head": _per_head_rows(quick),
            "load_average": [load_start, os.getloadavg()[0]]}


def _per_head_rows(quick: bool) -> list[dict]:
    """Each absorbed product in bf16, as torch's bf16 GEMM and widened to fp32 (the module's
    ``_PER_HEAD_UPCAST`` set both ways around the same call), interleaved."""
    d = QUICK if quick else LITE
    dn, dv, r = d["qk_nope_head_dim"], d["v_head_dim"], d["kv_lora_rank"]
    rows = []
    here = mla_module._PER_HEAD_UPCAST
    for H in ((4,) if quick else (16, 128)):
        w = torch.randn(H, dn + dv, r).bfloat16()  # kv_b_proj's weight as (H, dn + dv, r)
        w_uk, w_uv = w[:, :dn], w[:, dn:]
        for n in ((1, 16) if quick else (1, 16, 256)):
            x, o = torch.randn(1, H, n, dn).bfloat16(), torch.randn(1, H, n, r).bfloat16()
            for product, fn in (("q_nope @ W_UK", lambda: mla_module._per_head_matmul(x, w_uk)),
                                ("out_latent @ W_UV^T", lambda: mla_module._per_head_matmul(o, w_uv, w_transposed=True))):
                def timed_as(widen, fn=fn):
                    def call():
                        mla_module._PER_HEAD_UPCAST = frozenset({torch.bfloat16}) if widen else frozenset()
                        try:
                            t0 = time.perf_counter()
                            fn()
                            return time.perf_counter() - t0
                        finally:
                            mla_module._PER_HEAD_UPCAST = here
                    return call
                with torch.inference_mode():
                    t = interleaved_medians({"bf16": timed_as(False), "widened": timed_as(True)}, 3 if quick else 9,
                                            warmup=1)
                rows.append({"heads": H, "rows": n, "product": product, "bf16_ms": t["bf16"] * 1e3,
                             "widened_ms": t["widened"] * 1e3,
                             "mla_runs": "widened" if torch.bfloat16 in here else "bf16"})
    return rows


def _naive_layer(m, x, cache):
    """A whole layer step forced through the naive path (m is built with mode="absorb")."""
    m.mode = "naive"
    try:
        return m(x, cache=cache)
    finally:
        m.mode = "absorb"


def to_markdown(res: dict) -> str:
    m, d = res["machine"], res["dims"]
    E, H, r, dr = d["hidden_size"], d["num_heads"], d["kv_lora_rank"], d["qk_rope_head_dim"]
    dqk, dv, rq = d["qk_nope_head_dim"] + dr, d["v_head_dim"], d["q_lora_rank"]
    shared = (E * H * dqk if rq is None else E * rq + rq * H * dqk) + E * (r + dr) + H * dv * E
    macs_abs, macs_exp = H * (2 * r + dr), H * (dqk + dv)
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, attnkit {m['attnkit']}. "
             f"One MLA layer (hidden {d['hidden_size']}, {d['num_heads']} heads, kv_lora_rank {d['kv_lora_rank']}, "
             f"rope {d['qk_rope_head_dim']}, nope {d['qk_nope_head_dim']}, v {d['v_head_dim']}, no q compression), "
             "B=1, one decode step after `context` tokens; medians of interleaved runs. "
             f"torch threads {m['torch_threads']}; 1-minute load average {res['load_average'][0]:.1f} at the start, "
             f"{res['load_average'][1]:.1f} at the end.",
             "",
             "*layer*: the whole step, x -> output, including the q / kv_a / o projections that all three share "
             f"(at B=1 they read the same {shared * 4 / 2 ** 20:.1f} MB of weights every step in fp32, half that "
             "in bf16). *core*: what differs, the step between those projections (absorption or expansion, cache "
             "append, attention, W_UV). Speed-up = contender ms / absorbed ms.", "",
             f"Per cached token the absorbed attention does {macs_abs:,} multiply-adds (H * (2r + dr)) over "
             f"{r + dr} stored values, the expanded one {macs_exp:,} (H * (dqk + dv)) over {H * (dqk + dv):,}: "
             f"{macs_abs / macs_exp:.1f}x the arithmetic for {H * (dqk + dv) / (r + dr):.1f}x fewer bytes, so "
             "where the latent attention is compute-bound (a CPU core) the step gains less than the cache shrinks.",
             "",
             "| dtype | context | absorbed layer ms | expanded layer ms | re-expand layer ms | absorbed core ms "
             "| expanded core ms | re-expand core ms | vs expanded (layer / core) | vs re-expand (layer / core) "
             "| latent cache MB | expanded cache MB | cache ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        a_l, a_c = r["absorbed_layer_ms"], r["absorbed_core_ms"]
        lines.append(
            f"| {r['dtype']} | {r['context']} | {a_l:.2f} | {r['expanded_layer_ms']:.2f} "
            f"| {r['re-expand_layer_ms']:.2f} "
            f"| {a_c:.2f} | {r['expanded_core_ms']:.2f} | {r['re-expand_core_ms']:.2f} "
            f"| {r['expanded_layer_ms'] / a_l:.2f}x / {r['expanded_core_ms'] / a_c:.2f}x "
            f"| {r['re-expand_layer_ms'] / a_l:.1f}x / {r['re-expand_core_ms'] / a_c:.1f}x "
            f"| {r['absorbed_cache_mb']:.2f} | {r['expanded_cache_mb']:.2f} "
            f"| {r['expanded_cache_mb'] / r['absorbed_cache_mb']:.1f}x |")
    lines += ["", "Absorption's per-head matmuls in bf16 (kv_lora_rank "
              f"{d['kv_lora_rank']}, nope {d['qk_nope_head_dim']}, v {d['v_head_dim']}): torch's bf16 GEMM against "
              "widening both operands to fp32 first; MLA runs: this CPU's rule (`half_gemm_unit`).", "",
              "| heads | rows | product | bf16 ms | widened ms | widened / bf16 | MLA runs |",
              "|---:|---:|---|---:|---:|---:|---|"]
    for p in res.get("per_head", []):
        lines.append(f"| {p['heads']} | {p['rows']} | {p['product']} | {p['bf16_ms']:.3f} | {p['widened_ms']:.3f} "
                     f"| {p['widened_ms'] / p['bf16_ms']:.2f}x | {p['mla_runs']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    # --threads N (not in bench_main's options): on a small shared machine, one thread per
    # process keeps OpenMP barriers from stalling on descheduled peers; the table records it.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--threads", type=int, default=None)
    known, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.threads:
        torch.set_num_threads(known.threads)
    return bench_main(rest, __doc__, "mla", run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
