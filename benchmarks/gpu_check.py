"""The whole GPU side of attnkit in one command, for the short windows a GPU is at hand.

    python benchmarks/gpu_check.py --out DIR            # on a CUDA machine: at most about 9 minutes
    python benchmarks/gpu_check.py --quick --out DIR    # on CPU, Triton in its interpreter: a smoke test (CI)
    python benchmarks/gpu_check.py --tune --out DIR     # tune the Triton kernel first (gpu_tune.py, < 5 min)

A device call is cut at 10 minutes, and tuning plus the whole check takes longer: on a lent GPU,
tune in one call (``--tune --skip tests sweep bench``), commit the table it wrote, then run the
check in the next call.

It runs, in order, each step with its own time limit so that one hang cannot eat the window:

1. the environment: GPU, compute capability, torch / CUDA / Triton / transformers versions, CPU;
2. the native CPU kernel's build (once, before the tests, so no test waits on a compile), and
   with ``--tune`` the Triton kernel's tuning (``benchmarks/gpu_tune.py``), which writes this
   GPU's launch parameters to ``src/attnkit/backends/triton/tuned.json`` (commit it) before
   anything else runs the kernel;
3. the test suite under ``pytest -n`` (every CUDA test and every Triton kernel compiled for the
   GPU; ``--tests`` narrows it), the failures' full text kept in ``pytest.log``; it runs beside
   step 4, its workers sharing the cores out among torch's threads;
4. the oracle sweep (``--sweep-budget`` seconds at most: no case starts after it, and the
   cases left out are reported): ``auto`` and every backend that accepts the call, against the fp64 oracle
   under rule R (docs/testing.md) for every mask kind (per-query selections included) and score
   modifier (per-query sinks included), in bf16 and fp16, prefill (forward and backward), decode,
   absorbed-MLA decode over one latent head with V from K (the lean Triton kernel's calls), decode over scattered
   pages (``PagedKV``), and decode over quantized K/V (``QuantizedKV``, int8 and fp8 e4m3, dense
   and paged; the oracle runs on the dequantized K/V), with the kernel ``auto`` picked;
5. ``benchmarks/bench_gpu.py`` (its tables go to ``DIR/bench``).

Everything lands in ``DIR``: ``summary.md`` (read this first), ``summary.json``, ``pytest.log``,
``pytest.xml``, ``sweep.json`` and the benchmark tables. The exit status is 0 when every test and
every sweep row passed. ``--quick`` runs the sweep on small shapes (Triton in its interpreter on
CPU), the compile-safety tests and ``bench_gpu.py --quick``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if not torch.cuda.is_available():  # Triton reads this when a kernel is defined: before attnkit imports it
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(ROOT / "tests"))  # rule R and the eager base live with the tests

import attnkit  # noqa: E402
from attnkit import masks as M  # noqa: E402
from attnkit._sysinfo import cpu_isa, cpu_name  # noqa: E402
from attnkit.backends import BackendNotSupported, backend_names  # noqa: E402

#: Test files the quick mode runs: the CUDA branch's decisions, checked on CPU (the smoke test is
#: for this script; the whole suite runs on its own).
QUICK_TESTS = ["tests/test_compile_safety.py"]


# ---------------------------------------------------------------------------- steps


def environment() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cpu": f"{cpu_name()} ({cpu_isa()})", "threads": torch.get_num_threads()}
    for name in ("triton", "transformers", "flash_attn"):
        try:
            info[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - not installed, or broken: say so
            info[name] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"sm_{p.major}{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1),
                    sms=p.multi_processor_count)
    else:
        info["gpu"] = None
    return info


def start_step(cmd: list[str], log: Path, env: dict | None = None) -> dict:
    """Start ``cmd`` from the repository root in a session of its own (so a time limit can stop
    its children too), its output in ``log``, ``env`` added to the environment."""
    f = open(log, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True)
    return {"cmd": " ".join(cmd), "proc": proc, "file": f, "t0": time.time(), "log": log.name}


def finish_step(step: dict, timeout: float) -> dict:
    """Wait for a started step until ``timeout`` seconds after its start (then stop it and its
    children); its result row. Never raises."""
    proc, f = step.pop("proc"), step.pop("file")
    try:
        rc = proc.wait(timeout=max(1.0, timeout - (time.time() - step["t0"])))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        rc = "timeout"
        f.write(f"\n[gpu_check] stopped after {timeout} s\n")
    f.close()
    step.update(rc=rc, seconds=round(time.time() - step.pop("t0"), 1))
    return step


def run_step(cmd: list[str], log: Path, timeout: int, env: dict | None = None) -> dict:
    """Run ``cmd`` to the end (or ``timeout``); its result row. Never raises."""
    return finish_step(start_step(cmd, log, env), timeout)


def pytest_counts(log: Path) -> str:
    """pytest's closing line ("N passed, M failed in ...") from its log."""
    lines = [ln.strip("= \n") for ln in log.read_text(errors="replace").splitlines() if " in " in ln and
             any(w in ln for w in ("passed", "failed", "error", "skipped"))]
    return lines[-1] if lines else "(no summary line)"


# ---------------------------------------------------------------------------- the oracle sweep


def sweep_cases(B: int, H: int, Sq: int, Sk: int, Hkv: int = 1) -> dict:
    """name -> (mask, kwargs of attention()) for every mask kind and score modifier (H query heads,
    Hkv KV heads: a block selection has one list per KV head)."""
    g = torch.Generator().manual_seed(0)
    pad = torch.tensor([Sk, max(1, Sk // 3)])[:B]
    slopes = M.alibi_slopes(H)
    # Selections (their own generator: the other cases' tensors stay as they were): top keys shared
    # by every head (-1 padding, duplicates), and top blocks per KV head joined with the local
    # window, as sparse-attention models ask for them.
    gs = torch.Generator().manual_seed(1)
    keys = torch.randint(-1, Sk, (B, Sq, max(4, Sk // 8)), generator=gs)
    bs = 16 if Sk <= 256 else 64
    blocks = torch.randint(-1, -(-Sk // bs), (B, Hkv, Sq, 4), generator=gs)
    return {
        "none": (None, {}),
        "causal": (M.Causal(), {}),
        "causal-topleft": (M.Causal("top_left"), {}),
        "key-padding": (M.KeyPadding(pad), {}),
        "query+key-padding": (M.KeyPadding(pad) & M.QueryPadding(torch.tensor([Sq, max(1, Sq // 2)])[:B]), {}),
        "window": (M.SlidingWindow(max(1, Sk // 8)), {}),
        "window+padding": (M.SlidingWindow(max(1, Sk // 8)) & M.KeyPadding(pad), {}),
        "documents": (M.Causal() & M.Document(torch.tensor([Sq // 4, Sq // 2, Sq - Sq // 4 - Sq // 2]),
                                              torch.tensor([Sk // 4, Sk // 2, Sk - Sk // 4 - Sk // 2])), {}),
        "prefix-lm": (M.PrefixLM(torch.tensor([Sk // 3, 0])[:B]), {}),
        "ragged-causal": (M.Causal(q_start=torch.tensor([Sk - Sq, max(0, Sk - Sq - 5)])[:B]), {}),
        "dense": (M.Dense(torch.rand(B, 1, Sq, Sk, generator=g) > 0.3), {}),
        "additive": (M.Additive(torch.randn(B, 1, Sq, Sk, generator=g)) & M.Causal(), {}),
        "alibi": (M.ALiBi(slopes), {}),
        "alibi+causal": (M.ALiBi(slopes) & M.Causal(), {}),
        "alibi+window+padding": (M.ALiBi(slopes) & M.SlidingWindow(max(1, Sk // 8)) & M.KeyPadding(pad), {}),
        "softcap+causal": (M.Causal(), {"softcap": 30.0}),
        "softcap+alibi+causal": (M.ALiBi(slopes) & M.Causal(), {"softcap": 20.0}),
        "sinks+causal": (M.Causal(), {"sinks": torch.randn(H, generator=g)}),
        "sinks+window": (M.SlidingWindow(max(1, Sk // 8)), {"sinks": torch.randn(H, generator=g)}),
        "selected-keys+causal": (M.SelectedKeys(keys) & M.Causal(), {}),
        "selected-blocks+window": ((M.SelectedBlocks(blocks, bs, num_heads=H) | M.SlidingWindow(bs - 1))
                                   & M.Causal(), {}),
        "selected+sinks+alibi": (M.ALiBi(slopes) & M.SelectedKeys(keys) & M.Causal(),
                                 {"sinks": torch.randn(H, generator=gs), "softcap": 20.0}),
        "query-sinks+causal": (M.Causal(), {"sinks": torch.randn(B, H, Sq, generator=gs)}),  # Inkling 2's
    }


def _check(q, k, v, mask, kw, backend: str, grad: bool) -> dict:
    """attention() through ``backend`` against the fp64 oracle under rule R: the row of the sweep."""
    from conftest import check_against_oracle

    try:
        detail = attnkit.describe_call(q, k, v, mask, backend=backend, detail=True, **kw)
    except BackendNotSupported:
        return {"status": "refused"}
    return _verdict({"kernel": detail}, lambda: check_against_oracle(q, k, v, mask, backend=backend, grad=grad, **kw))


def _verdict(row: dict, check) -> dict:
    """``row`` with the status of ``check()``: pass, FAIL (rule R's message) or ERROR (a crash, with
    its text)."""
    try:
        check()
        row["status"] = "pass"
    except AssertionError as e:
        row.update(status="FAIL", why=str(e).splitlines()[0][:300])
    except Exception as e:  # noqa: BLE001 - a crash is a failed row, with its text
        row.update(status="ERROR", why=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    return row


#: Cases the paged phase runs (masks a cache's step carries, with every score modifier).
PAGED_CASES = ("none", "causal", "window", "alibi+causal", "softcap+causal", "sinks+causal", "selected-keys+causal",
               "selected-blocks+window", "selected+sinks+alibi", "query-sinks+causal")
#: Cases the latent phase runs: absorbed MLA's decode (one KV head, V the first channels of K),
#: which the lean Triton kernel serves plain, over a selection, and leaves to the shared one with
#: a modifier.
LATENT_CASES = ("none", "causal", "ragged-causal", "selected-keys+causal", "softcap+causal", "query-sinks+causal")


def _paged(k, v, block: int, g: torch.Generator):
    """k, v (B, Hkv, Sk, D) in pools of ``block``-token pages on a scattered block table:
    the PagedKV holding the same tokens."""
    B, Hkv, Sk, D = k.shape
    W = -(-Sk // block)
    table = torch.randperm(B * W, generator=g).view(B, W).to(k.device)
    pool_k = k.new_zeros(B * W, block, Hkv, D)
    pool_v = v.new_zeros(B * W, block, Hkv, v.shape[-1])
    pos = torch.arange(Sk, device=k.device)
    for b in range(B):
        pool_k[table[b, pos // block], pos % block] = k[b].transpose(0, 1)
        pool_v[table[b, pos // block], pos % block] = v[b].transpose(0, 1)
    return attnkit.PagedKV(pool_k, pool_v, table, torch.full((B,), Sk, device=k.device))


#: Storage dtypes of the quantized phases: the PAGED_CASES decode calls again over int8 / fp8 K/V,
#: dense and paged (phase names "int8", "int8-paged", ...).
QUANTIZED = ("int8", "fp8_e4m3")


def _paged_row(q, k, v, mask, kw, backend: str, quantized: str | None = None, paged: bool = True) -> dict:
    """attention() over the paged copy of k, v (or, with ``quantized``, over k, v quantized to
    that storage dtype, paged or dense) against the fp64 oracle on the dense (dequantized)
    tensors, the base being the eager attention over them in q's dtype."""
    from conftest import base_attention, rule_r

    kv = _paged(k, v, 16, torch.Generator().manual_seed(1)) if paged else None
    if quantized is not None:
        kv = attnkit.QuantizedKV.quantize(k, v, quantized) if not paged else attnkit.QuantizedKV.quantize(
            kv.k_pool, kv.v_pool, quantized, block_table=kv.block_table, lengths=kv.lengths)
        (k, v), (kb, vb) = kv.gather(torch.float64), kv.gather(q.dtype)
    else:
        kb, vb = k, v
    try:
        kernel = attnkit.describe_call(q, kv, None, mask, backend=backend, detail=True, **kw)
    except BackendNotSupported:
        return {"status": "refused"}

    def check():
        out = attnkit.attention(q, kv, None, mask, backend=backend, **kw)
        sinks = kw.get("sinks")
        gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask, softcap=kw.get("softcap"),
                                           sinks=None if sinks is None else sinks.double())
        rule_r(out, base_attention(q, kb, vb, mask, **kw), gold, n_terms=max(k.shape[2], k.shape[3]))

    return _verdict({"kernel": kernel}, check)


def sweep(device: str, quick: bool, budget: float | None = None) -> list[dict]:
    """The rows of the oracle sweep; with ``budget`` (seconds), no new case starts after it is spent
    (the cases left out get one row each, status "not run", so the report says what was missed)."""
    deadline = None if budget is None else time.time() + budget
    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16]
    # decode first: its rows (pages, quantized K/V, the Triton decode kernel) are the ones a spent
    # budget must not cut
    shapes = {"decode": (2, 8, 2, 2, 40, 16) if quick else (2, 8, 2, 2, 2048, 128),
              "latent": (2, 16, 1, 2, 40, 32) if quick else (2, 128, 1, 2, 2048, 576),
              "prefill": (2, 8, 2, 24, 40, 16) if quick else (2, 8, 2, 256, 320, 64)}
    skip = {"flex", "flash"} if quick else set()  # on CPU flex compiles for seconds per case
    rows = []
    for phase, (B, Hq, Hkv, Sq, Sk, D) in shapes.items():
        for dtype in dtypes:
            cases = sweep_cases(B, Hq, Sq, Sk, Hkv)
            for name, (mask, kw) in cases.items():
                if phase == "latent" and name not in LATENT_CASES:
                    continue
                if deadline is not None and time.time() > deadline:
                    rows.append({"phase": phase, "dtype": str(dtype).replace("torch.", ""), "case": name,
                                 "backend": "-", "status": "not run", "why": "sweep budget spent"})
                    continue
                kw = {key: (val.to(device) if isinstance(val, torch.Tensor) else val) for key, val in kw.items()}
                g = torch.Generator().manual_seed(len(rows))
                q, k, v = (torch.randn(*s, generator=g).to(dtype).to(device)
                           for s in ((B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D)))
                if phase == "latent":  # V = the latent, K's first channels (the rest: rope, 64 of 576)
                    v = k[..., :D - (64 if D >= 256 else D // 2)]
                for backend in ["auto"] + [b for b in backend_names() if b not in skip]:
                    grad = phase == "prefill" and device == "cuda"
                    t0 = time.time()
                    row = _check(q, k, v, mask, kw, backend, grad)
                    if phase == "decode" and name in PAGED_CASES:  # the same call over pages, quantized K/V
                        variants = [("paged", None, True)] + [(f"{st}{'-paged' * pg}", st, pg) for st in QUANTIZED
                                                              for pg in (False, True)]
                        for vphase, storage, pg in variants:
                            t1 = time.time()
                            paged = _paged_row(q, k, v, mask, kw, backend, storage, pg)
                            if paged["status"] != "refused" or backend == "auto":
                                paged.update(phase=vphase, dtype=str(dtype).replace("torch.", ""), case=name,
                                             backend=backend, grad=False, seconds=round(time.time() - t1, 2))
                                rows.append(paged)
                    if row["status"] == "refused" and backend != "auto":
                        continue
                    row.update(phase=phase, dtype=str(dtype).replace("torch.", ""), case=name, backend=backend,
                               grad=grad, seconds=round(time.time() - t0, 2))
                    rows.append(row)
                    print(f"[sweep] {phase:7s} {row['dtype']:8s} {name:24s} {backend:7s} "
                          f"{row.get('kernel', '-'):18s} {row['status']}", flush=True)
    return rows


# ---------------------------------------------------------------------------- report


def write_summary(out: Path, info: dict, steps: dict, rows: list[dict]) -> bool:
    failed_rows = [r for r in rows if r["status"] not in ("pass", "refused", "not run")]
    not_run = [r for r in rows if r["status"] == "not run"]
    ok = not failed_rows and not not_run and all(s.get("rc") == 0 for s in steps.values())
    (out / "sweep.json").write_text(json.dumps(rows, indent=1))
    (out / "summary.json").write_text(json.dumps({"ok": ok, "environment": info, "steps": steps,
                                                  "sweep_failures": failed_rows}, indent=1))
    lines = ["# attnkit GPU check", "",
             f"**{'PASS' if ok else 'FAIL'}** on {info.get('gpu') or 'CPU (no GPU: quick smoke run)'}", "",
             "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    lines += ["", "## Steps", "", "| step | result | seconds | log |", "|---|---|---|---|"]
    for name, s in steps.items():
        res = s.get("summary", "") or ("ok" if s.get("rc") == 0 else f"rc={s.get('rc')}")
        lines.append(f"| {name} | {res} | {s.get('seconds', '')} | {s.get('log', '')} |")
    passed = sum(r["status"] == "pass" for r in rows)
    lines += ["", f"## Oracle sweep: {passed} rows pass, {len(failed_rows)} fail, {len(not_run)} cases not run", ""]
    auto_rows = [r for r in rows if r["backend"] == "auto"]
    if auto_rows:
        order = {"prefill": 0, "decode": 1}  # then the K/V layouts, in the order the sweep ran them
        phases = sorted(dict.fromkeys(r["phase"] for r in auto_rows), key=lambda ph: order.get(ph, 2))
        lines += ["What `auto` picked, per case and phase (first dtype):", "",
                  "| case | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
        first = auto_rows[0]["dtype"]
        by = {(r["phase"], r["case"]): r.get("kernel", "-") for r in auto_rows if r["dtype"] == first}
        for case in dict.fromkeys(r["case"] for r in auto_rows):
            lines.append(f"| {case} | " + " | ".join(by.get((ph, case), "-") for ph in phases) + " |")
    if failed_rows:
        lines += ["", "### Failures", "", "| phase | dtype | case | backend | kernel | why |", "|---|---|---|---|---|---|"]
        for r in failed_rows:
            lines.append(f"| {r['phase']} | {r['dtype']} | {r['case']} | {r['backend']} | {r.get('kernel', '-')} | "
                         f"{r.get('why', '').replace('|', '/')} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu-check")
    p.add_argument("--quick", action="store_true", help="small shapes, CPU allowed (Triton's interpreter)")
    p.add_argument("--workers", default=str(max(1, min(14, (os.cpu_count() or 2) - 2))), help="pytest -n")
    p.add_argument("--tests", nargs="*", default=None, help="test files for step 3 (default: all of tests/)")
    # The defaults keep one run under 9 minutes (a device lent for 15 minutes, a call cut at 10):
    # tests and sweep side by side, then the benchmark.
    p.add_argument("--test-timeout", type=int, default=None, help="seconds for step 3 (default 300, quick 150)")
    p.add_argument("--sweep-budget", type=float, default=None,
                   help="seconds after which no new sweep case starts (default 240 on CUDA, none in quick mode)")
    p.add_argument("--skip", nargs="*", default=[], choices=["tests", "sweep", "bench"], help="steps to leave out")
    p.add_argument("--tune", action="store_true",
                   help="first tune the Triton kernel's launch parameters on this GPU (benchmarks/gpu_tune.py) and "
                        "write them to the table it reads, then run the check with them")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        p.error("no CUDA device here: run with --quick for the CPU smoke test")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    info = environment()
    print(f"[gpu_check] {info.get('gpu') or 'CPU'}; writing to {out}", flush=True)
    steps: dict[str, dict] = {}
    py = sys.executable
    steps["native build"] = run_step([py, "-c", "from attnkit import native; print(native.status())"],
                                     out / "native.log", timeout=600)
    if args.tune and cuda:  # before the tests and the bench, which then run the tuned kernel
        steps["tune"] = run_step([py, "benchmarks/gpu_tune.py", "--out", str(out / "tune")], out / "tune.log",
                                 timeout=300)
    tests = None
    if "tests" not in args.skip:  # started first, then runs beside the sweep (GPU and cores both shared)
        files = args.tests if args.tests is not None else (QUICK_TESTS if args.quick else ["tests"])
        xdist = [] if args.quick else ["-n", args.workers]
        # torch threads per worker: the cores shared out (with every worker taking all 16 cores of
        # an H100 host, the suite got through 14% of its tests in 400 s)
        threads = str(max(1, (os.cpu_count() or 1) // (1 if args.quick else int(args.workers))))
        tests = start_step([py, "-m", "pytest", *xdist, "-q", "-p", "no:cacheprovider", "-rfE", "--tb=long",
                            f"--junitxml={out / 'pytest.xml'}", *files], out / "pytest.log",
                           env={"OMP_NUM_THREADS": threads})
    rows: list[dict] = []
    if "sweep" not in args.skip:
        t0 = time.time()
        budget = args.sweep_budget if args.sweep_budget is not None else (None if args.quick else 240.0)
        rows = sweep("cuda" if cuda else "cpu", args.quick, budget)
        bad = sum(r["status"] not in ("pass", "refused", "not run") for r in rows)
        steps["oracle sweep"] = {"rc": 0 if bad == 0 else 1, "seconds": round(time.time() - t0, 1),
                                 "summary": f"{len(rows)} rows, {bad} failing", "log": "sweep.json"}
    if tests is not None:
        s = finish_step(tests, timeout=args.test_timeout or (150 if args.quick else 300))
        s["summary"] = ("stopped at its time limit; " if s["rc"] == "timeout" else "") + pytest_counts(out / "pytest.log")
        steps = {"native build": steps["native build"], "tests": s, **{k: v for k, v in steps.items()
                                                                       if k != "native build"}}
    if "bench" not in args.skip:
        steps["bench_gpu"] = run_step([py, "benchmarks/bench_gpu.py", *(["--quick"] if args.quick else []),
                                       "--out", str(out / "bench")], out / "bench.log", timeout=120 if args.quick else 200)
    ok = write_summary(out, info, steps, rows)
    print((out / "summary.md").read_text())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
