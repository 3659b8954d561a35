"""Calls that could crash or hang the process (a segfault, SIGFPE, an out-of-memory kill) raise
instead. Each runs in a subprocess, so that a crash fails the test instead of killing the run.

The split-K kernel sizes its tiles from the core's L2 and its work units from torch's thread
count; ``ATTNKIT_SPLITK_TILE_BYTES`` forces the tile size (read once per process), so each tile
setting runs in its own process, at 1, 2 and 16 threads."""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
import sys
import textwrap
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent

#: What a child may use: a crash that allocates without bound fails fast instead of taking the
#: machine with it (importing torch reserves well under 1 GiB).
_MEMORY_LIMIT = 4 << 30


def run_child(code: str, *, env: dict[str, str | None] | None = None, timeout: int = 600) -> str:
    """Run ``code`` in a fresh interpreter (tests/ importable, address space capped, ``env`` on
    top of this process's environment, None unsetting a variable); returns its stdout. A signal,
    a non-zero exit or a timeout fails the calling test with the child's output."""
    prelude = (f"import resource, sys\nresource.setrlimit(resource.RLIMIT_AS, ({_MEMORY_LIMIT}, {_MEMORY_LIMIT}))\n"
               f"sys.path.insert(0, {str(TESTS)!r})\n")
    full_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    try:
        res = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                             env=full_env, timeout=timeout, cwd=TESTS.parent)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung (> {timeout} s); output so far:\n{e.stdout}\n{e.stderr}")
    if res.returncode != 0:
        how = f"killed by signal {-res.returncode}" if res.returncode < 0 else f"exit status {res.returncode}"
        pytest.fail(f"the child failed ({how}):\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}")
    return res.stdout


# --------------------------------------------------------------------------- the battery


def _pages(k: torch.Tensor, v: torch.Tensor, lengths: list[int], bs: int, seed: int):
    """Pools (N, bs, Hkv, ·) holding dense k, v (B, Hkv, L, ·) in scattered blocks, and the
    (B, W) table, padded with -1 past each sequence's last block (BlockAllocator's layout)."""
    B, Hkv, L, D = k.shape
    W = -(-L // bs)
    N = B * W + 3
    ids = torch.randperm(N, generator=torch.Generator().manual_seed(seed))[:B * W].view(B, W)
    pk = torch.zeros(N, bs, Hkv, D, dtype=k.dtype)
    pv = torch.zeros(N, bs, Hkv, v.shape[3], dtype=v.dtype)
    for b, n in enumerate(lengths):
        pos = torch.arange(n)
        pk[ids[b, pos // bs], pos % bs] = k[b, :, :n].transpose(0, 1)
        pv[ids[b, pos // bs], pos % bs] = v[b, :, :n].transpose(0, 1)
    table = ids.clone()
    for b, n in enumerate(lengths):
        table[b, -(-n // bs):] = -1
    return pk, pv, table


def lying_table_battery(thread_counts=(1, 2, 16)) -> list[str]:
    """Valid paged and dense calls match the oracle, and paged calls whose ``checked=True`` table
    lies (an entry in use outside the pool, or -1) raise ValueError naming the block table on
    every path (the native kernel, the torch implementation, SDPA and math through the gather), at each
    thread count; direct kernel calls whose bounds lie raise too. Returns a line per failure."""
    import attnkit
    from attnkit import masks as M
    from attnkit import native
    from attnkit.backends.decode import splitk
    from conftest import base_attention, rule_r

    ops = native.load()
    failures = []
    before = torch.get_num_threads()
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    # (Hq, Hkv, D, block size, lengths): GQA, MQA, MHA; odd and vector-width head dims; several
    # tiles per sequence (tiles hold 16 to 128 keys) and a sequence shorter than one tile
    shapes = [(2, 1, 8, 2, [4, 3]), (8, 2, 7, 3, [150, 40]), (6, 3, 80, 16, [130, 1]), (4, 4, 64, 1, [70, 0])]
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for dtype in dtypes:
                for case, (Hq, Hkv, D, bs, lengths) in enumerate(shapes):
                    g = torch.Generator().manual_seed(case)
                    B, L = len(lengths), max(lengths)
                    q = torch.randn(B, Hq, 4, D, generator=g).to(dtype)
                    k = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
                    v = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
                    pk, pv, table = _pages(k, v, lengths, bs, case)
                    n = torch.tensor(lengths)
                    where = f"threads={threads} {dtype} case={case}"
                    for Sq, mask in ((1, None), (4, M.Causal(q_start=(n - 4).clamp(min=0)))):
                        kv = attnkit.PagedKV(pk, pv, table, n, checked=True)
                        full = M.KeyPadding(n) if mask is None else mask & M.KeyPadding(n)
                        for backend in ("paged", "sdpa"):
                            try:
                                out = attnkit.attention(q[:, :, :Sq], kv, None, mask, backend=backend)
                                rule_r(out, base_attention(q[:, :, :Sq], k, v, full),
                                       attnkit.attention_reference(q[:, :, :Sq], k, v, full), n_terms=L)
                            except Exception as e:  # noqa: BLE001 - collected and reported
                                failures.append(f"{where} Sq={Sq} {backend} valid call: {type(e).__name__}: {e}")
                        # the same blocks quantized (int8 rows, fp32 scales), read in place
                        qkv = replace(attnkit.QuantizedKV.quantize(pk, pv, "int8", block_table=table, lengths=n),
                                      checked=True)
                        kd, vd = qkv.gather(torch.float64)
                        try:
                            out = attnkit.attention(q[:, :, :Sq], qkv, None, mask, backend="paged")
                            rule_r(out, base_attention(q[:, :, :Sq], kd.to(dtype), vd.to(dtype), full),
                                   attnkit.attention_reference(q[:, :, :Sq].double(), kd, vd, full), n_terms=L)
                        except Exception as e:  # noqa: BLE001 - collected and reported
                            failures.append(f"{where} Sq={Sq} paged int8 valid call: {type(e).__name__}: {e}")
                        for bad in (pk.shape[0] + 5, -1, 2 ** 40):
                            lying = table.clone()
                            lying[0, -(-lengths[0] // bs) - 1] = bad  # the last block sequence 0 reads
                            kv = attnkit.PagedKV(pk, pv, lying, n, checked=True)
                            try:
                                attnkit.attention(q[:, :, :Sq], replace(qkv, block_table=lying), None, mask,
                                                  backend="paged")
                                failures.append(f"{where} Sq={Sq} paged int8 entry {bad}: no error")
                            except ValueError as e:
                                if "block_table" not in str(e):
                                    failures.append(f"{where} paged int8 entry {bad}: unclear error {e}")
                            for backend in ("paged", "sdpa", "math"):
                                try:
                                    attnkit.attention(q[:, :, :Sq], kv, None, mask, backend=backend)
                                    failures.append(f"{where} Sq={Sq} {backend} entry {bad}: no error")
                                except ValueError as e:
                                    if "block_table" not in str(e):
                                        failures.append(f"{where} {backend} entry {bad}: unclear error {e}")
                    if ops is not None:  # the kernel guards itself: bounds past K, a bias too short
                        lo = torch.zeros(B, 1, dtype=torch.long)
                        calls = {
                            "hi > Sk": dict(hi=torch.full((B, 1), L + 1, dtype=torch.long), bias=None),
                            "short bias": dict(hi=torch.full((B, 1), L, dtype=torch.long),
                                               bias=torch.zeros(1, 1, 1, L - 1).expand(B, Hq, 1, L - 1)),
                        }
                        for name, kw in calls.items():
                            try:
                                ops.splitk_attention(q[:, :, :1].contiguous(), k, v, None, None, D, None, lo, kw["hi"],
                                                     kw["bias"], None, None, None, 1.0, 0.0, Hkv, False,
                                                     None, 1, None, None, None, None, 1)
                                failures.append(f"{where} dense kernel {name}: no error")
                            except ValueError:
                                pass
    finally:
        torch.set_num_threads(before)
    return failures


def tile_probe() -> str:
    """A checksum of a long single-threaded walk, whose rounding depends on the tile length (each
    tile's P @ V is summed on its own): different forced tile sizes give different bits."""
    import attnkit

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 300, 16, generator=g),
               torch.rand(1, 2, 300, 16, generator=g))
    return attnkit.attention(q, k, v, backend="decode").numpy().tobytes().hex()


# --------------------------------------------------------------------------- tests


def test_lying_checked_tables_raise_at_every_thread_count_and_tile_size():
    """A ``checked=True`` table that lies raises, on every path, before any worker runs (an
    exception thrown from OpenMP workers, at 16 threads from several at once, kills the
    process), at 1, 2 and 16 threads, at the L2-sized, smallest and largest tiles, and valid
    calls still match the oracle. The forced sizes do reach the kernel: the smallest and
    largest tiles round a long walk differently."""
    from attnkit import native

    probes = {}
    for name, tile_bytes in (("l2-sized", None), ("smallest", "1"), ("largest", str(1 << 30))):
        out = run_child("""
            import test_failures as t
            failures = t.lying_table_battery()
            print("\\n".join(failures))
            print("PROBE", t.tile_probe())
            print("DONE", len(failures))
        """, env={"ATTNKIT_SPLITK_TILE_BYTES": tile_bytes})
        assert "DONE 0" in out, f"tiles {name}:\n{out}"
        probes[name] = out.split("PROBE")[1].split()[0]
    if native.status() == "native":
        assert probes["smallest"] != probes["largest"]


def test_zero_block_size_pools_raise_a_value_error():
    """Pools of block size 0 raise a ValueError naming ``k_pool`` on every backend, with
    lengths 4 (no SIGFPE in the kernel's row seek) and 0 (no bare ZeroDivisionError in the
    gather); the kernel, called directly, refuses them too."""
    out = run_child("""
        import torch, attnkit
        from attnkit import native
        q = torch.randn(1, 2, 1, 8)
        pool = torch.zeros(4, 0, 1, 8)
        for n in (4, 0):
            for backend in ("auto", "paged", "sdpa", "math"):
                kv = attnkit.PagedKV(pool, pool, torch.tensor([[0, 1]]), torch.tensor([n]), checked=True)
                try:
                    attnkit.attention(q, kv, None, backend=backend)
                    print("NO ERROR", n, backend)
                except ValueError as e:
                    assert "k_pool" in str(e) and "(4, 0, 1, 8)" in str(e), e
        ops = native.load()
        if ops is not None:  # the kernel refuses it too, called directly
            try:
                ops.splitk_attention(q, pool, pool, None, None, 8, torch.tensor([[0, 1]]), None, torch.tensor([[4]]), None,
                                     None, None, None, 1.0, 0.0, 1, False, None, 1, None, None, None, None, 1)
                print("NO ERROR kernel")
            except ValueError as e:
                assert "block size" in str(e), e
        print("DONE")
    """)
    assert "DONE" in out and "NO ERROR" not in out, out


@pytest.mark.parametrize("length", [2 ** 62, 2 ** 40, 2 ** 63 - 1])
def test_huge_lengths_raise_without_allocating(length):
    """``checked=True`` with lengths near 2**62 raises without allocating: the lengths are
    checked (an overflowing unit planner would build ~2**55 work units, an out-of-memory kill),
    and the kernel, called directly, refuses bounds past the table without planning anything."""
    out = run_child(f"""
        import torch, attnkit
        from attnkit import native
        q = torch.randn(1, 2, 1, 8)
        pool = torch.zeros(4, 2, 1, 8)
        table = torch.tensor([[0, 1]])
        for backend in ("auto", "paged", "sdpa", "math"):
            kv = attnkit.PagedKV(pool, pool, table, torch.tensor([{length}]), checked=True)
            try:
                attnkit.attention(q, kv, None, backend=backend)
                print("NO ERROR", backend)
            except ValueError as e:
                assert "lengths" in str(e), e
        ops = native.load()
        if ops is not None:
            for threads in (1, 16):
                torch.set_num_threads(threads)
                try:
                    ops.splitk_attention(q, pool, pool, None, None, 8, table, None, torch.tensor([[{length}]]), None, None,
                                         None, None, 1.0, 0.0, 1, False, None, 1, None, None, None, None, 1)
                    print("NO ERROR kernel")
                except ValueError as e:
                    assert "block_table" in str(e), e
        print("DONE")
    """, timeout=300)
    assert "DONE" in out and "NO ERROR" not in out, out
