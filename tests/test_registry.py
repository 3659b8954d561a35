"""The backend registry: custom backends, auto order, refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import attnkit
from attnkit.backends import registry
from attnkit.reference import attention_math

from conftest import make_qkv


class _OnlyFp64:
    name = "only_fp64_test"

    def __init__(self):
        self.calls = 0

    def available(self):
        return None

    def auto_skip_reason(self, call):
        return None

    def not_supported_reasons(self, call):
        return [] if call.dtype == torch.float64 else [f"dtype {call.dtype} (fp64 only)"]

    def run(self, q, k, v, call):
        self.calls += 1
        return attention_math(q, k, v, call.mask, scale=call.scale, return_weights=call.return_weights)


@pytest.fixture
def custom_backend():
    b = _OnlyFp64()
    before = registry.auto_order()
    attnkit.register_backend(b, before="decode")
    yield b
    registry._REGISTRY.pop(b.name)
    registry._AUTO_ORDER[:] = before


def test_custom_backend_takes_part_in_auto(custom_backend):
    q, k, v = make_qkv(1, 2, 1, 3, 5, 4, dtype=torch.float64)
    attnkit.attention(q, k, v)
    assert custom_backend.calls == 1
    q32, k32, v32 = (t.float() for t in (q, k, v))
    assert attnkit.describe_call(q32, k32, v32) != "only_fp64_test"  # refused, auto moves on
    with pytest.raises(attnkit.BackendNotSupported, match=r"only_fp64_test: dtype torch.float32 \(fp64 only\)"):
        attnkit.attention(q32, k32, v32, backend="only_fp64_test")


class _Counting(_OnlyFp64):
    """Accepts fp64 like its parent, counting how often it is asked."""

    def __init__(self, name, **attrs):
        super().__init__()
        self.name, self.asked = name, 0
        self.__dict__.update(attrs)

    def not_supported_reasons(self, call):
        self.asked += 1
        return super().not_supported_reasons(call)


@pytest.mark.parametrize("attrs, asked", [
    ({}, True),  # the protocol's defaults: any device, dense K/V
    ({"auto_devices": ("cpu",)}, True),
    ({"auto_devices": ("cuda",)}, False),  # auto skips it without asking on a CPU call
    ({"layouts": ("paged",)}, False),  # dense K/V cannot become paged
])
def test_auto_asks_only_backends_that_could_run_the_call(attrs, asked):
    b = _Counting("counting_test", **attrs)
    before = registry.auto_order()
    attnkit.register_backend(b, before="decode")
    try:
        q, k, v = make_qkv(1, 2, 1, 3, 5, 4, dtype=torch.float64)
        attnkit.attention(q, k, v)
        assert (b.asked, b.calls) == ((1, 1) if asked else (0, 0))
        before_asked = b.asked
        attnkit.attention(q, k, v, backend="counting_test")  # forcing asks it whatever auto skips
        assert b.asked == before_asked + 1
    finally:
        registry._REGISTRY.pop(b.name)
        registry._AUTO_ORDER[:] = before


def test_unknown_backend_names_the_choices():
    q, k, v = make_qkv(1, 2, 1, 3, 5, 4)
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        attnkit.attention(q, k, v, backend="nope")


def test_auto_skip_reason_passes_over_but_forcing_works():
    q, k, v = make_qkv(1, 8, 2, 1, 17, 16)  # a tiny decode step: SDPA's one call is faster
    assert attnkit.describe_call(q, k, v) == "sdpa"
    assert attnkit.describe_call(q, k, v, backend="decode") == "decode"
    assert registry.get_backend("decode").auto_skip_reason(
        registry.AttentionCall(1, 8, 2, 1, 17, 16, 16, torch.float32, torch.device("cpu"), None,
                               0.25, 0.0, False, False)) is not None


def test_auto_sends_only_unequal_width_cuda_decode_to_triton():
    """`auto` picks the Triton decode kernel on CUDA for MLA-style calls (K wider than V: SDPA has
    no fused kernel for them) and leaves equal widths and every CPU call to the other backends."""
    from attnkit.backends.triton import NO_CAUSAL, TritonBackend
    from attnkit.masks import Causal, KeyPadding, ReducedMask, SlidingWindow

    def decode_limits(mask, B, Sq, Sk, device):
        return ReducedMask(mask, B, Sq, Sk).limits(device, NO_CAUSAL)

    def call(device, D, Dv, mask=None, Sq=1):
        return registry.AttentionCall(2, 16, 1, Sq, 300, D, Dv, torch.bfloat16, torch.device(device), mask,
                                      0.1, 0.0, False, False)

    tb = TritonBackend()
    assert tb.auto_skip_reason(call("cuda", 576, 512)) is None
    assert "equal widths" in tb.auto_skip_reason(call("cuda", 128, 128))
    from dataclasses import replace as _replace
    assert tb.auto_skip_reason(_replace(call("cuda", 128, 128), kv_layout="paged")) is None  # read in place
    assert "not CUDA" in tb.auto_skip_reason(call("cpu", 576, 512))
    cache_mask = Causal(q_start=torch.tensor([298, 10])) & KeyPadding(torch.tensor([299, 12]))
    assert not any("mask" in r for r in tb.not_supported_reasons(call("cuda", 576, 512, cache_mask)))
    window_step = cache_mask & SlidingWindow(7, q_start=torch.tensor([298, 10]))  # a windowed layer's step
    assert not any("mask" in r for r in tb.not_supported_reasons(call("cuda", 576, 512, window_step)))
    two_windows = SlidingWindow(8) & SlidingWindow(4, 2)
    assert any("mask" in r for r in tb.not_supported_reasons(call("cuda", 576, 512, two_windows)))
    assert any("Sq=17" in r for r in tb.not_supported_reasons(call("cuda", 576, 512, Sq=17)))
    # The limits the kernel gets: query j of row b sees keys < min(q_start + j + 1, seq_lens),
    # and with a window only keys in [w - left, w + right], w = window_start + j.
    q_start, seq, w_start = decode_limits(cache_mask, 2, 1, 300, "cpu")
    assert q_start.tolist() == [298, 10] and seq.tolist() == [299, 12] and w_start is None
    assert decode_limits(window_step, 2, 1, 300, "cpu")[2].tolist() == [298, 10]
    assert decode_limits(SlidingWindow(3, None), 2, 2, 300, "cpu")[2].tolist() == [298, 298]
    q_start, seq, _ = decode_limits(Causal(), 2, 3, 300, "cpu")
    assert q_start.tolist() == [297, 297] and seq.tolist() == [300, 300]
    assert decode_limits(None, 2, 1, 300, "cpu")[0].min() > 300
    assert decode_limits(KeyPadding(torch.tensor([500, 3])), 2, 1, 300, "cpu")[1].tolist() == [300, 3]


def test_auto_gives_every_modifier_a_fused_path_on_cuda():
    """`auto`'s decision for CUDA calls, made on CPU from the call's description: prefill with a
    soft cap, sinks, ALiBi, an additive bias or a block-sparse mask goes to FlexAttention (fused,
    forward and backward), never to the materialized `math` path; decode-sized calls with a
    modifier go to the Triton decode kernel; plain and causal calls stay with SDPA."""
    from attnkit.masks import ALiBi, Additive, Causal, Document, KeyPadding, SlidingWindow, alibi_slopes

    if registry.get_backend("flex").available() is not None:
        pytest.skip("torch without FlexAttention")

    def call(Sq, mask=None, grad=False, **mods):
        return registry.AttentionCall(2, 16, 4, Sq, 2048, 128, 128, torch.bfloat16, torch.device("cuda"), mask,
                                      0.1, 0.0, False, grad, **mods)

    sinks = torch.zeros(16)
    prefill = {
        "softcap": call(2048, Causal(), softcap=30.0),
        "sinks": call(2048, Causal(), sinks=sinks),
        "sinks+window": call(2048, SlidingWindow(127), sinks=sinks),
        "alibi": call(2048, ALiBi(alibi_slopes(16)) & Causal()),
        "alibi+window+padding": call(2048, ALiBi(alibi_slopes(16)) & SlidingWindow(127) & KeyPadding(torch.tensor([9, 2048]))),
        "additive": call(2048, Additive(torch.zeros(2048, 2048)) & Causal()),
        "window": call(2048, SlidingWindow(127)),
        "documents": call(2048, Causal() & Document(torch.tensor([1000, 1048]))),
        "ragged causal": call(2048, Causal(q_start=torch.tensor([0, 5]))),
    }
    for name, c in prefill.items():
        assert registry.select(c).name == "flex", name
        assert registry.select(replace(c, needs_grad=True)).name == "flex", f"{name} (backward)"
    for c in (call(2048), call(2048, Causal()), call(2048, KeyPadding(torch.tensor([9, 2048])))):
        assert registry.select(c).name == "sdpa"
    if registry.get_backend("triton").available() is None:
        for c in (call(1, Causal(), softcap=30.0), call(1, Causal(), sinks=sinks), call(1, ALiBi(alibi_slopes(16))),
                  call(1, SlidingWindow(127), sinks=sinks),  # gpt-oss's windowed layers: not the math path
                  replace(call(1, SlidingWindow(127)), kv_layout="paged"),  # pages read in place, not gathered
                  replace(call(1, SlidingWindow(127)), kv_layout="quantized")):  # int8 / fp8 read in place
            assert registry.select(c).name == "triton"
        assert registry.select(call(1, Causal())).name == "sdpa"
    # On CPU the same calls never go to flex (its compile does not pay off; the split-K engine fuses them).
    cpu = replace(prefill["softcap"], device=torch.device("cpu"))
    assert registry.select(cpu).name != "flex"


_OLD_PATHS = {
    "attnkit.backends.cpu_splitk": ["SplitKBackend", "MAX_DECODE_Q_LEN", "auto_skip", "decode_refusals"],
    "attnkit.backends.cpu_splitk.backend": ["SplitKBackend", "MAX_DECODE_Q_LEN", "auto_skip", "decode_refusals"],
    "attnkit.backends.cpu_splitk.engine": ["splitk_attention", "merge_partials", "finite", "with_sinks",
                                           "v_is_prefix_of_k", "Q_CHUNK", "engine_name"],
    "attnkit.backends.triton_splitk": ["TritonBackend", "NO_CAUSAL", "MAX_Q_LEN", "interpreting"],
    "attnkit.backends.triton_splitk.kernel": ["paged_decode_attention", "decode_attention", "available",
                                              "NO_CAUSAL"],
}


@pytest.mark.parametrize("old", list(_OLD_PATHS))
def test_old_backend_import_paths_still_work_with_a_deprecation_warning(old):
    """The backends' folders are named as the backends are (decode/, triton/); the old import
    paths re-export their names, warning with the new path."""
    import importlib
    import sys

    from attnkit.backends import common, decode, triton

    for name in [m for m in sys.modules if m == old or m.startswith(old + ".")]:
        sys.modules.pop(name)
    with pytest.warns(DeprecationWarning, match="deprecated; use attnkit.backends"):
        module = importlib.import_module(old)
    for name in _OLD_PATHS[old]:
        assert getattr(module, name) is not None, name
    if hasattr(module, "SplitKBackend"):
        assert module.SplitKBackend is decode.DecodeBackend and module.decode_refusals is common.decode_refusals
    if hasattr(module, "TritonBackend"):
        assert module.TritonBackend is triton.TritonBackend
    if old.endswith("engine"):
        assert module.merge_partials is common.merge_partials
        with pytest.warns(DeprecationWarning, match="implementation"):
            assert module.engine_name() in ("native", "torch")


def test_attention_call_keeps_its_old_head_count_names_deprecated():
    """``num_heads`` / ``num_kv_heads`` are the fields; ``q_heads`` / ``kv_heads`` still work as
    keywords and properties, with a DeprecationWarning naming the new spelling."""
    from dataclasses import replace

    kw = dict(batch=1, q_len=1, kv_len=4, head_dim=8, v_head_dim=8, dtype=torch.float32, device=torch.device("cpu"),
              mask=None, scale=1.0, dropout_p=0.0, return_weights=False, needs_grad=False)
    with pytest.warns(DeprecationWarning, match="num_kv_heads"):
        call = registry.AttentionCall(q_heads=8, kv_heads=2, **kw)
    assert (call.num_heads, call.num_kv_heads, call.groups) == (8, 2, 4)
    assert call == registry.AttentionCall(num_heads=8, num_kv_heads=2, **kw)
    with pytest.warns(DeprecationWarning, match="num_heads"):
        assert call.q_heads == 8
    with pytest.warns(DeprecationWarning, match="num_kv_heads"):
        assert call.kv_heads == 2
    with pytest.raises(TypeError, match="pass num_kv_heads="):
        registry.AttentionCall(num_heads=8, num_kv_heads=2, kv_heads=2, **kw)
    assert replace(call, q_len=2).num_kv_heads == 2
