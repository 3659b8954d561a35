"""Decisions that run inside code torch.compile traces: availability and capability probes are
resolved once, eagerly, never inside the trace, and the CUDA policies are checked on CPU.

A ``find_spec`` in a backend's availability check must not run inside the compiled decode step of
``generate(compile=True)``: dynamo refuses ``importlib.util.find_spec`` on torch 2.11 and silently
answers None on 2.13. On CPU ``auto`` never asks the CUDA backends, so these tests ask for a CUDA
call's decision explicitly."""

from __future__ import annotations

import pytest
import torch

import attnkit  # noqa: F401  (registers the backends)
from attnkit.backends import registry
from attnkit.masks import ALiBi, Causal, KeyPadding, alibi_slopes


def _cuda_call(q_len, *, softcap=None, mask=None, D=128, Dv=128):
    return registry.AttentionCall(1, 16, 4, q_len, 512, D, Dv, torch.bfloat16, torch.device("cuda"), mask,
                                  0.1, 0.0, False, False, softcap=softcap)


def _traced_choice(call) -> str:
    """The backend ``auto`` selects for ``call`` inside a fullgraph torch.compile trace."""
    names = registry.backend_names()

    def pick(x):
        return x + float(names.index(registry.select(call).name))

    torch._dynamo.reset()
    return names[int(torch.compile(pick, fullgraph=True, backend="eager")(torch.zeros(1)).item())]


@pytest.mark.parametrize("name", registry.backend_names())
def test_backend_availability_traces_under_fullgraph_compile(name):
    """Every backend's ``available()`` gives the same answer inside a fullgraph trace as eagerly
    (no graph break, no probe that dynamo refuses or answers differently)."""
    b = registry.get_backend(name)
    eager = b.available()

    def probe(x):
        return x + (1.0 if b.available() is None else 2.0)

    torch._dynamo.reset()
    out = torch.compile(probe, fullgraph=True, backend="eager")(torch.zeros(1))
    assert out.item() == (1.0 if eager is None else 2.0), f"{name}: {eager!r}"


@pytest.mark.parametrize("call", [
    _cuda_call(1),  # a plain decode step
    _cuda_call(1, softcap=30.0),  # Gemma 2 decode
    _cuda_call(1, D=576, Dv=512, mask=Causal()),  # MLA decode
    _cuda_call(512, softcap=30.0, mask=Causal()),  # Gemma 2 prefill
    _cuda_call(512, mask=Causal() & ALiBi(alibi_slopes(16))),
    _cuda_call(512, mask=Causal()),
    _cuda_call(1, mask=KeyPadding(torch.tensor([300]))),  # a static cache's decode step
], ids=["decode", "decode-softcap", "mla-decode", "prefill-softcap", "prefill-alibi", "prefill-causal",
        "static-cache-decode"])
def test_auto_decision_for_a_cuda_call_is_the_same_under_compile(call):
    """``auto``'s choice for a CUDA call, made inside a fullgraph trace, equals the eager choice:
    the registry reads availability resolved beforehand, never probes inside the trace. With the
    native library loaded, so the CPU engine's compile rule (take traced calls once it is loaded)
    is asked too, and must still leave CUDA calls to the CUDA backends."""
    from attnkit import native

    native.load()
    eager = registry.select(call).name
    assert _traced_choice(call) == eager


@pytest.mark.parametrize("q_len", [1, 4])
def test_auto_decision_for_a_cpu_decode_call_is_the_same_under_compile(q_len):
    """A CPU decode call: with the native library loaded, ``auto`` picks the split-K engine inside
    a fullgraph trace as it does eagerly (not SDPA)."""
    from attnkit import native

    if native.load() is None:
        pytest.skip("the native kernel cannot be built here")
    call = registry.AttentionCall(1, 32, 8, q_len, 4096, 128, 128, torch.bfloat16, torch.device("cpu"), Causal(),
                                  0.1, 0.0, False, False)
    eager = registry.select(call).name
    assert eager == "decode" and _traced_choice(call) == eager


def test_compiled_decode_uses_cuda_graphs_on_cuda_and_a_cpp_wrapper_on_cpu():
    from attnkit.models.generation import compile_settings

    assert compile_settings("inductor", "cuda") == {"mode": "reduce-overhead"}
    assert compile_settings("inductor", "cpu") == {"options": {"cpp_wrapper": True}}
    assert compile_settings("aot_eager", "cuda") == {} and compile_settings("aot_eager", "cpu") == {}


def test_import_does_not_pull_in_dynamo():
    """``import attnkit`` costs about one ``import torch``: nothing imports torch._dynamo at import
    time (torch.nn.attention.bias and flex_attention do; they are imported on first use)."""
    import subprocess
    import sys

    code = "import sys, attnkit; print('torch._dynamo' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_compiled_cpu_decode_calls_the_split_k_kernel_once_it_is_loaded(storage):
    """Under torch.compile (fullgraph), a CPU decode call goes to the native split-K op once the
    library is loaded (its Meta kernel gives the traced shapes), reading an int8 QuantizedKV in
    place instead of dequantizing it for SDPA; the result equals the eager call."""
    from attnkit import QuantizedKV, native

    if native.load() is None:
        pytest.skip("the native kernel cannot be built here")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 1, 64, generator=g).bfloat16()
    k, v = torch.randn(2, 2, 300, 64, generator=g), torch.randn(2, 2, 300, 64, generator=g)
    kv = QuantizedKV.quantize(k, v, "int8") if storage == "int8" else k.bfloat16()
    mask = attnkit.masks.KeyPadding(torch.tensor([300, 123]))

    def call(q):
        return attnkit.attention(q, kv, None if storage == "int8" else v.bfloat16(), mask)

    targets = []

    def record(gm, inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes)
        return gm

    torch._dynamo.reset()
    out = torch.compile(call, backend=record, fullgraph=True)(q)
    assert any("attnkit_cpu.splitk_attention" in t for t in targets), targets
    assert not any("scaled_dot_product" in t for t in targets)
    torch.testing.assert_close(out, call(q), rtol=0, atol=0)


#: The native split-K op's schema. Inductor's cache keys a compiled graph by code that names the
#: op and its arguments, not its schema: a change here must change the arguments every call passes
#: or the op's name, or graphs cached before it call the new op with the old arguments.
SPLITK_SCHEMA = (
    "attnkit_cpu::splitk_attention(Tensor q, Tensor k, Tensor? v, Tensor? k_scale, Tensor? v_scale, "
    "int v_head_dim, Tensor? block_table, Tensor? lo, Tensor? hi, Tensor? bias, Tensor? slopes, Tensor? qpos, "
    "Tensor? sinks, float scale, float softcap, int num_kv_heads, bool return_lse, Tensor? sel_ids, "
    "int sel_block, Tensor? sel_lo, Tensor? sel_hi, Tensor? union_lo, Tensor? union_hi, "
    "int seq_div) -> (Tensor, Tensor)")


def test_the_split_k_op_schema_is_the_one_calls_are_written_for():
    from attnkit import native

    if native.load() is None:
        pytest.skip("the native kernel cannot be built here")
    assert str(torch.ops.attnkit_cpu.splitk_attention.default._schema) == SPLITK_SCHEMA


@pytest.mark.slow
def test_the_split_k_op_runs_from_inductors_cpp_wrapper():
    """The compiled decode step on CPU (``generate(compile=True)``: inductor with ``cpp_wrapper``)
    calls the native op from C++ with exactly the arguments the traced call named: a dense decode
    step, a selection step and a chunk of prefill with a selection give the eager call's numbers
    (an op schema with defaulted arguments made that call read past its arguments and crash)."""
    from attnkit import native
    from attnkit.models.generation import compile_settings

    if native.load() is None:
        pytest.skip("the native kernel cannot be built here")
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 300, 64, generator=g), torch.randn(2, 2, 300, 64, generator=g)
    q1, q5 = torch.randn(2, 8, 1, 64, generator=g), torch.randn(2, 8, 5, 64, generator=g)
    pad = attnkit.masks.KeyPadding(torch.tensor([300, 123]))
    sel1 = attnkit.masks.SelectedKeys(torch.randint(-1, 300, (2, 1, 9), generator=g)) & attnkit.masks.Causal()
    sel5 = attnkit.masks.SelectedBlocks(torch.randint(-1, 19, (2, 2, 5, 3), generator=g), 16, num_heads=8) & pad

    def step(q1, q5, k, v):
        return (attnkit.attention(q1, k, v, pad, backend="decode"), attnkit.attention(q1, k, v, sel1, backend="decode"),
                attnkit.attention(q5, k, v, sel5, backend="decode"))

    torch._dynamo.reset()
    with torch.inference_mode():
        got = torch.compile(step, fullgraph=True, **compile_settings("inductor", "cpu"))(q1, q5, k, v)
        want = step(q1, q5, k, v)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_v_from_k_check_traces_under_fullgraph_compile():
    """MLA's V is a prefix view of K's rows; eagerly the decode kernels read it once, through K.
    Under a trace tensors have no addresses (torch 2.11's dynamo failed compiled MLA decode on CUDA
    comparing data pointers), so the check answers False there and V is read through its own view."""
    from attnkit.backends.common import v_is_prefix_of_k

    k = torch.randn(1, 1, 8, 12)
    assert v_is_prefix_of_k(k, k[..., :8]) and not v_is_prefix_of_k(k, k[..., :8].clone())

    def probe(x):
        return x + (1.0 if v_is_prefix_of_k(x, x[..., :8]) else 2.0)

    torch._dynamo.reset()
    assert (torch.compile(probe, fullgraph=True, backend="eager")(k) == k + 2.0).all()
