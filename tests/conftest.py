"""Shared test helpers: the tolerance rule R (docs/testing.md), the eager baseline, and input makers."""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. It is read when a
# kernel is defined, so it must be set before anything imports attnkit.backends.triton.kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attnkit
from attnkit.masks import as_mask
from attnkit.reference import safe_softmax

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Backends that run inference only (they refuse calls that need gradients): forward checks only.
INFERENCE_ONLY = {"decode", "paged", "triton"}


def base_attention(q, k, v, mask=None, *, causal=False, scale=None, softcap=None, sinks=None):
    """The plain eager implementation everyone writes, in the input dtype: scores from a matmul
    in q's dtype, softmax in fp32, probabilities cast back, K/V repeated per head (soft-capping
    and sinks the way Gemma 2's and gpt-oss's eager code apply them)."""
    m = as_mask(mask, causal)
    B, Hq, Sq, D = q.shape
    G = Hq // k.shape[1]
    scale = 1 / math.sqrt(D) if scale is None else scale
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ kk.transpose(-1, -2)).float() * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    row_ok = None
    if m is not None:
        b = m.bias(B, Sq, k.shape[2], q.device)
        if b is not None:
            s = s + b.float()
        allowed = m.materialize(B, Sq, k.shape[2], q.device)
        s = s.masked_fill(~allowed, float("-inf"))
        row_ok = allowed.any(-1, keepdim=True)
    if sinks is not None:
        rows = sinks.view(1, Hq, 1, 1) if sinks.dim() == 1 else sinks.reshape(-1, Hq, Sq, 1)  # per head / per query
        sink = rows.float().expand(*s.shape[:-1], 1)
        p = safe_softmax(torch.cat([s, sink], -1), row_ok=row_ok)[..., :-1].to(q.dtype)
    else:
        p = safe_softmax(s, row_ok=row_ok).to(q.dtype)
    return p @ vv


def _err(x, gold):
    return (x.double() - gold).abs().max().item() if x.numel() else 0.0


def rule_r(ours, base, gold, *, factor=2.0, what="out", n_terms=1):
    """Assert rule R (docs/testing.md): E(ours) <= factor * E(base) + floor; no NaN/Inf.

    floor = the larger of (a) twice the rounding of ``(gold + 0.3) - 0.3`` in the target dtype
    and (b) the honest accumulation noise of a sum of ``n_terms`` terms in that dtype,
    ``8 * eps * sqrt(n_terms) * max|gold|``. (b) is what a different but correct summation
    order (a GQA group summed in one GEMM, SDPA's tiles, another CPU's kernels) can move a
    result by; without it a base that happens to be unusually close to gold on one machine
    would make a correct kernel fail on another (AMD vs Intel rounding differs)."""
    assert ours.shape == gold.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(gold.shape)}"
    assert torch.isfinite(ours).all(), f"{what}: NaN or Inf in result"
    dt = ours.dtype
    g = gold.to(dt)
    floor = 2 * _err(((g + 0.3) - 0.3), gold) if gold.numel() else 0.0
    if gold.numel():
        floor = max(floor, 8 * torch.finfo(dt).eps * math.sqrt(max(1, n_terms)) * gold.abs().max().item())
    # A gold that is exactly 0 everywhere (dq when each query sees one key) gets no rounding
    # floor from 0.3 - 0.3; allow 1e-6, far below fp16/bf16 resolution at 1.
    floor = max(floor, 1e-6)
    e_ours, e_base = _err(ours, gold), _err(base, gold)
    bound = factor * e_base + floor
    assert e_ours <= bound, (f"{what}: rule R failed: E(ours)={e_ours:.3e} > {factor}*E(base)={e_base:.3e} "
                             f"+ floor={floor:.3e}; ratio E(ours)/E(base)={e_ours / max(e_base, 1e-300):.2f}")


def check_against_oracle(q, k, v, mask=None, *, causal=False, scale=None, backend="auto", grad=True,
                         softcap=None, sinks=None):
    """Run attnkit.attention, the eager base and the fp64 oracle on the same inputs and apply
    rule R to the output and (with ``grad``) dq, dk, dv under a random upstream gradient.
    Inference-only backends (:data:`INFERENCE_ONLY`) are checked forward only."""
    grad = grad and backend not in INFERENCE_ONLY
    sink_sets = [None, None, None] if sinks is None else \
        [sinks.detach().clone().float().requires_grad_(grad) for _ in range(2)] + [sinks.detach().double().requires_grad_(grad)]
    leaves = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
    gold_leaves = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
    base_leaves = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
    out = attnkit.attention(*leaves, mask, causal=causal, scale=scale, backend=backend, softcap=softcap,
                            sinks=sink_sets[0])
    gold = attnkit.attention_reference(*gold_leaves, mask, causal=causal, scale=scale, softcap=softcap,
                                       sinks=sink_sets[2])
    base = base_attention(*base_leaves, mask, causal=causal, scale=scale, softcap=softcap, sinks=sink_sets[1])
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    rule_r(out, base, gold, n_terms=max(Sk, D))
    if not grad or out.numel() == 0:
        return out
    dout = torch.randn_like(gold)
    for o, ls in ((out, leaves), (gold, gold_leaves), (base, base_leaves)):
        o.backward(dout.to(o.dtype))
    # dq sums over keys; dk and dv over the queries of every head in the KV head's group.
    terms = {"dq": Sk, "dk": Sq * (Hq // Hkv), "dv": Sq * (Hq // Hkv)}
    for name, i, factor in (("dq", 0, 3.0), ("dk", 1, 2.0), ("dv", 2, 2.0)):
        rule_r(leaves[i].grad, base_leaves[i].grad, gold_leaves[i].grad, factor=factor, what=name,
               n_terms=terms[name])
    if sinks is not None:  # d(sinks) sums over every row of the head
        rule_r(sink_sets[0].grad, sink_sets[1].grad, sink_sets[2].grad, factor=3.0, what="dsinks",
               n_terms=B * Sq * Sk)
    return out


def make_qkv(B, Hq, Hkv, Sq, Sk, D, Dv=None, dtype=torch.float32, *, dist="randn", seed=0):
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv

    def mk(*shape):
        if dist == "randn":
            t = torch.randn(*shape, generator=g, dtype=torch.float64)
        else:
            t = torch.rand(*shape, generator=g, dtype=torch.float64)
        return t.to(dtype)

    return mk(B, Hq, Sq, D), mk(B, Hkv, Sk, D), mk(B, Hkv, Sk, Dv)


#: The start of every ahead-of-time compile script (:func:`compile_ahead` runs them): imports,
#: ``kernel_params`` (a kernel's constexprs, its int arguments, and the 16-byte divisibility hints a
#: real launch specialises on) and ``ptxas_report`` (registers and spill bytes of the compiled PTX).
AOT_PREAMBLE = r"""
import collections, inspect, json, os, re, subprocess, sys, tempfile, torch, triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability


def kernel_params(fn, ptrs, floats, sizes):
    # (constexpr names, int argument names, divisibility attrs) of the @triton.jit ``fn``: pointers,
    # strides and the named ``sizes`` get the 16-byte hints a real launch specialises on.
    params = inspect.signature(fn.fn).parameters
    consts = [n for n, p in params.items() if "constexpr" in str(p.annotation)]
    ints = [n for n in params if n not in consts and n not in ptrs and n not in floats]
    aligned = sorted(ptrs) + [n for n in ints if n.startswith("stride")] + list(sizes)
    return consts, ints, {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}


def ptxas_report(ptx, cap):
    # ptxas -v on the kernel's PTX: (spill bytes, registers) (the metadata holds them only once a GPU
    # driver has loaded the binary).
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([get_ptxas(cap).path, "-v", "--regAllocOptLevel=2",
                            f"--gpu-name={sm_arch_from_capability(cap)}", src, "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True, check=True)
    log = r.stdout + r.stderr
    assert "spill" in log and "registers" in log, log
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    regs = max((int(n) for n in re.findall(r"Used (\d+) registers", log)), default=-1)
    return spills, regs

"""


def compile_ahead(script: str, cases: list) -> list:
    """Run ``script`` (a Triton ahead-of-time compile for CUDA, which needs no GPU) in a child
    process with ``cases`` as its JSON argument, and return the JSON list it prints last. A child,
    because this process's Triton may be in interpreter mode, which cannot compile; the test is
    skipped where this Triton has no CUDA backend or ptxas."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True, env=env,
                       timeout=600)
    if r.returncode:
        tail = r.stderr.strip().splitlines()[-1:] or ["?"]
        if "ptxas" in r.stderr or "GPUTarget" in r.stderr or "cuda" in tail[0].lower():
            pytest.skip(f"this triton cannot compile for CUDA here: {tail[0][:120]}")
        raise AssertionError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def scattered_table(lens, page: int, rng, *, fill: int = 0, spare: int = 0) -> tuple[torch.Tensor, int]:
    """A (B, W + spare) int32 block table giving sequence b ``ceil(lens[b] / page)`` blocks of a
    pool in a shuffled order (``rng``: a ``random.Random``), ``fill`` past them; and the pool's
    block count N (3 spare blocks no sequence uses)."""
    need = [-(-n // page) for n in lens]
    N = sum(need) + 3
    order = list(range(N))
    rng.shuffle(order)
    table = torch.full((len(lens), max(1, max(need)) + spare), fill, dtype=torch.int32)
    it = iter(order)
    for b, nb in enumerate(need):
        for i in range(nb):
            table[b, i] = next(it)
    return table, N


def stable_seed(*parts) -> int:
    """A seed from test parameters that is the same in every process (hash() is salted)."""
    return zlib.crc32(repr(parts).encode()) % 10_000


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["native", "torch"])
def implementation(request, monkeypatch):
    """Which implementation the split-K engine runs: the compiled kernel, or the torch fallback."""
    from attnkit import native

    if request.param == "torch":
        monkeypatch.setattr(native, "load", lambda: None)
        monkeypatch.setenv("ATTNKIT_NATIVE", "0")  # what describe_call predicts before anything loads
    elif native.status() != "native":
        pytest.skip(f"no native kernel here: {native.status()}")
    return request.param
