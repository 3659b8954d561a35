// RMSNorm in one pass: attnkit's `RMSNorm` (`attnkit.modules.norm`), for inference on CPU.
//
// Each row of x (N wide) is read twice from cache (sum of squares, then scale) and written once,
// instead of the seven ops of the torch path (widen, square, sum, divide, add eps, rsqrt, scale).
// The arithmetic is the torch path's: inv = 1 / sqrt(sum(x^2) / N + eps) in fp32 and y = x * inv,
// then the weight as each family applies it (mode):
//   0  Llama:   w * y.to(x.dtype)            (the product rounded to x's dtype)
//   1  OLMo 2:  (w * y).to(x.dtype)          (scale in fp32)
//   2  Gemma:   (y * (1 + w)).to(x.dtype)    (unit offset, in fp32)
// For fp32 the three are the same floats. Only the sum's order differs from torch's (whose own
// order depends on the vector width of the CPU): 32 fp32 lanes, folded pairwise.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

template <typename T>
float inverse_rms(const T* x, int64_t N, float eps) {
  constexpr int L = 32;
  float acc[L] = {};
  int64_t i = 0;
  for (; i + L <= N; i += L)
    for (int j = 0; j < L; ++j) {
      const float v = static_cast<float>(x[i + j]);
      acc[j] += v * v;
    }
  for (int j = 0; i < N; ++i, ++j) {
    const float v = static_cast<float>(x[i]);
    acc[j] += v * v;
  }
  for (int w = L / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return 1.0f / std::sqrt(acc[0] / static_cast<float>(N) + eps);
}

// One row's output; products rounded on their own, as torch's ops round them.
template <typename T>
__attribute__((noinline, optimize("fp-contract=off"))) void scale_row(const T* x, const T* w, T* o, int64_t N,
                                                                      float inv, int64_t mode) {
#pragma STDC FP_CONTRACT OFF
  if (mode == 0) {
    for (int64_t i = 0; i < N; ++i) {
      const T y = static_cast<T>(static_cast<float>(x[i]) * inv);
      o[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(y));
    }
  } else if (mode == 1) {
    for (int64_t i = 0; i < N; ++i) o[i] = static_cast<T>(static_cast<float>(w[i]) * (static_cast<float>(x[i]) * inv));
  } else {
    for (int64_t i = 0; i < N; ++i)
      o[i] = static_cast<T>((static_cast<float>(x[i]) * inv) * (1.0f + static_cast<float>(w[i])));
  }
}

template <typename T>
void norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t N, float eps, int64_t mode) {
  // A row is a few KiB: batch rows so each task has some work (decode's single row runs inline).
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) scale_row(x + r * N, w, out + r * N, N, inverse_rms(x + r * N, N, eps), mode);
  });
}

// x (..., N) contiguous fp32 / bf16 / fp16; weight (N,) contiguous, x's dtype. Returns a tensor like x.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t mode) {
  const at::ScalarType xt = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.is_contiguous() &&
                  (xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf),
              "x must be a contiguous fp32 / bf16 / fp16 CPU tensor");
  const int64_t N = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == xt && weight.dim() == 1 && weight.size(0) == N && weight.is_contiguous() &&
                  weight.device().is_cpu(),
              "weight must be a contiguous (N,) CPU tensor of x's dtype");
  TORCH_CHECK(mode >= 0 && mode <= 2, "mode must be 0 (Llama), 1 (OLMo 2) or 2 (Gemma)");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t rows = N == 0 ? 0 : x.numel() / N;
  const float e = static_cast<float>(eps);
  switch (xt) {
    case at::kBFloat16:
      norm_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, N,
                e, mode);
      break;
    case at::kHalf:
      norm_rows(x.data_ptr<c10::Half>(), weight.data_ptr<c10::Half>(), out.data_ptr<c10::Half>(), rows, N, e, mode);
      break;
    default:
      norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, N, e, mode);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, int mode) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
}
