"""``Linear``: ``nn.Linear`` whose decode-time calls on CPU stream the weights at memory speed.

Notation: ``x (..., K) -> (..., N)``; ``weight (N, K)``, ``bias (N,)``; ``M = x.numel() // K``
rows of x (the leading dims flattened).

One decode step of a batch of M sequences multiplies M rows by every weight matrix: each weight is
read once and used M times, so for small M the layer runs at the speed the weights stream from
memory. torch's CPU GEMM is built for large M: on a matrix-vector product it can stream the
weights well below the read bandwidth (bf16 on every CPU measured, fp32 on some). The native kernel
(``torch.ops.attnkit_cpu.linear_rows``, ``attnkit/native/linear.cpp``) splits the N output rows
over torch's intra-op threads and walks each thread's rows a few at a time against all M rows of
x held in cache, widening bf16 weights to fp32 in registers (or, with AVX-512-BF16, taking bf16
pairs in its dot product), summing in fp32.

When the kernel runs (:func:`native_applies`): a CPU ``x`` and ``weight`` of one dtype, fp32 or
bf16 (with a bias of that dtype, if any), a contiguous weight, at most :func:`native_max_rows` rows,
nothing that wants a gradient (autograd goes to ``F.linear``, whose backward torch has), and the
native library built here (:mod:`attnkit.native`). Everything else is ``F.linear``: same shapes,
same dtype, results that differ only by the order of the fp32 sums.

When torch's op is kept (:func:`native_max_rows`, a function of the dtype and the CPU's flags):
above 8 rows always (torch's GEMM is compute-bound by then and blocks for it); for bf16 above 4
rows on CPUs with AMX-BF16, whose tile instructions oneDNN uses for torch's bf16 GEMM: the native
kernel's vector dot products grow with M while the AMX tiles take 16 rows at the cost of one, so
past a few rows the tiles win. fp32 has no such unit; there the native kernel takes every M up to
8. (benchmarks/bench_linear.py measures both; one machine's table is
benchmarks/results/xeon-amx/linear.md.)

Many rows of 16-bit weights (a prompt) on a CPU without a 16-bit GEMM unit
(:func:`upcast_min_rows`, a function of the dtype and the CPU's flags): torch's bf16 / fp16 GEMM
runs at a fraction of its fp32 GEMM there (it widens the operands inside its inner loops, or, on
AVX2, runs a generic kernel), so ``Linear`` upcasts the weights a slab of rows at a time
(:data:`UPCAST_SLAB_BYTES` of fp32), multiplies by the fp32 GEMM and rounds once, after the bias
is added in fp32: exact widening, fp32 sums, one rounding, the same error bound as torch's 16-bit
GEMM (which sums in fp32 too). It needs no gradient (autograd keeps ``F.linear``) and holds an fp32
copy of x, one slab and one slab of outputs at a time. AMX-BF16 / AMX-FP16 and AVX-512-FP16 CPUs
keep torch's op (oneDNN's tiles or fp16 instructions are faster); AVX-512-BF16 ones upcast from
:data:`_BF16_DOT_UPCAST_ROWS` rows, where the fp32 GEMM's speed pays for the slab copies.

Under ``torch.compile`` (``fullgraph=True`` included) the decision traces like any shape check and
the graph calls the kernel as an op with a Meta kernel for its output shape: the C++ op itself when
the library is already loaded while tracing (it is after any eager call, such as a prefill), else
``torch.ops.attnkit.linear_rows``, a Python custom op that loads the library when the compiled code
first runs (never while tracing) and runs ``F.linear`` if it cannot. (Loading it changes what the
trace read, so such a graph is traced once more, onto the C++ op.)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import native
from .._sysinfo import cpu_flags

__all__ = ["Linear", "LinearInputError", "MAX_ROWS", "UPCAST_SLAB_BYTES", "native_max_rows", "native_applies",
           "half_gemm_unit", "upcast_min_rows", "upcast_applies"]

#: The most rows of x the native kernel takes (``kMaxRows`` in ``native/linear.cpp``).
MAX_ROWS = 8
#: bf16 rows above which torch's GEMM is kept on a CPU with AMX-BF16 (see the module docstring).
_AMX_BF16_ROWS = 4
#: bf16 rows from which an AVX-512-BF16 CPU (no AMX) runs the upcast GEMM: where the fp32 GEMM's
#: lead over torch's bf16 GEMM pays for the slab copies (benchmarks/results/xeon-amx/linear.md).
_BF16_DOT_UPCAST_ROWS = 128
#: fp32 bytes of weights one slab of the upcast GEMM widens at a time.
UPCAST_SLAB_BYTES = 16 << 20


class LinearInputError(ValueError, RuntimeError):
    """An ``x`` that does not fit the layer: a ``ValueError`` (attnkit's rule) and the
    ``RuntimeError`` that ``nn.Linear`` raises for it, so code written against either catches it."""


def native_max_rows(dtype: torch.dtype, flags: frozenset[str] | set[str]) -> int:
    """How many rows of x the native kernel takes for ``dtype`` on a CPU with feature ``flags``
    (``/proc/cpuinfo`` names): 0 for a dtype it does not take; for bf16 with ``amx_bf16``,
    ``4``; else :data:`MAX_ROWS`. A pure function, so the rule for any CPU is testable on this one."""
    if dtype == torch.float32:
        return MAX_ROWS
    if dtype == torch.bfloat16:
        return _AMX_BF16_ROWS if "amx_bf16" in flags else MAX_ROWS
    return 0


#: This CPU's answers, read once at import (never inside code torch.compile traces).
_MAX_ROWS_HERE = {dt: native_max_rows(dt, cpu_flags()) for dt in (torch.float32, torch.bfloat16)}


def half_gemm_unit(dtype: torch.dtype, flags: frozenset[str] | set[str]) -> bool:
    """Whether a CPU with feature ``flags`` (``/proc/cpuinfo`` names) has instructions torch's
    ``dtype`` GEMM runs on natively: bf16 with ``avx512_bf16`` or ``amx_bf16``, fp16 with
    ``avx512_fp16`` or ``amx_fp16``. Without them torch widens the operands inside its own
    loops, or runs a generic kernel, far slower than its fp32 GEMM."""
    if dtype == torch.bfloat16:
        return "avx512_bf16" in flags or "amx_bf16" in flags
    if dtype == torch.float16:
        return "avx512_fp16" in flags or "amx_fp16" in flags
    return False


def upcast_min_rows(dtype: torch.dtype, flags: frozenset[str] | set[str]) -> int | None:
    """From how many rows of x ``Linear`` runs a ``dtype`` call as an fp32 GEMM over upcast weights
    on a CPU with feature ``flags``; None: never (fp32 and fp64; 16-bit with AMX, and fp16 with
    AVX-512-FP16). Without a :func:`half_gemm_unit`: every call past the native kernel's
    :data:`MAX_ROWS`; bf16 with AVX-512-BF16 and no AMX: :data:`_BF16_DOT_UPCAST_ROWS`. A pure
    function, so the rule for any CPU is testable on this one."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    if not half_gemm_unit(dtype, flags):
        return MAX_ROWS + 1
    return _BF16_DOT_UPCAST_ROWS if dtype == torch.bfloat16 and "amx_bf16" not in flags else None


def _inference_on_cpu(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """CPU x and 2-D weight of one dtype, K > 0, a bias of that dtype on CPU (or none), and no
    gradient wanted: what both of ``Linear``'s own paths need (attribute reads only)."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and weight.dim() == 2 and weight.shape[-1] > 0
            and x.dtype == weight.dtype
            and (bias is None or (bias.dtype == x.dtype and bias.device.type == "cpu"))
            and not (torch.is_grad_enabled()
                     and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))))


def native_applies(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether ``Linear`` gives this call to the native kernel on this CPU, apart from the library
    being built: CPU tensors of one dtype the kernel takes, a contiguous weight, at most
    ``native_max_rows`` rows, no gradient wanted. (Runs on every projection of a decode step, and
    inside traced code: attribute reads only.)"""
    return (_inference_on_cpu(x, weight, bias) and x.dtype in _MAX_ROWS_HERE
            and x.numel() // weight.shape[-1] <= _MAX_ROWS_HERE[x.dtype] and weight.is_contiguous())


#: This CPU's :func:`upcast_min_rows`, read once at import.
_UPCAST_ROWS_HERE = {dt: upcast_min_rows(dt, cpu_flags()) for dt in (torch.bfloat16, torch.float16)}


def upcast_applies(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether ``Linear`` runs this call as the upcast fp32 GEMM on this CPU: CPU tensors of one
    16-bit dtype, a 2-D weight, at least :func:`upcast_min_rows` rows, no gradient wanted."""
    rows = _UPCAST_ROWS_HERE.get(x.dtype)
    return rows is not None and _inference_on_cpu(x, weight, bias) and x.numel() // weight.shape[-1] >= rows


def upcast_linear(x: Tensor, weight: Tensor, bias: Tensor | None, slab_bytes: int = UPCAST_SLAB_BYTES) -> Tensor:
    """``F.linear(x, weight, bias)`` for 16-bit x (..., K), weight (N, K), bias (N,) computed in
    fp32: x widened once, the weights a slab of rows (``slab_bytes`` of fp32, at least 64 rows)
    at a time, each slab's outputs (M, n) summed by the fp32 GEMM, the bias added in fp32, then
    rounded once to x's dtype. Inference only (see :func:`upcast_applies`).

    Raises:
        ValueError: weight not 2-D, x's last dim not K, or bias not (N,).
        TypeError: x, weight or bias of different dtypes."""
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"upcast_linear needs x (..., K) and weight (N, K), got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be (N,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}, "
                        f"{None if bias is None else bias.dtype}")
    N, K = weight.shape
    xf = x.reshape(-1, K).float()
    M = xf.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    step = max(64, slab_bytes // (4 * max(K, M, 1)))  # a slab of weights and of outputs within the bytes
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        w = weight[n0:n1].float()
        if bias is None:
            y = xf @ w.T
        else:
            y = torch.addmm(bias[n0:n1].float(), xf, w.T)
        out[:, n0:n1] = y
    return out.view(*x.shape[:-1], N)


@torch.library.custom_op("attnkit::linear_rows", mutates_args=())
def _linear_rows_deferred(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """The native kernel for a graph traced before the library was loaded: loads it now (at run
    time, outside tracing) and runs it, or ``F.linear`` where it cannot be built."""
    ops = native.load()
    return F.linear(x, weight, bias) if ops is None else ops.linear_rows(x, weight, bias)


@_linear_rows_deferred.register_fake
def _(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _linear_rows(x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """``x2 (M, K) @ weight.T + bias`` by the native kernel, or None when the library is not built
    here. Eagerly the first call builds it (:func:`attnkit.native.load`); traced code only reads
    whether it is loaded and otherwise calls the deferred op, which builds it at run time."""
    if torch.compiler.is_compiling():
        if native.library_path() is not None:  # loaded: the C++ op (its Meta kernel gives the shape)
            return torch.ops.attnkit_cpu.linear_rows(x2, weight, bias)
        return torch.ops.attnkit.linear_rows(x2, weight, bias)
    ops = native.load()
    return None if ops is None else ops.linear_rows(x2, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, state_dict names and initialisation) that runs the native
    weight-streaming kernel for calls of a few rows on CPU (see the module docstring).

    Shapes: x (..., in_features) -> (..., out_features), x's dtype.

    Equivalent PyTorch code: ``torch.nn.functional.linear(x, self.weight, self.bias)``.

    >>> import torch
    >>> m = Linear(16, 4)
    >>> x = torch.randn(2, 16)
    >>> with torch.no_grad():
    ...     torch.testing.assert_close(m(x), torch.nn.functional.linear(x, m.weight, m.bias))
    """

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.weight, self.bias
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a Tensor for Linear({self.in_features}, {self.out_features}), "
                            f"got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != w.shape[-1]:
            raise LinearInputError(f"x must be a (..., {w.shape[-1]}) tensor for Linear({self.in_features}, "
                                   f"{self.out_features}), got shape {tuple(x.shape)}")
        if native_applies(x, w, b):
            y = _linear_rows(x.reshape(-1, w.shape[-1]), w, b)
            if y is not None:
                return y.view(*x.shape[:-1], w.shape[0])
        if upcast_applies(x, w, b):
            return upcast_linear(x, w, b)
        return F.linear(x, w, b)
