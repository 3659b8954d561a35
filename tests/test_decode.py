"""The decode backend's per-head fast path (chunked fp32 conversion, threads, context split),
forced onto small shapes by lowering its size thresholds, and once at a realistic size."""

from __future__ import annotations

import threading

import pytest
import torch

import attnkit
from attnkit import masks as M
from attnkit.backends import _decode_kernel as kern

from conftest import base_attention, make_qkv, rule_r, stable_seed


@pytest.fixture
def small_thresholds(monkeypatch):
    """Fast path for any size; 64-row chunks so every call converts several chunks; threads for
    any size (so the pool and the context split run)."""
    monkeypatch.setattr(kern, "_MIN_UNIT_ELEMS_HALF", 0)
    monkeypatch.setattr(kern, "_MIN_UNIT_ELEMS_FP32", 0)
    monkeypatch.setattr(kern, "_MIN_ELEMS_PER_THREAD", 1)
    monkeypatch.setattr(kern, "_CHUNK_BYTES", 64 * 4 * 16)


def _check(q, k, v, mask=None, causal=False):
    out = attnkit.attention(q, k, v, mask, causal=causal, backend="decode")
    gold = attnkit.attention_reference(q, k, v, mask, causal=causal)
    rule_r(out, base_attention(q, k, v, mask, causal=causal), gold)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B,Hkv,G", [(1, 1, 1), (1, 2, 4), (3, 1, 8), (2, 3, 2)])
@pytest.mark.parametrize("Sq", [1, 4])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fast_path_matches_oracle(small_thresholds, dtype, B, Hkv, G, Sq, threads):
    seed = stable_seed(str(dtype), B, Hkv, G, Sq, threads)
    q, k, v = make_qkv(B, Hkv * G, Hkv, Sq, 600, 16, Dv=24, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 601, (B,), generator=g)
    lens[0] = 0  # one sequence with no keys at all: its rows must be exactly 0
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            out = _check(q, k, v, M.KeyPadding(lens), causal=True)
            _check(q, k, v, torch.randn(1, 1, Sq, 600, generator=g))
    finally:
        torch.set_num_threads(saved)
    assert torch.get_num_threads() == saved  # the kernel restores torch's thread count
    assert (out[0] == 0).all()


def test_fast_path_on_a_slice_of_a_preallocated_cache(small_thresholds):
    cache_k = torch.randn(2, 2, 1000, 16, dtype=torch.bfloat16)
    cache_v = torch.randn(2, 2, 1000, 16, dtype=torch.bfloat16)
    q = torch.randn(2, 8, 1, 16, dtype=torch.bfloat16)
    _check(q, cache_k[:, :, :700], cache_v[:, :, :700], causal=True)


def test_fast_path_is_safe_from_several_python_threads(small_thresholds):
    q, k, v = make_qkv(2, 8, 2, 1, 500, 16, dtype=torch.bfloat16)
    want = attnkit.attention(q, k, v, backend="decode")
    results, errors = [], []

    def worker():
        try:
            for _ in range(5):
                results.append(attnkit.attention(q, k, v, backend="decode"))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    for r in results:  # no shared scratch buffer was trampled
        torch.testing.assert_close(r, want, atol=0, rtol=0)


def test_realistic_size_takes_the_fast_path_and_matches():
    q, k, v = make_qkv(1, 8, 2, 1, 4096, 64, dtype=torch.bfloat16)
    assert attnkit.describe_call(q, k, v, causal=True) == "decode"
    with torch.inference_mode():
        _check(q, k, v, causal=True)


def test_backward_through_decode_backend():
    q, k, v = make_qkv(2, 4, 2, 3, 50, 16)
    from conftest import check_against_oracle
    check_against_oracle(q, k, v, causal=True, backend="decode")
