// A KV cache's quantize-on-write in one pass: attnkit.kvquant.quantize, for CPU tensors.
//
// A decode step writes a few rows per layer (B x Hkv x 1 tokens of K and of V), and the torch path
// spends its time in the dispatch of its ten ops (widen, abs, amax, divide, reciprocal, multiply,
// clamp, nan_to_num, round, cast), not in the arithmetic. This does the same arithmetic per row,
// in the same order, so the results are the same bits (a NaN scale's payload aside):
//   scale = amax|x| / qmax                 (NaN in the row: NaN; inf: inf)
//   inv   = scale > 0 ? 1 / scale : 0      (zero, NaN and inf scales: 0)
//   y     = clamp(x * inv, -qmax, qmax)    (NaN stays NaN: inf * 0)
//   data  = NaN ? 0 : y, rounded half to even (int8) or to e4m3 (c10's conversion, torch's own)
// with qmax 127 (int8) or 448 (fp8 e4m3).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>

namespace {

constexpr int64_t kLanes = 16;  // independent running maxima: no single dependency chain through the row

// One row, x and data D elements, *scale_out its scale: the absmax (NaN when the row holds NaN,
// as torch's amax), then each element scaled, clamped and rounded. Two reads of the row and no
// temporaries, where the torch ops write five tensors of its size (measured in
// benchmarks/results/quantized.md).
template <typename T, typename Q>
void quantize_row(const T* x, int64_t D, float qmax, Q* data, float* scale_out) {
  float acc[kLanes] = {};
  bool nan[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) {
      const float a = std::fabs(static_cast<float>(x[i + j]));
      acc[j] = a > acc[j] ? a : acc[j];
      nan[j] |= a != a;
    }
  for (int64_t j = 0; i < D; ++i, ++j) {
    const float a = std::fabs(static_cast<float>(x[i]));
    acc[j] = a > acc[j] ? a : acc[j];
    nan[j] |= a != a;
  }
  float m = 0.0f;
  bool any_nan = false;
  for (int64_t j = 0; j < kLanes; ++j) {
    m = acc[j] > m ? acc[j] : m;
    any_nan |= nan[j];
  }
  if (any_nan) m = std::numeric_limits<float>::quiet_NaN();
  const float scale = m / qmax;
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  for (int64_t k = 0; k < D; ++k) {
    float y = static_cast<float>(x[k]) * inv;
    y = y != y ? 0.0f : std::min(std::max(y, -qmax), qmax);
    if constexpr (std::is_same<Q, int8_t>::value)
      data[k] = static_cast<int8_t>(std::nearbyint(y));  // half to even in the default FP mode, as torch.round
    else
      data[k] = static_cast<Q>(y);
  }
  *scale_out = scale;
}

template <typename T, typename Q>
void quantize_rows(const T* x, int64_t rows, int64_t D, float qmax, Q* data, float* scale) {
  // A decode step's handful of rows runs inline; more in parallel. Workers share nothing.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(x + r * D, D, qmax, data + r * D, scale + r);
  });
}

template <typename Q>
void dispatch_input(const at::Tensor& x, int64_t rows, int64_t D, float qmax, Q* data, float* scale) {
  switch (x.scalar_type()) {
    case at::kBFloat16:
      quantize_rows(x.data_ptr<c10::BFloat16>(), rows, D, qmax, data, scale);
      break;
    case at::kHalf:
      quantize_rows(x.data_ptr<c10::Half>(), rows, D, qmax, data, scale);
      break;
    default:
      quantize_rows(x.data_ptr<float>(), rows, D, qmax, data, scale);
  }
}

// x (..., D) contiguous fp32 / bf16 / fp16 CPU, D >= 1; kind 0: int8, 1: fp8 e4m3. Returns
// (data (..., D) int8 / float8_e4m3fn, scale (...) fp32).
std::tuple<at::Tensor, at::Tensor> quantize_kv_rows(const at::Tensor& x, int64_t kind) {
  const at::ScalarType xt = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.is_contiguous() &&
                  (xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf),
              "x must be a contiguous fp32 / bf16 / fp16 CPU tensor");
  TORCH_CHECK(x.size(-1) >= 1, "x must have a last dim of at least 1, got ", x.sizes());
  TORCH_CHECK(kind == 0 || kind == 1, "kind must be 0 (int8) or 1 (fp8 e4m3), got ", kind);
  const int64_t D = x.size(-1), rows = x.numel() / D;
  at::Tensor data = at::empty(x.sizes(), x.options().dtype(kind == 0 ? at::kChar : at::kFloat8_e4m3fn));
  at::Tensor scale = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  if (kind == 0)
    dispatch_input(x, rows, D, 127.0f, data.data_ptr<int8_t>(), scale.data_ptr<float>());
  else
    dispatch_input(x, rows, D, 448.0f, data.data_ptr<c10::Float8_e4m3fn>(), scale.data_ptr<float>());
  return {data, scale};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit_cpu, m) {
  m.def("quantize_kv_rows(Tensor x, int kind) -> (Tensor, Tensor)");
  m.impl("quantize_kv_rows", c10::DispatchKey::CPU, TORCH_FN(quantize_kv_rows));
}
