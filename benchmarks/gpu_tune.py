"""Tune the Triton decode kernel's launch parameters on this GPU and write them to the table the
kernel reads at run time (``src/attnkit/backends/triton/tuned.json``, keyed by architecture).

For each kernel shape below, every candidate (keys per tile x warps x stages) runs the shape's
decode steps; the fastest by the geometric mean over the steps is recorded. The same run times
SDPA over a contiguous copy of the cache and a device-to-device copy, so the table beside the
choice says how far the kernel is from both. A candidate the GPU cannot run (shared memory,
registers) is listed with its error and skipped.

    python benchmarks/gpu_tune.py                 # tune and write the table (a CUDA GPU)
    python benchmarks/gpu_tune.py --dry-run       # tune, print, write nothing
    python benchmarks/gpu_tune.py --quick         # tiny shapes, two candidates, no table: CPU allowed
                                                  # (Triton's interpreter; the CI's smoke test)
    python benchmarks/gpu_check.py --tune         # the same, as gpu_check's first step
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_gpu import (DEV, _random_ids, _select_call, contiguous_from_pool, copy_bandwidth, kernel_call, median_ms,
                       scattered_pool)
from attnkit.backends.triton import tuning

#: (name, dtype, B, Hq, Hkv, D, Dv (None: V from K), page, contexts): the shapes of the GPU check.
#: ``mla-sel``: DeepSeek-V3.2's sparse decode, each query's top SELECTED keys over the context.
SHAPES = [
    ("gqa", torch.bfloat16, 32, 32, 8, 128, 128, 16, (4096, 32768)),
    ("mla", torch.bfloat16, 32, 128, 1, 576, None, 64, (4096, 32768)),
    ("mla-sel", torch.bfloat16, 64, 128, 1, 576, None, 64, (32768,)),
]
#: Keys each query of a ``-sel`` shape selects (DSA's top-k).
SELECTED = 2048
CANDIDATES = {"BLOCK_N": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4)}
#: The lean MLA kernel's (attnkit.backends.triton.latent): a 64 x 512 fp32 accumulator per program,
#: so few keys per tile (16 is its own choice; 32 and 64 spill registers when compiled ahead, but
#: may still win on the GPU) and 8 warps (4 would hold 256 accumulator registers a thread).
CANDIDATES_LATENT = {"BLOCK_N": (16, 32, 64), "num_warps": (8,), "num_stages": (1, 2, 3)}
#: --quick: tiny shapes of both kinds and two candidates (the interpreter on CPU).
SHAPES_QUICK = [
    ("gqa", torch.float32, 2, 4, 2, 32, 32, 16, (64,)),
    ("mla", torch.float32, 2, 8, 1, 48, None, 16, (64,)),
    ("mla-sel", torch.float32, 2, 8, 1, 48, None, 16, (64,)),
]
CANDIDATES_QUICK = {"BLOCK_N": (16, 32), "num_warps": (4,), "num_stages": (2,)}


def _steps(shape, dev):
    """(the kernel's step per context, SDPA's step per context, K/V bytes per context)."""
    name, dtype, B, Hq, Hkv, D, Dv, page, contexts = shape
    steps, sdpa, nbytes = [], [], []
    for ctx in contexts:
        kp, table = scattered_pool(B, ctx, page, Hkv, D, dtype, seed=1)
        vp = None if Dv is None else scattered_pool(B, ctx, page, Hkv, Dv, dtype, seed=2)[0]
        q = torch.randn(B, Hq, 1, D, dtype=dtype, device=dev)
        seq = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        dv = D - _rope(D) if Dv is None else Dv
        scale = (192 if Dv is None else D) ** -0.5
        if name.endswith("-sel"):  # the selected keys only; SDPA below is dense over the context (a reference)
            ids = _random_ids(B, 1, ctx, min(SELECTED, ctx // 2), seed=3)
            steps.append(_select_call(q, kp, vp, table, ctx, ids, scale, dv))
        else:
            steps.append(kernel_call(q, kp, vp, table, seq, seq - 1, scale, dv, ctx))
        k = contiguous_from_pool(kp, table, ctx)
        v = k[..., :dv] if vp is None else contiguous_from_pool(vp, table, ctx)
        sdpa.append(lambda q=q, k=k, v=v, s=scale: F.scaled_dot_product_attention(q, k, v, scale=s, enable_gqa=True))
        keys = min(SELECTED, ctx // 2) if name.endswith("-sel") else ctx
        nbytes.append(B * keys * Hkv * (D + (0 if vp is None else Dv)) * kp.element_size())  # read once
    return steps, sdpa, nbytes


def _rope(D: int) -> int:
    """MLA's rope channels past the latent: 64 of 576; a quarter of a small latent."""
    return 64 if D >= 256 else D // 4


def _lean(shape) -> bool:
    """Whether the lean MLA kernel serves the shape's calls (its own table key and candidates)."""
    from attnkit.backends.triton import latent

    name, dtype, B, Hq, Hkv, D, Dv, page, contexts = shape
    dv = D - _rope(D) if Dv is None else Dv
    return latent.takes(dtype, D, dv, Hkv, Dv is None, page, max(contexts), selection=name.endswith("-sel"))


def tune_shape(shape, dev, reps: int, candidates: dict) -> dict:
    name, dtype, B, Hq, Hkv, D, Dv, page, contexts = shape
    dv = D - _rope(D) if Dv is None else Dv
    lean = _lean(shape)
    key = tuning.shape_key(dtype, D, dv, Dv is None, None, selection=name.endswith("-sel"), latent=lean)
    if lean and candidates is CANDIDATES:
        candidates = CANDIDATES_LATENT
    steps, sdpa, nbytes = _steps(shape, dev)
    results = []
    for values in itertools.product(*candidates.values()):
        entry = dict(zip(candidates, values))
        try:
            with tuning.forced(entry):
                times = [median_ms(step, reps) for step in steps]
        except Exception as e:  # noqa: BLE001 - Triton's OutOfResources, compile errors: listed, skipped
            results.append({**entry, "error": str(e).splitlines()[0][:120]})
            continue
        results.append({**entry, "ms": times, "geomean_ms": math.exp(sum(map(math.log, times)) / len(times))})
    ok = [r for r in results if "ms" in r]
    if not ok:
        raise RuntimeError(f"no candidate ran for {key}: {results}")
    best = min(ok, key=lambda r: r["geomean_ms"])
    default = [median_ms(step, reps) for step in steps]  # the kernel's own rule, no table entry forced
    sdpa_ms = []
    for fn in sdpa:
        try:
            sdpa_ms.append(median_ms(fn, max(3, reps // 5)))
        except RuntimeError:
            sdpa_ms.append(None)
    return {"name": name, "key": key, "contexts": list(contexts), "best": {k: best[k] for k in candidates},
            "best_ms": best["ms"], "default_ms": default, "sdpa_contiguous_ms": sdpa_ms,
            "kv_bytes": nbytes, "candidates": results}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the choices, write no table")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="also write the run's JSON here")
    p.add_argument("--quick", action="store_true", help="tiny shapes, two candidates, no table written")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.quick:
        print("skipped: tuning needs a CUDA GPU (--quick runs the interpreter on CPU)", file=sys.stderr)
        return 0
    dev = torch.device(DEV)
    arch = tuning.arch_of(dev) if dev.type == "cuda" else "interpreter"
    dry = args.dry_run or args.quick
    t0 = time.perf_counter()
    copy_gbs = copy_bandwidth(1 << (20 if args.quick else 32), 3 if args.quick else 10)
    reps = 2 if args.quick else args.reps
    rows = [tune_shape(s, dev, reps, CANDIDATES_QUICK if args.quick else CANDIDATES)
            for s in (SHAPES_QUICK if args.quick else SHAPES)]
    for r in rows:
        gbs = [b / (t * 1e-3) / 1e9 for b, t in zip(r["kv_bytes"], r["best_ms"])]
        print(f"{arch} {r['key']}: best {r['best']} -> " + ", ".join(
            f"ctx {c}: {t:.3f} ms ({g:.0f} GB/s, {g / copy_gbs:.0%} of copy; default {d:.3f} ms; SDPA contiguous "
            f"{'n/a' if s is None else f'{s:.3f} ms'})"
            for c, t, g, d, s in zip(r["contexts"], r["best_ms"], gbs, r["default_ms"], r["sdpa_contiguous_ms"])))
        if not dry:
            tuning.record(arch, r["key"], r["best"])
    res = {"arch": arch, "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "none (CPU)",
           "torch": torch.__version__,
           "copy_GBps": copy_gbs, "seconds": time.perf_counter() - t0, "rows": rows}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tune.json").write_text(json.dumps(res, indent=1))
    print(f"tuned in {res['seconds']:.0f} s" + ("" if dry else f"; wrote {tuning.TABLE}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
