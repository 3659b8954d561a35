// A linear layer for a few rows: out = x @ weight.T + bias, for x (M, K) with M <= kMaxRows
// (1..8: one decode step of a small batch), weight (N, K) contiguous, fp32 or bf16. attnkit's
// `Linear` (`attnkit.modules.linear`) runs it at decode time on CPU.
//
// At batch 1 a linear layer is a matrix-vector product: every weight is read once and used once
// (M times), so its speed is the speed at which the weights stream from memory. Each task of
// at::parallel_for owns a range of output rows (N split over torch's intra-op threads, whose count
// is never changed) and walks it R weight rows at a time: R weight vectors are loaded (bf16
// widened to fp32 in registers, or on CPUs with AVX-512-BF16 taken as bf16 pairs by its dot
// product), each multiplied into M x R fp32 accumulators against the M rows of x (held in L1 /
// L2: M * K values); the accumulators are summed horizontally once per output. R is chosen per M
// so that the accumulators, the weight vectors and the x vectors of a step fit in the vector
// registers. The tail of K (less than a step) is summed by scalar code. x is converted once, on
// the calling thread; the output is rounded once to x's dtype, after the bias is added in fp32.
//
// Prefetch one block ahead: each thread reads R rows front to back, R streams of K weights, and a
// row of a 1024-wide fp32 layer is one 4 KiB page, where the hardware prefetchers stop and start
// over. So while a block's rows are read, the next block's rows (the R * K weights after them, in
// the thread's own range) are requested into L2 a line per row per step, spread over the block's
// arithmetic. Nothing is requested a short distance ahead in the same rows: the hardware
// prefetchers already cover that. (benchmarks/bench_linear.py measures the kernel against
// F.linear and a plain read.)
//
// Arithmetic: fp32 products and sums (fused multiply-add), VL partial sums per output summed at
// the end; the order differs from torch's GEMM, the error bound (K * eps * sum |x||w|) is the same.
// NaN and Inf propagate as in any dot product.
//
// Invariants: every shape, dtype and stride is checked on the calling thread; workers only read
// the checked buffers within [0, N) x [0, K) and write their own outputs, and never throw.
//
// Compiled in one translation unit with the other kernels (attnkit/native/build.py): the vector
// types and helpers are simd.h's, shared with splitk.cpp; everything else here lives in namespace
// attnkit_linear, so its helpers do not meet theirs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "simd.h"

namespace attnkit_linear {
namespace {

using attnkit_simd::hsum;
using attnkit_simd::kDotBF16;
using attnkit_simd::kVectorRegs;
using attnkit_simd::VL;
using attnkit_simd::vf;
using attnkit_simd::vi;
using attnkit_simd::vload;

// The most rows of x one call takes; the Python side (attnkit.modules.linear.MAX_ROWS) routes
// more to torch's GEMM, which is compute-bound by then and does it well.
constexpr int64_t kMaxRows = 8;

// 2 * VL bf16 weights as VL 32-bit words.
typedef int32_t vi_u __attribute__((vector_size(VL * sizeof(int32_t)), aligned(sizeof(uint16_t))));
inline vi load_words(const c10::BFloat16* p) { return *reinterpret_cast<const vi_u*>(p); }

// Weight rows per pass for M rows of x, when each step holds ``wv`` vectors of a weight row (1; 2
// for widened bf16, its even and odd elements) and of an x row: M x R accumulators + wv x R weight
// vectors + wv x vectors must fit in the registers (a spilled accumulator costs more than the
// narrower block saves).
constexpr int rows_per_pass(int M, int wv) {
  return M * 4 + wv * 4 + wv <= kVectorRegs ? 4 : M * 2 + wv * 2 + wv <= kVectorRegs ? 2 : 1;
}

// Vectors per weight row in one step of the kernel for x of type X and weights of type W.
template <typename X, typename W>
constexpr int weight_vectors() {
  return std::is_same_v<X, float> && std::is_same_v<W, c10::BFloat16> ? 2 : 1;
}

// Outputs [n0, n0 + R) of the M rows: out[m * N + n] = sum_k x[m * K + k] * w[n * K + k] + bias[n].
// x is fp32 (bf16 weights widened to fp32 in registers) or, on CPUs with AVX-512-BF16, bf16 against
// bf16 weights.
// ``ahead``: elements from a weight to the one the next block reads at its place (0: no prefetch).
template <int M, int R, typename X, typename W, typename O>
inline void block(const X* x, const W* w, const float* bias, O* out, int64_t n0, int64_t N, int64_t K,
                  int64_t ahead) {
  const W* wr[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) wr[r] = w + (n0 + r) * K;
  float sums[M][R];
  int64_t Kv;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<X, c10::BFloat16>) {
    // VDPBF16PS: pairs of bf16 products (exact in fp32) added to fp32 lanes; 32 weights per
    // instruction, read as they are stored (no widening). Inputs below bf16's normal range count
    // as zero (DAZ), which moves a sum by less than 1e-38 per term.
    __m512 acc[M][R];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    Kv = K / 32 * 32;
    for (int64_t k = 0; k < Kv; k += 32) {
      __m512bh wv[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        wv[r] = (__m512bh)_mm512_loadu_si512(wr[r] + k);
        if (ahead) __builtin_prefetch(wr[r] + k + ahead, 0, 1);
      }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) sums[m][r] = _mm512_reduce_add_ps(acc[m][r]);
  } else
#endif
  {
    static_assert(std::is_same_v<X, float>, "x is widened to fp32 unless the CPU has AVX-512-BF16");
    vf acc[M][R];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[m][r] = vf{};
    if constexpr (std::is_same_v<W, float>) {
      Kv = K / VL * VL;
      for (int64_t k = 0; k < Kv; k += VL) {
        vf wv[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          wv[r] = vload(wr[r] + k);
          if (ahead) __builtin_prefetch(wr[r] + k + ahead, 0, 1);
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const vf xv = vload(x + m * K + k);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) acc[m][r] += xv * wv[r];
        }
      }
    } else {
      // bf16 weights, 2 * VL at a time as VL 32-bit words (odd element in the high half): the
      // even elements as fp32 are word << 16, the odd ones word & 0xffff0000, two plain integer
      // ops instead of a widening shuffle per VL weights. x was laid out to match (split_even_odd).
      Kv = K / (2 * VL) * (2 * VL);
      const vi high = vi{} + static_cast<int32_t>(0xffff0000u);
      for (int64_t k = 0; k < Kv; k += 2 * VL) {
        vf we[R], wo[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const vi words = load_words(wr[r] + k);
          if (ahead) __builtin_prefetch(wr[r] + k + ahead, 0, 1);
          we[r] = (vf)(words << 16);
          wo[r] = (vf)(words & high);
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const vf xe = vload(x + m * K + k), xo = vload(x + m * K + k + VL);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) acc[m][r] += xe * we[r] + xo * wo[r];
        }
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) sums[m][r] = hsum(acc[m][r]);
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      float s = sums[m][r];
      for (int64_t k = Kv; k < K; ++k) s += static_cast<float>(x[m * K + k]) * static_cast<float>(wr[r][k]);
      if (bias) s += bias[n0 + r];
      out[m * N + n0 + r] = static_cast<O>(s);
    }
}

// Rows [n0, n1) of the output, R at a time, the last n1 - n0 (mod R) one at a time.
template <int M, typename X, typename W, typename O>
void rows(const X* x, const W* w, const float* bias, O* out, int64_t n0, int64_t n1, int64_t N, int64_t K) {
  constexpr int R = rows_per_pass(M, weight_vectors<X, W>());
  int64_t n = n0;
  for (; n + R <= n1; n += R) block<M, R>(x, w, bias, out, n, N, K, n + 2 * R <= n1 ? R * K : 0);
  for (; n < n1; ++n) block<M, 1>(x, w, bias, out, n, N, K, 0);
}

template <int M, typename X, typename W, typename O>
void run(const X* x, const W* w, const float* bias, O* out, int64_t N, int64_t K) {
  constexpr int R = rows_per_pass(M, weight_vectors<X, W>());
  const int64_t blocks = (N + R - 1) / R;
  // A task of less than ~64 KiB of weights costs more to hand out than to stream (small layers
  // run on fewer threads, or inline).
  const int64_t block_bytes = std::max<int64_t>(1, R * K * static_cast<int64_t>(sizeof(W)));
  const int64_t grain = std::max<int64_t>(1, (int64_t{64} << 10) / block_bytes);
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    rows<M>(x, w, bias, out, b0 * R, std::min(b1 * R, N), N, K);
  });
}

template <typename X, typename W, typename O>
void dispatch(int64_t M, const X* x, const W* w, const float* bias, O* out, int64_t N, int64_t K) {
  switch (M) {
    case 1: run<1>(x, w, bias, out, N, K); break;
    case 2: run<2>(x, w, bias, out, N, K); break;
    case 3: run<3>(x, w, bias, out, N, K); break;
    case 4: run<4>(x, w, bias, out, N, K); break;
    case 5: run<5>(x, w, bias, out, N, K); break;
    case 6: run<6>(x, w, bias, out, N, K); break;
    case 7: run<7>(x, w, bias, out, N, K); break;
    default: run<8>(x, w, bias, out, N, K); break;  // M == 8: checked by the caller
  }
}

// bf16 x (rows x cols, any strides) as fp32 rows in the order the widening path reads them: each
// whole chunk of 2 * VL elements as its VL even elements, then its VL odd ones; the tail as it is.
at::Tensor split_even_odd(const at::Tensor& src, int64_t rows, int64_t cols) {
  at::Tensor dst = at::empty({rows, cols}, src.options().dtype(at::kFloat));
  const c10::BFloat16* s = src.data_ptr<c10::BFloat16>();
  float* d = dst.data_ptr<float>();
  const int64_t s0 = src.stride(0), s1 = src.stride(1), whole = cols / (2 * VL) * (2 * VL);
  for (int64_t i = 0; i < rows; ++i) {
    const c10::BFloat16* si = s + i * s0;
    float* di = d + i * cols;
    for (int64_t c = 0; c < whole; c += 2 * VL)
      for (int64_t j = 0; j < VL; ++j) {
        di[c + j] = static_cast<float>(si[(c + 2 * j) * s1]);
        di[c + VL + j] = static_cast<float>(si[(c + 2 * j + 1) * s1]);
      }
    for (int64_t j = whole; j < cols; ++j) di[j] = static_cast<float>(si[j * s1]);
  }
  return dst;
}

// ``src`` (rows x cols of T, any strides) as a contiguous buffer of D.
template <typename D, typename T>
at::Tensor copy_as(const at::Tensor& src, int64_t rows, int64_t cols) {
  at::Tensor dst = at::empty({rows, cols}, src.options().dtype(c10::CppTypeToScalarType<D>::value));
  const T* s = src.data_ptr<T>();
  D* d = dst.data_ptr<D>();
  const int64_t s0 = src.stride(0), s1 = src.stride(1);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) d[i * cols + j] = static_cast<D>(s[i * s0 + j * s1]);
  return dst;
}

const char* dtype_name(at::ScalarType t) { return c10::toString(t); }

// x (M, K) with M <= kMaxRows, any strides; weight (N, K) contiguous, x's dtype (fp32 or bf16);
// bias (N,) contiguous, x's dtype, or None. Returns (M, N) in x's dtype.
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() == 2, "linear_rows: x must be 2-D (M, K), got shape ", x.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 2, "linear_rows: weight must be 2-D (N, K), got shape ", weight.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK_VALUE(weight.size(1) == K, "linear_rows: x (", M, ", ", K, ") and weight ", weight.sizes(),
                    " disagree on K (x.size(1) must equal weight.size(1))");
  TORCH_CHECK_VALUE(M <= kMaxRows, "linear_rows: x has ", M, " rows (shape ", x.sizes(), "), at most ", kMaxRows,
                    " are supported; use torch.nn.functional.linear for more");
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu(), "linear_rows: x (", x.device(),
                    ") and weight (", weight.device(), ") must be CPU tensors");
  const at::ScalarType dt = x.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16, "linear_rows: x must be float32 or bfloat16, got ",
                   dtype_name(dt));
  TORCH_CHECK_TYPE(weight.scalar_type() == dt, "linear_rows: weight (", dtype_name(weight.scalar_type()),
                   ") must have x's dtype (", dtype_name(dt), ")");
  TORCH_CHECK_VALUE(weight.is_contiguous(), "linear_rows: weight ", weight.sizes(), " must be contiguous, got strides ",
                    weight.strides());
  const float* bias_f32 = nullptr;
  at::Tensor bias_buf;
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK_VALUE(b.dim() == 1 && b.size(0) == N, "linear_rows: bias must be (N,) = (", N, ",), got shape ",
                      b.sizes());
    TORCH_CHECK_VALUE(b.device().is_cpu(), "linear_rows: bias must be a CPU tensor, got ", b.device());
    TORCH_CHECK_TYPE(b.scalar_type() == dt, "linear_rows: bias (", dtype_name(b.scalar_type()),
                     ") must have x's dtype (", dtype_name(dt), ")");
    bias_buf = dt == at::kFloat ? copy_as<float, float>(b.unsqueeze(0), 1, N)
                                : copy_as<float, c10::BFloat16>(b.unsqueeze(0), 1, N);
    bias_f32 = bias_buf.data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (dt == at::kFloat) {
    // x as contiguous fp32 rows: M * K floats, read once per weight block from L1 / L2.
    const at::Tensor xc = x.is_contiguous() ? x : copy_as<float, float>(x, M, K);
    dispatch(M, xc.data_ptr<float>(), weight.data_ptr<float>(), bias_f32, out.data_ptr<float>(), N, K);
  } else if constexpr (kDotBF16) {
    const at::Tensor xc = x.is_contiguous() ? x : copy_as<c10::BFloat16, c10::BFloat16>(x, M, K);
    dispatch(M, xc.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), bias_f32,
             out.data_ptr<c10::BFloat16>(), N, K);
  } else {  // x widened once to fp32 (M * K floats)
    const at::Tensor xc = split_even_odd(x, M, K);
    dispatch(M, xc.data_ptr<float>(), weight.data_ptr<c10::BFloat16>(), bias_f32, out.data_ptr<c10::BFloat16>(), N,
             K);
  }
  return out;
}

// The output's shape and dtype only (the Meta kernel): what torch.compile's fake tensors see when
// a traced graph calls the op. Sizes may be symbolic (dynamic shapes); the CPU kernel checks the rest.
at::Tensor linear_rows_meta(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2, "linear_rows: x (M, K) and weight (N, K) must be 2-D, got ",
                    x.dim(), "-D and ", weight.dim(), "-D");
  return at::empty_symint({x.sym_size(0), weight.sym_size(0)}, x.options());
}

}  // namespace
}  // namespace attnkit_linear

TORCH_LIBRARY_FRAGMENT(attnkit_cpu, m) {
  m.def("linear_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("linear_rows", c10::DispatchKey::CPU, TORCH_FN(attnkit_linear::linear_rows));
  m.impl("linear_rows", c10::DispatchKey::Meta, TORCH_FN(attnkit_linear::linear_rows_meta));
}
