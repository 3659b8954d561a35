"""The bad-input table (docs/testing.md): every row is a call of ``attnkit.attention`` (and of
``attnkit.describe_call``, which validates the same way) that must raise ``ValueError`` or
``TypeError`` with a message naming the offending argument and, where shapes are involved, the
offending shape exactly as ``tuple(t.shape)`` prints it.

Mask *constructor* arguments are covered in test_masks.py; here every mask problem is seen
through the public entry point. Empty inputs are not errors (test_attention.py::test_empty_inputs).
Note that a value head dim different from the key head dim is legal (Dv != D), so the head-dim
rows below pit q against k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

import attnkit
from attnkit import masks as M

from conftest import make_qkv

# The good call every row breaks one thing of: GQA so head-count rows mean something.
B, HQ, HKV, SQ, SK, D = 2, 4, 2, 3, 5, 8
QS, KS, VS = (B, HQ, SQ, D), (B, HKV, SK, D), (B, HKV, SK, D)


def qkv(dtype=torch.float32):
    return make_qkv(B, HQ, HKV, SQ, SK, D, dtype=dtype, seed=7)


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)


@dataclass
class Row:
    id: str
    exc: tuple
    needles: list[str]
    # Builds (q, k, v, mask, kwargs); anything that raises inside counts as part of the call.
    build: Callable[[], tuple] = field(repr=False)
    needs_cuda: bool = False


def call(q=None, k=None, v=None, mask=None, **kw):
    dq, dk, dv = qkv()
    return (dq if q is None else q, dk if k is None else k, dv if v is None else v, mask, kw)


VE, TE, EITHER = (ValueError,), (TypeError,), (ValueError, TypeError)


def _rows() -> list[Row]:
    rows = [
        # ---- ranks
        Row("q_rank3", VE, ["q", "(4, 3, 8)"], lambda: call(q=t(HQ, SQ, D))),
        Row("q_rank5", VE, ["q", "(1, 2, 4, 3, 8)"], lambda: call(q=t(1, *QS))),
        Row("k_rank3", VE, ["k", "(2, 5, 8)"], lambda: call(k=t(HKV, SK, D))),
        Row("k_rank5", VE, ["k", "(1, 2, 2, 5, 8)"], lambda: call(k=t(1, *KS))),
        Row("v_rank2", VE, ["v", "(5, 8)"], lambda: call(v=t(SK, D))),
        Row("v_rank0", VE, ["v", "()"], lambda: call(v=torch.tensor(1.0))),
        Row("q_not_tensor", TE, ["q", "list"], lambda: call(q=[[1.0]])),
        Row("v_not_tensor", TE, ["v", "NoneType"], lambda: (*qkv()[:2], None, None, {})),
        # ---- sizes that do not agree
        Row("batch_k_vs_v", VE, ["batch", "(3, 2, 5, 8)", "(2, 2, 5, 8)"], lambda: call(k=t(3, HKV, SK, D))),
        Row("batch_v_vs_k", VE, ["batch", "(2, 2, 5, 8)", "(1, 2, 5, 8)"], lambda: call(v=t(1, HKV, SK, D))),
        Row("batch_q_vs_kv", VE, ["batch", "(3, 4, 3, 8)"], lambda: call(q=t(3, HQ, SQ, D))),
        Row("heads_k_vs_v", VE, ["heads", "(2, 1, 5, 8)", "(2, 2, 5, 8)"], lambda: call(k=t(B, 1, SK, D))),
        Row("heads_v_vs_k", VE, ["heads", "(2, 2, 5, 8)", "(2, 4, 5, 8)"], lambda: call(v=t(B, 4, SK, D))),
        Row("seq_k_vs_v", VE, ["sequence length", "(2, 2, 6, 8)", "(2, 2, 5, 8)"],
            lambda: call(k=t(B, HKV, 6, D))),
        Row("seq_v_vs_k", VE, ["sequence length", "(2, 2, 4, 8)"], lambda: call(v=t(B, HKV, 4, D))),
        Row("head_dim_k_vs_q", VE, ["head dim", "(2, 4, 3, 8)", "(2, 2, 5, 7)"], lambda: call(k=t(B, HKV, SK, 7))),
        Row("head_dim_q_vs_k", VE, ["head dim", "(2, 4, 3, 9)", "(2, 2, 5, 8)"], lambda: call(q=t(B, HQ, SQ, 9))),
        Row("head_dim_zero", VE, ["head dim", "(2, 4, 3, 0)"],
            lambda: call(q=t(B, HQ, SQ, 0), k=t(B, HKV, SK, 0), v=t(B, HKV, SK, 0))),
        Row("hq_not_multiple_of_hkv", VE, ["heads", "(2, 5, 3, 8)", "(2, 2, 5, 8)"],
            lambda: call(q=t(B, 5, SQ, D))),
        Row("hq_less_than_hkv", VE, ["heads", "(2, 1, 3, 8)", "(2, 2, 5, 8)"], lambda: call(q=t(B, 1, SQ, D))),
        Row("hkv_zero", VE, ["heads", "(2, 0, 5, 8)"], lambda: call(k=t(B, 0, SK, D), v=t(B, 0, SK, D))),
        # ---- dtypes
        Row("dtype_k_fp16", TE, ["dtype", "k torch.float16", "q torch.float32"],
            lambda: call(k=t(*KS, dtype=torch.float16))),
        Row("dtype_v_bf16", TE, ["dtype", "v torch.bfloat16"], lambda: call(v=t(*VS, dtype=torch.bfloat16))),
        Row("dtype_q_fp64", TE, ["dtype", "q torch.float64"], lambda: call(q=t(*QS, dtype=torch.float64))),
        Row("integer_q", TE, ["q", "torch.int64"], lambda: call(q=torch.ones(*QS, dtype=torch.int64))),
        Row("integer_k", TE, ["k", "torch.int32"], lambda: call(k=torch.ones(*KS, dtype=torch.int32))),
        Row("integer_v_uint8", TE, ["v", "torch.uint8"], lambda: call(v=torch.ones(*VS, dtype=torch.uint8))),
        Row("bool_q", TE, ["q", "torch.bool"], lambda: call(q=torch.ones(*QS, dtype=torch.bool))),
        Row("complex_q", TE, ["q", "torch.complex64"], lambda: call(q=torch.ones(*QS, dtype=torch.complex64))),
        # ---- devices (CUDA only)
        Row("device_k", VE, ["device", "k cuda"], lambda: call(k=t(*KS).cuda()), needs_cuda=True),
        Row("device_mask", VE, ["mask", "cuda"],
            lambda: call(mask=torch.ones(SQ, SK, dtype=torch.bool, device="cuda")), needs_cuda=True),
        # ---- masks that do not broadcast to (B, Hq, Sq, Sk) = (2, 4, 3, 5)
        Row("bool_mask_bad_sk", VE, ["mask", "(2, 1, 3, 6)", "(2, 4, 3, 5)"],
            lambda: call(mask=torch.ones(B, 1, SQ, 6, dtype=torch.bool))),
        Row("bool_mask_bad_batch", VE, ["mask", "(3, 1, 3, 5)"],
            lambda: call(mask=torch.ones(3, 1, SQ, SK, dtype=torch.bool))),
        Row("bool_mask_kv_heads", VE, ["mask", "(1, 2, 3, 5)"],  # per-KV-head is not per-query-head
            lambda: call(mask=torch.ones(1, HKV, SQ, SK, dtype=torch.bool))),
        Row("bool_mask_5d", VE, ["mask", "(1, 2, 4, 3, 5)"],
            lambda: call(mask=torch.ones(1, B, HQ, SQ, SK, dtype=torch.bool))),
        Row("bool_mask_2d_transposed", VE, ["mask", "(5, 3)"],
            lambda: call(mask=torch.ones(SK, SQ, dtype=torch.bool))),
        Row("bool_mask_with_causal", VE, ["mask", "(4, 5)"],
            lambda: call(mask=torch.ones(4, SK, dtype=torch.bool), causal=True)),
        Row("float_mask_bad_sq", VE, ["mask", "(4, 5)"], lambda: call(mask=torch.zeros(4, SK))),
        Row("float_mask_fp16_bad_batch", VE, ["mask", "(3, 1, 1, 5)"],
            lambda: call(mask=torch.zeros(3, 1, 1, SK, dtype=torch.float16))),
        Row("dense_object_bad", VE, ["mask", "(3, 6)"],
            lambda: call(mask=M.Dense(torch.ones(SQ, 6, dtype=torch.bool)))),
        Row("additive_in_and_bad", VE, ["mask", "(1, 1, 3, 4)"],
            lambda: call(mask=M.Causal() & M.Additive(torch.zeros(1, 1, SQ, 4)))),
        Row("integer_mask_int64", TE, ["mask", "torch.int64", "(2, 1, 3, 5)"],
            lambda: call(mask=torch.ones(B, 1, SQ, SK, dtype=torch.int64))),
        Row("integer_mask_uint8", TE, ["mask", "torch.uint8", "(3, 5)"],
            lambda: call(mask=torch.ones(SQ, SK, dtype=torch.uint8))),
        Row("integer_mask_with_causal", TE, ["mask", "torch.int32"],
            lambda: call(mask=torch.ones(SQ, SK, dtype=torch.int32), causal=True)),
        Row("mask_not_tensor", TE, ["mask", "list"], lambda: call(mask=[[True] * SK] * SQ)),
        Row("mask_and_tensor", TE, ["Mask", "Tensor"],
            lambda: call(mask=M.Causal() & torch.ones(SQ, SK, dtype=torch.bool))),
        Row("key_padding_lengths_batch", VE, ["lengths", "(3,)"],
            lambda: call(mask=M.KeyPadding(torch.tensor([1, 2, 3])))),
        Row("key_padding_lengths_2d", VE, ["lengths", "(2, 1)"],
            lambda: call(mask=M.KeyPadding(torch.tensor([[1], [2]])))),
        Row("key_padding_valid_shape", VE, ["valid", "(2, 6)"],
            lambda: call(mask=M.KeyPadding(valid=torch.ones(B, 6, dtype=torch.bool)))),
        Row("query_padding_lengths_batch", VE, ["lengths", "(4,)"],
            lambda: call(mask=M.QueryPadding(torch.tensor([1, 2, 3, 1])))),
        Row("causal_q_start_batch", VE, ["q_start", "(3,)"],
            lambda: call(mask=M.Causal(q_start=torch.tensor([0, 1, 2])))),
        Row("window_q_start_batch_in_and", VE, ["q_start", "(5,)"],
            lambda: call(mask=M.KeyPadding(torch.tensor([5, 5]))
                         & M.SlidingWindow(2, q_start=torch.zeros(5, dtype=torch.long)))),
        Row("prefix_lengths_batch", VE, ["prefix_lengths", "(3,)"],
            lambda: call(mask=M.PrefixLM(torch.tensor([1, 1, 1])))),
        Row("document_lengths_past_sq", VE, ["lengths", "4", "3"],
            lambda: call(mask=M.Document(torch.tensor([2, 2])))),
        Row("document_kv_lengths_past_sk", VE, ["kv_lengths", "6", "5"],
            lambda: call(mask=M.Document(torch.tensor([1, 2]), torch.tensor([3, 3])))),
        Row("document_per_batch_past_sq", VE, ["lengths", "4", "3"],  # only batch item 1 overflows
            lambda: call(mask=M.Document(torch.tensor([[1, 2], [3, 1]]), torch.tensor([[2, 2], [2, 2]])))),
        Row("document_lengths_batch", VE, ["lengths", "(3, 1)"],
            lambda: call(mask=M.Document(torch.tensor([[1], [1], [1]])))),
        Row("document_with_causal_past_sq", VE, ["lengths", "5", "3"],
            lambda: call(mask=M.Document(torch.tensor([1, 1, 3]), torch.tensor([5])), causal=True)),
        # ---- dropout_p outside [0, 1)
        Row("dropout_negative", EITHER, ["dropout_p", "-0.1"], lambda: call(dropout_p=-0.1)),
        Row("dropout_one", EITHER, ["dropout_p", "1.0"], lambda: call(dropout_p=1.0)),
        Row("dropout_one_int", EITHER, ["dropout_p", "1"], lambda: call(dropout_p=1)),
        Row("dropout_above_one", EITHER, ["dropout_p", "1.5"], lambda: call(dropout_p=1.5)),
        Row("dropout_nan", EITHER, ["dropout_p", "nan"], lambda: call(dropout_p=math.nan)),
        Row("dropout_inf", EITHER, ["dropout_p", "inf"], lambda: call(dropout_p=math.inf)),
        Row("dropout_string", EITHER, ["dropout_p", "'0.1'"], lambda: call(dropout_p="0.1")),
        Row("dropout_bool", EITHER, ["dropout_p", "True"], lambda: call(dropout_p=True)),
        # ---- backend
        Row("backend_unknown", VE, ["backend", "'no_such_backend'"], lambda: call(backend="no_such_backend")),
        Row("backend_wrong_case", VE, ["backend", "'SDPA'"], lambda: call(backend="SDPA")),
        Row("backend_none", TE, ["backend", "NoneType"], lambda: call(backend=None)),
        Row("backend_int", TE, ["backend", "int"], lambda: call(backend=1)),
        Row("backend_list", TE, ["backend", "list"], lambda: call(backend=["math"])),
        # ---- causal
        Row("causal_int", TE, ["causal", "int"], lambda: call(causal=1)),
        Row("causal_str", TE, ["causal", "str"], lambda: call(causal="True")),
        Row("causal_none", TE, ["causal", "NoneType"], lambda: call(causal=None)),
        Row("causal_tensor", TE, ["causal", "Tensor"], lambda: call(causal=torch.tensor(True))),
        Row("causal_int_with_mask", TE, ["causal", "int"],
            lambda: call(mask=M.KeyPadding(torch.tensor([5, 5])), causal=0)),
        # ---- scale
        Row("scale_str", EITHER, ["scale", "'0.5'"], lambda: call(scale="0.5")),
        Row("scale_inf", EITHER, ["scale", "inf"], lambda: call(scale=math.inf)),
        Row("scale_neg_inf", EITHER, ["scale", "-inf"], lambda: call(scale=-math.inf)),
        Row("scale_nan", EITHER, ["scale", "nan"], lambda: call(scale=math.nan)),
        Row("scale_bool", EITHER, ["scale", "True"], lambda: call(scale=True)),
        Row("scale_tensor", EITHER, ["scale", "tensor"], lambda: call(scale=torch.tensor(0.5))),
        # ---- return_weights
        Row("return_weights_int", TE, ["return_weights", "int"], lambda: call(return_weights=1)),
        Row("return_weights_none", TE, ["return_weights", "NoneType"], lambda: call(return_weights=None)),
    ]
    ids = [r.id for r in rows]
    assert len(ids) == len(set(ids)), "duplicate row ids"
    return rows


ROWS = _rows()


@pytest.mark.parametrize("entry", ["attention", "describe_call"])
@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_table(row: Row, entry: str):
    if row.needs_cuda and not torch.cuda.is_available():
        pytest.skip("needs CUDA (a second device to disagree with)")
    fn = attnkit.attention if entry == "attention" else attnkit.describe_call
    with pytest.raises(row.exc) as ei:
        q, k, v, mask, kw = row.build()
        fn(q, k, v, mask, **kw)
    # BackendNotSupported is a ValueError, but it is the answer to a *valid* call a backend
    # cannot run; a bad argument must be rejected before any backend is asked.
    assert not isinstance(ei.value, attnkit.BackendNotSupported), f"{row.id}: {ei.value}"
    msg = str(ei.value)
    for needle in row.needles:
        assert needle in msg, f"{row.id}: {needle!r} not in error message {msg!r}"


# ---- bad backends on calls with nothing to compute (empty inputs take a separate path)

EMPTY = [(0, 3, 4), (2, 0, 4), (2, 3, 0)]


@pytest.mark.parametrize("B_,Sq,Sk", EMPTY)
@pytest.mark.parametrize("backend,exc", [("no_such_backend", ValueError), (None, (ValueError, TypeError)),
                                         (1, (ValueError, TypeError))])
def test_bad_backend_rejected_on_empty_inputs(B_, Sq, Sk, backend, exc):
    q, k, v = make_qkv(B_, 4, 2, Sq, Sk, 8)
    with pytest.raises(exc, match="backend"):
        attnkit.attention(q, k, v, backend=backend)


def test_unhashable_backend_on_empty_inputs_names_the_argument():
    q, k, v = make_qkv(2, 4, 2, 0, 4, 8)
    with pytest.raises(TypeError) as ei:
        attnkit.attention(q, k, v, backend=["math"])
    assert "backend" in str(ei.value), str(ei.value)


def test_describe_call_rejects_unknown_backend_on_empty_inputs():
    q, k, v = make_qkv(2, 4, 2, 0, 4, 8)
    with pytest.raises(ValueError, match="backend"):
        attnkit.attention(q, k, v, backend="no_such_backend")  # attention agrees: an error
    with pytest.raises(ValueError, match="backend"):
        attnkit.describe_call(q, k, v, backend="no_such_backend")
