"""FlexAttention backend on a handful of shapes (each compiles once on CPU)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

import attnkit
from attnkit import masks as M
from attnkit.backends import BackendNotSupported, flex, get_backend
from attnkit.backends.registry import AttentionCall

from conftest import check_against_oracle, make_qkv

pytestmark = pytest.mark.skipif(get_backend("flex").available() is not None,
                                reason="torch without FlexAttention")

#: Tests that run flex on CPU need a CPU whose compiled FlexAttention flex admits.
needs_cpu_flex = pytest.mark.skipif(flex.cpu_vector_isa() == "avx2",
                                    reason="flex refuses CPU calls without AVX-512 (flex.cpu_refusals)")


def _cpu_call(D, Dv, device="cpu", Sq=8, Sk=8, dtype=torch.float32):
    return AttentionCall(2, 2, 2, Sq, Sk, D, Dv, dtype, torch.device(device), None, 0.25, 0.0, False, False)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,mask_fn,Sq,Sk,heads,Dv", [
    (torch.float32, lambda B: M.SlidingWindow(5) & M.KeyPadding(torch.tensor([40, 7])), 33, 47, (4, 2), 16),
    (torch.bfloat16, lambda B: M.Causal() & M.Document(torch.tensor([10, 20, 3])), 33, 33, (4, 1), 16),
    (torch.float32, lambda B: M.PrefixLM(torch.tensor([3, 0])) & M.QueryPadding(torch.tensor([20, 33])), 33, 33, (2, 2),
     16),
    (torch.float32, lambda B: M.Additive(torch.randn(33, 33).masked_fill(torch.rand(33, 33) > 0.7, float("-inf")))
     & M.Causal(), 33, 33, (4, 2), 16),
    # V wider or narrower than K (D = 16)
    (torch.float32, lambda B: None, 8, 8, (2, 2), 24),
    (torch.float32, lambda B: M.Causal(), 33, 47, (2, 2), 8),
    (torch.float32, lambda B: M.Causal(), 33, 47, (4, 2), 32),
], ids=["window+padding-gqa-fp32", "document-causal-mqa-bf16", "prefixlm+qpad-mha-fp32", "additive-causal-gqa-fp32",
        "dv24-nomask-mha-fp32", "dv8-causal-mha-fp32", "dv32-causal-gqa-fp32"])
def test_flex_matches_oracle(dtype, mask_fn, Sq, Sk, heads, Dv):
    """Rule R against the fp64 oracle. A call flex refuses on this CPU (:func:`flex.cpu_refusals`:
    torch's compiled CPU kernel gets it wrong) must be refused with that reason, and is an
    expected failure here until a torch that computes it right re-admits it."""
    q, k, v = make_qkv(2, heads[0], heads[1], Sq, Sk, 16, Dv, dtype=dtype)
    mask = mask_fn(2)
    refused = flex.cpu_refusals(_cpu_call(16, Dv, Sq=Sq, Sk=Sk, dtype=dtype))
    if refused:
        with pytest.raises(BackendNotSupported, match=re.escape(refused[0])):
            attnkit.attention(q, k, v, mask, backend="flex")
        pytest.xfail("flex refuses it on CPU: " + "; ".join(refused))
    out = check_against_oracle(q, k, v, mask, backend="flex", grad=False)
    # Fully masked rows (padded queries) are exactly zero, as on every backend.
    if isinstance(mask, M.And) and any(isinstance(m, M.QueryPadding) for m in mask.masks):
        assert (out[0, :, 20:] == 0).all()
    # Same mask, same shape: the block mask is reused, not rebuilt, also when the call ANDs a
    # causal mask onto it (a new And object each call, with an equal key).
    n = len(flex._BLOCK_MASKS)
    attnkit.attention(q, k, v, mask, backend="flex")
    assert len(flex._BLOCK_MASKS) == n


@needs_cpu_flex
def test_block_mask_cache_sees_in_place_edits_of_mask_tensors():
    q, k, v = make_qkv(2, 2, 2, 16, 16, 16)
    lens = torch.tensor([16, 16])
    mask = M.KeyPadding(lens)
    full = attnkit.attention(q, k, v, mask, causal=True, backend="flex")
    key_before = (M.Causal() & mask).cache_key()
    assert key_before == (M.Causal() & mask).cache_key()
    lens[1] = 4  # edited in place: the key changes, so no stale block mask is used
    assert (M.Causal() & mask).cache_key() != key_before
    out = check_against_oracle(q, k, v, mask, causal=True, backend="flex", grad=False)
    assert torch.equal(out[0], full[0]) and not torch.equal(out[1], full[1])
    # Leaves that require grad, under no_grad: no backward will run, so CPU flex takes the call.
    with torch.no_grad():
        again = attnkit.attention(q.requires_grad_(), k, v, mask, causal=True, backend="flex")
    assert torch.equal(again, out)


def test_flex_refuses_cpu_backward_and_dropout():
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16)
    q.requires_grad_()
    with pytest.raises(BackendNotSupported, match="backward on CPU"):
        attnkit.attention(q, k, v, causal=True, backend="flex")
    with pytest.raises(BackendNotSupported, match="dropout"):
        attnkit.attention(q.detach(), k, v, dropout_p=0.1, backend="flex")


def test_auto_never_picks_flex_on_cpu():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16)
    assert attnkit.describe_call(q, k, v, M.SlidingWindow(4)) != "flex"


def test_forced_flex_on_cpu_refuses_v_of_another_width_than_k():
    """torch's compiled CPU FlexAttention returns wrong values when Dv != D: a forced flex call
    raises, listing that reason (no compile is started); auto runs the call elsewhere."""
    for Dv in (8, 24, 32):
        q, k, v = make_qkv(1, 2, 2, 8, 8, 16, Dv)
        with pytest.raises(BackendNotSupported, match=rf"flex: .*D=16 != Dv={Dv} on CPU"):
            attnkit.attention(q, k, v, causal=True, backend="flex")
        assert attnkit.describe_call(q, k, v, causal=True) != "flex"


def test_cpu_refusals_are_a_function_of_the_call_and_the_vector_isa():
    """Which CPU calls flex refuses, decided for every machine on any machine: all of them where
    torch generates AVX2 code (x86 without AVX-512, or ATEN_CPU_CAPABILITY=avx2 / default), and
    Dv != D everywhere; never a call on another device."""
    assert flex.cpu_refusals(_cpu_call(16, 16), "avx512") == []
    assert flex.cpu_refusals(_cpu_call(16, 16), "aarch64") == []
    assert ["AVX-512" in r for r in flex.cpu_refusals(_cpu_call(16, 16), "avx2")] == [True]
    assert ["Dv=24" in r for r in flex.cpu_refusals(_cpu_call(16, 24), "avx512")] == [True]
    assert len(flex.cpu_refusals(_cpu_call(16, 24), "avx2")) == 2
    assert flex.cpu_refusals(_cpu_call(16, 24, "cuda"), "avx2") == []
    avx512 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
    assert flex.cpu_vector_isa(avx512, "", "x86_64") == "avx512"
    assert flex.cpu_vector_isa(avx512, "avx512_vnni", "x86_64") == "avx512"
    assert flex.cpu_vector_isa(avx512, "avx2", "x86_64") == "avx2"
    assert flex.cpu_vector_isa(avx512, "DEFAULT", "x86_64") == "avx2"
    assert flex.cpu_vector_isa(frozenset({"avx2", "fma"}), "", "x86_64") == "avx2"
    assert flex.cpu_vector_isa(frozenset(), "", "aarch64") == "aarch64"


@pytest.mark.slow
@needs_cpu_flex
def test_new_calls_of_the_same_shape_reuse_the_compiled_kernel():
    """`auto` sends CUDA prefill with modifiers to flex, so a call must not recompile: the score
    modifiers are closures built per call from the same code, over tensors whose values (ALiBi
    slopes and positions, a bias) dynamo does not guard on. Counted on CPU (the compile is the
    same machinery on CUDA)."""
    from torch._dynamo.utils import counters

    q, k, v = make_qkv(1, 4, 2, 32, 32, 16, seed=3)

    def run(slopes, lens):
        mask = M.ALiBi(slopes) & M.Causal() & M.KeyPadding(lens)
        return attnkit.attention(q, k, v, mask, softcap=20.0, backend="flex")

    run(M.alibi_slopes(4), torch.tensor([32]))
    graphs = counters["stats"]["unique_graphs"]
    again = run(M.alibi_slopes(4) * 0.5, torch.tensor([20]))  # new objects, new values, same shapes
    assert counters["stats"]["unique_graphs"] == graphs
    gold = attnkit.attention_reference(q.double(), k.double(), v.double(),
                                       M.ALiBi(M.alibi_slopes(4) * 0.5) & M.Causal() & M.KeyPadding(torch.tensor([20])),
                                       softcap=20.0)
    torch.testing.assert_close(again.double(), gold, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@needs_cpu_flex
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)], ids=["mha", "gqa"])
def test_a_mask_that_varies_by_head_keeps_every_heads_blocks(heads):
    """A mask whose allowed keys differ by head gets a block mask per query head: head 0 sees key
    0 only, the other heads only keys in the last 128-key block, and every head holds rule R (a
    block mask built from head 0 alone would skip the last block for every head). A mask shared
    by every head keeps one block mask for all of them."""
    Hq, Hkv = heads
    Sq, Sk = 130, 300
    q, k, v = make_qkv(1, Hq, Hkv, Sq, Sk, 16, seed=11)
    g = torch.Generator().manual_seed(11)
    allowed = torch.zeros(1, Hq, Sq, Sk, dtype=torch.bool)
    allowed[:, 0, :, 0] = True
    allowed[:, 1:, :, 270:] = torch.rand(1, Hq - 1, Sq, Sk - 270, generator=g) > 0.5
    allowed[:, 1:, :, Sk - 1] = True
    mask = M.Dense(allowed)
    check_against_oracle(q, k, v, mask, backend="flex", grad=False)
    call = AttentionCall(1, Hq, Hkv, Sq, Sk, 16, 16, torch.float32, torch.device("cpu"), mask, 0.25, 0.0,
                         False, False)
    assert flex.block_mask_for(call, "cpu").kv_num_blocks.shape[:2] == (1, Hq)
    shared = replace(call, mask=M.Dense(allowed[:, :1]))
    assert flex.block_mask_for(shared, "cpu").kv_num_blocks.shape[:2] == (1, 1)


def test_block_masks_are_built_per_head_only_for_masks_that_differ_by_head():
    """Which calls get a block mask per query head (a pure function of the call): a dense or
    additive mask with a head dim > 1 and a selection with a list per KV head, also inside an AND
    or OR; a mask shared by every head, ALiBi (a bias, allowing every key) and no mask get one
    block mask broadcast to every head."""
    def heads(mask):
        return flex.block_mask_heads(AttentionCall(1, 4, 2, 8, 8, 16, 16, torch.float32, torch.device("cpu"),
                                                   mask, 0.25, 0.0, False, False))

    per_head = M.Dense(torch.ones(4, 8, 8, dtype=torch.bool))
    for mask in (per_head, M.Additive(torch.zeros(1, 4, 8, 8)), M.Causal() & per_head,
                 M.SelectedKeys(torch.zeros(1, 2, 8, 3, dtype=torch.long), num_heads=4),
                 (M.SelectedBlocks(torch.zeros(1, 2, 8, 1, dtype=torch.long), 4, num_heads=4) | M.SlidingWindow(2))
                 & M.Causal()):
        assert heads(mask) == 4, mask
    for mask in (None, M.Causal(), M.Dense(torch.ones(1, 1, 8, 8, dtype=torch.bool)), M.Dense(torch.ones(8, 8) > 0),
                 M.ALiBi(M.alibi_slopes(4)) & M.Causal(), M.SelectedKeys(torch.zeros(1, 8, 3, dtype=torch.long))):
        assert heads(mask) is None, mask


@needs_cpu_flex
def test_flex_zeroes_rows_with_no_key():
    """Rows the mask leaves empty are exactly 0 on flex too (whatever the kernel leaves there)."""
    q, k, v = make_qkv(2, 2, 2, 8, 12, 16, seed=4)
    mask = M.SlidingWindow(2) & M.KeyPadding(torch.tensor([12, 2]))  # sequence 1 sees no key
    out = attnkit.attention(q, k, v, mask, backend="flex")
    assert (out[1] == 0).all() and (out[0] != 0).any()


def test_empty_rows_come_from_the_lse_on_cuda_and_from_intervals_on_cpu():
    """The CUDA branch's decision, on CPU: CUDA calls ask the kernel for the log-sum-exp (its -inf
    rows are the empty ones, zeroed), CPU calls only for sinks; on CPU the empty rows of an
    interval mask come from its key intervals."""
    def call(device, mask=None, sinks=None):
        return AttentionCall(2, 2, 2, 8, 12, 16, 16, torch.float32, torch.device(device), mask, 0.25, 0.0,
                             False, False, sinks=sinks)

    assert flex.wants_lse(call("cuda")) and not flex.wants_lse(call("cpu"))
    assert flex.wants_lse(call("cpu", sinks=torch.zeros(2)))
    empty = flex._empty_rows(call("cpu", M.SlidingWindow(2) & M.KeyPadding(torch.tensor([12, 2]))), "cpu")
    assert empty.shape == (2, 1, 8) and bool(empty[1].all()) and not bool(empty[0].any())


def test_guard_signature_keeps_shapes_code_and_constants_not_tensor_values():
    """What decides whether a call reuses a compiled entry: shapes, dtypes, the mask's code and
    its constants count; the values in its tensors do not (a pure function, no compile)."""
    sig = flex.guard_signature

    def mod_of(mask, Sq=32, Sk=32):
        return mask.mask_mod(Sq, Sk, "cpu")

    assert sig(mod_of(M.KeyPadding(torch.tensor([3, 9])))) == sig(mod_of(M.KeyPadding(torch.tensor([30, 1]))))
    assert sig(mod_of(M.KeyPadding(torch.tensor([3, 9])))) != sig(mod_of(M.KeyPadding(torch.tensor([3]))))
    assert sig(mod_of(M.SlidingWindow(4))) != sig(mod_of(M.SlidingWindow(5)))  # an int constant
    assert sig(mod_of(M.SlidingWindow(4))) != sig(mod_of(M.Causal()))  # other code
    t = torch.zeros(2, 3)
    assert sig(t) == sig(torch.ones(2, 3)) != sig(t.double()) != sig(torch.zeros(3, 2))
    assert sig(t) != sig(t.requires_grad_())
    assert sig([1, 2.0]) != sig([1, 2.5]) and sig(True) != sig(1)


@pytest.mark.slow
@needs_cpu_flex
def test_more_mask_kinds_than_dynamos_recompile_limit_all_run_compiled():
    """Dynamo keeps its compiled entries on a code object and, past its recompile limit, runs the
    function uncompiled: FlexAttention then warns and materializes every score. Each guard
    signature compiles its own copy, so more mask kinds than the limit all run the compiled
    kernel."""
    import warnings

    import torch._dynamo

    limit = getattr(torch._dynamo.config, "recompile_limit", None) or torch._dynamo.config.cache_size_limit
    q, k, v = make_qkv(1, 2, 2, 16, 16, 16, seed=5)
    before = len(flex._COMPILED)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*unfused.*")  # torch's warning when it falls back
        for w in range(1, limit + 2):
            out = attnkit.attention(q, k, v, M.SlidingWindow(w), backend="flex")
    assert len(flex._COMPILED) >= min(flex._MAX_COMPILED, before + limit + 1)
    gold = attnkit.attention_reference(q.double(), k.double(), v.double(), M.SlidingWindow(limit + 1))
    torch.testing.assert_close(out.double(), gold, atol=1e-5, rtol=1e-4)


def test_a_failed_compile_falls_back_under_auto_and_raises_when_forced(monkeypatch):
    """Inductor can find no kernel for a FlexAttention call (torch 2.11 on an H100:
    NoValidChoicesError). Under ``auto`` such a call runs on the next backend, with a warning
    naming the error, and the failing signature is not compiled again; forced, it raises.
    Simulated on CPU: auto is let take flex here (on any CPU: nothing compiles), and the compile
    raises inductor's error."""
    import warnings

    InductorError = pytest.importorskip("torch._inductor.exc").__dict__.get("InductorError")
    if InductorError is None:
        pytest.skip("this torch has no InductorError")
    tries = []

    def failing(signature):
        def fn(*args):
            tries.append(signature)
            raise InductorError(RuntimeError("No choices to select"), "target: flex_attention")
        return fn

    monkeypatch.setattr(flex, "compiled_for", failing)
    monkeypatch.setattr(flex.FlexBackend, "auto_skip_reason", lambda self, call: None)
    monkeypatch.setattr(flex.FlexBackend, "auto_devices", ("cpu", "cuda"))
    monkeypatch.setattr(flex, "_CPU_VECTOR_ISA", "avx512")
    monkeypatch.setattr(flex, "_FAILED", type(flex._FAILED)())
    q, k, v = make_qkv(2, 4, 2, 40, 40, 16, seed=6)
    mask = M.Causal() & M.Document(torch.tensor([10, 30]))
    assert attnkit.describe_call(q, k, v, mask) == "flex"
    gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask)
    for _ in range(2):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = attnkit.attention(q, k, v, mask)
        torch.testing.assert_close(out.double(), gold, atol=1e-5, rtol=1e-4)
        assert any("FlexAttention failed to compile" in str(x.message) and "InductorError" in str(x.message)
                   for x in w), [str(x.message) for x in w]
    assert len(tries) == 1  # the second call knew the signature failed
    with pytest.raises(attnkit.BackendCompileFailed, match="InductorError"):
        attnkit.attention(q, k, v, mask, backend="flex")
