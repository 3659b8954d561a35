"""The native weight-streaming linear (``torch.ops.attnkit_cpu.linear_rows``) against
``torch.nn.functional.linear`` on the same weights, for the few rows of a decode step.

Shapes (out x in): the projections of the generate suite's decoder (hidden 512, 8 / 2 heads of
64, intermediate 1376, vocab 4096), separate (q, k / v, o, gate / up, down, lm_head) and fused
(qkv, gate_up), and a Llama-7B-like layer (4096 x 4096, 11008 x 4096, 4096 x 11008); M = 1, 2,
4 and 8 rows of x; fp32 and bf16. Each repetition times F.linear, the native op and a plain sum
over an fp32 buffer as large as the weight matrix (the machine's read bandwidth on that working
set) in alternating order; the table reports medians, the weight bytes streamed per second, their
share of that read bandwidth, and which of the two ``attnkit.modules.Linear`` runs for the call
(its rule: ``native_max_rows``).

Prompts (many rows, 16-bit weights): torch's bf16 / fp16 GEMM against the upcast GEMM ``Linear``
runs where this CPU has no 16-bit GEMM unit (``upcast_linear``: the weights widened to fp32 a slab
at a time, fp32 GEMM, one rounding) and against torch's fp32 GEMM over fp32 copies of the weights
(what holding fp32 weights would cost), on the llama.cpp comparison model's projections (hidden
1024) and a Llama-7B-like layer, M = 16 to 512 rows, in GFLOP/s; "Linear runs" is this CPU's rule
(``upcast_min_rows``).

The native library is built for ``-march=native``, or for ``$ATTNKIT_NATIVE_MARCH`` (``haswell``:
the AVX2 code path on an AVX-512 machine); the table names the target.

    python benchmarks/bench_linear.py            # every shape, M 1 / 2 / 4 / 8
    python benchmarks/bench_linear.py --quick    # the decoder's shapes, M 1 and 8, few repetitions
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from _common import bench_main, interleaved_medians, machine, read_probe, skip, timed
from attnkit import native
from attnkit._sysinfo import cpu_flags
from attnkit.modules.linear import native_max_rows, upcast_linear, upcast_min_rows

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 512, 8, 2, 64, 1376, 4096
#: (name, out_features N, in_features K)
DECODER = [
    ("q / o", HEADS * HEAD_DIM, HIDDEN),
    ("k / v", KV_HEADS * HEAD_DIM, HIDDEN),
    ("qkv fused", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    ("gate / up", INTER, HIDDEN),
    ("gate_up fused", 2 * INTER, HIDDEN),
    ("down", HIDDEN, INTER),
    ("lm_head", VOCAB, HIDDEN),
]
LLAMA_7B = [("7B q / o", 4096, 4096), ("7B gate / up", 11008, 4096), ("7B down", 4096, 11008)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run(quick: bool) -> dict:
    ops = native.load()
    if ops is None:
        skip(f"the native kernel is unavailable here: {native.status()}")
    torch.manual_seed(0)
    shapes = DECODER if quick else DECODER + LLAMA_7B
    rows_list = (1, 8) if quick else (1, 2, 4, 8)
    flags = _rule_flags()
    rows = []
    for layer, N, K in shapes:
        for dname, dt in DTYPES.items():
            w = (torch.randn(N, K) / K ** 0.5).to(dt)
            nbytes = w.numel() * w.element_size()
            probe = read_probe(nbytes)
            # Short calls get more repetitions (a short call's median needs many on a shared VM).
            reps = 7 if quick else max(15, min(301, int(3e8 / max(nbytes, 1))))
            for M in rows_list:
                x = torch.randn(M, K).to(dt)
                # The probe sits between the two (the order reverses every repetition): each runs right
                # after it, with the weights partly evicted, as often as right after itself.
                fns = {"torch": timed(lambda: F.linear(x, w)), "read": timed(probe),
                       "native": timed(lambda: ops.linear_rows(x, w, None))}
                with torch.inference_mode():
                    torch.testing.assert_close(ops.linear_rows(x, w, None), F.linear(x, w),
                                               rtol=1e-2 if dt == torch.bfloat16 else 1e-4, atol=1e-3)
                    t = interleaved_medians(fns, reps, warmup=2)
                read = nbytes / t["read"] / 1e9
                rows.append({"layer": layer, "shape": f"{N}x{K}", "M": M, "dtype": dname,
                             "torch_ms": t["torch"] * 1e3, "native_ms": t["native"] * 1e3,
                             "torch_GBps": nbytes / t["torch"] / 1e9, "native_GBps": nbytes / t["native"] / 1e9,
                             "read_GBps": read, "speedup": t["torch"] / t["native"],
                             "linear_runs": "native" if M <= native_max_rows(dt, flags) else "torch"})
    march = _march()
    return {"machine": machine(), "quick": quick, "native_march": march, "rows": rows,
            "prompt_rows": _prompt_rows(quick, flags)}


def _march() -> str:
    return os.environ.get("ATTNKIT_NATIVE_MARCH", "").strip() or "native"


def _rule_flags() -> set[str]:
    """The CPU flags the "Linear runs" columns apply ``Linear``'s rules to: this CPU's, or, for the
    AVX2 build (``ATTNKIT_NATIVE_MARCH=haswell``, best run with torch's libraries held to AVX2 as
    well: ``ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2``), this
    CPU's without its AVX-512 and AMX ones: an AVX2 CPU's."""
    flags = set(cpu_flags())
    if _march() == "haswell":
        flags = {f for f in flags if not f.startswith(("avx512", "amx"))}
    return flags


#: The llama.cpp comparison model's projections (benchmarks/bench_llamacpp.py: hidden 1024, 16 / 4
#: heads of 64, intermediate 2816), fused as the decoder loads them.
PROMPT_SHAPES = [("qkv fused", 1536, 1024), ("gate_up fused", 5632, 1024), ("down", 1024, 2816)]
PROMPT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _prompt_rows(quick: bool, flags) -> list[dict]:
    shapes = PROMPT_SHAPES[1:2] if quick else PROMPT_SHAPES + LLAMA_7B[1:]
    rows = []
    for layer, N, K in shapes:
        for dname, dt in PROMPT_DTYPES.items():
            w = (torch.randn(N, K) / K ** 0.5).to(dt)
            wf = w.float()
            from_rows = upcast_min_rows(dt, flags)
            for M in ((16, 128) if quick else (16, 64, 128, 512)):
                x = torch.randn(M, K).to(dt)
                fns = {"torch": timed(lambda: F.linear(x, w)), "upcast": timed(lambda: upcast_linear(x, w, None)),
                       "fp32": timed(lambda: F.linear(x.float(), wf))}
                with torch.inference_mode():
                    torch.testing.assert_close(upcast_linear(x, w, None), F.linear(x, w), rtol=2e-2, atol=2e-2)
                    t = interleaved_medians(fns, 3 if quick else 7, warmup=1)
                flop = 2 * M * N * K
                rows.append({"layer": layer, "shape": f"{N}x{K}", "M": M, "dtype": dname,
                             **{f"{k}_ms": v * 1e3 for k, v in t.items()},
                             **{f"{k}_GFLOPs": flop / v / 1e9 for k, v in t.items()},
                             "speedup": t["torch"] / t["upcast"],
                             "linear_runs": "upcast" if from_rows is not None and M >= from_rows else "torch"})
    return rows


def to_markdown(res: dict) -> str:
    m = res["machine"]
    lines = [
        f"Machine: {m['cpu']} ({m.get('isa', '?')}), {m['cores']} cores ({m['torch_threads']} torch threads), "
        f"torch {m['torch']}, attnkit {m['attnkit']}, Python {m['python']}; native library built for "
        f"-march={res['native_march']}. M rows of x against an N x K weight matrix (shape N x K); medians of "
        "interleaved runs; GB/s = weight bytes / time; share = that over the machine's read GB/s (a plain sum over "
        "an fp32 buffer as large as the weights, timed in the same runs); speedup = F.linear time / native time. "
        "Linear runs: which of the two `attnkit.modules.Linear` gives the call to on this CPU (`native_max_rows`).",
        "",
        "| layer | shape | M | dtype | F.linear ms | native ms | speedup | F.linear GB/s | native GB/s | read GB/s | "
        "F.linear share | native share | Linear runs |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['layer']} | {r['shape']} | {r['M']} | {r['dtype']} | {r['torch_ms']:.3f} | "
                     f"{r['native_ms']:.3f} | {r['speedup']:.2f}x | {r['torch_GBps']:.1f} | {r['native_GBps']:.1f} | "
                     f"{r['read_GBps']:.1f} | {100 * r['torch_GBps'] / r['read_GBps']:.0f}% | "
                     f"{100 * r['native_GBps'] / r['read_GBps']:.0f}% | {r['linear_runs']} |")
    lines += [
        "",
        "Prompts, 16-bit weights: torch's 16-bit GEMM (`F.linear`), the upcast GEMM (`upcast_linear`: weights "
        "widened to fp32 a slab at a time, fp32 GEMM, one rounding) and torch's fp32 GEMM over fp32 copies of the "
        "weights (x widened in the call); GFLOP/s = 2 M N K / time; speedup = F.linear time / upcast time; Linear "
        "runs: this CPU's rule (`upcast_min_rows`).",
        "",
        "| layer | shape | M | dtype | F.linear 16-bit GFLOP/s | upcast GFLOP/s | F.linear fp32 GFLOP/s | speedup | "
        "Linear runs |",
        "|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in res.get("prompt_rows", []):
        lines.append(f"| {r['layer']} | {r['shape']} | {r['M']} | {r['dtype']} | {r['torch_GFLOPs']:.0f} | "
                     f"{r['upcast_GFLOPs']:.0f} | {r['fp32_GFLOPs']:.0f} | {r['speedup']:.2f}x | {r['linear_runs']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return bench_main(argv, __doc__, "linear", run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
