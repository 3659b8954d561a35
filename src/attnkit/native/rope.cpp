// Rotary embeddings in one pass: attnkit's RoPE (`attnkit.rope`), for inference on CPU.
//
// out = x * cos + partner(x) * sin_signed on the first R channels of each row, the last D - R
// channels copied, computed in fp32 and rounded once to x's dtype. partner swaps the two halves
// (rotate-half) or the two members of each pair (interleaved); the rotation's sign lives in
// sin_signed. The torch path (`_rotate_signed`) runs the same arithmetic as five ops over fp32
// copies of x (widen, partner, two products, sum, narrow); here each row is read once and
// written once. The two products and the sum are rounded separately, as torch's ops round them
// (no fused multiply-add), so the result is bit-equal to the torch path.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

// One row: x * c + p * s with each product and the sum rounded to fp32 on its own. Its own
// function, so the attribute holds (the parallel loop's lambda is another function, and GCC
// does not inline across differing optimize attributes).
template <typename T>
__attribute__((noinline, optimize("fp-contract=off"))) void rotate_row(const T* xr, const float* c, const float* s,
                                                                       T* o, int64_t R, int64_t D, bool interleaved) {
#pragma STDC FP_CONTRACT OFF
  const int64_t h = R / 2;
  if (interleaved) {
    for (int64_t d = 0; d < R; d += 2) {
      const float x0 = static_cast<float>(xr[d]), x1 = static_cast<float>(xr[d + 1]);
      const float a0 = x0 * c[d], b0 = x1 * s[d], a1 = x1 * c[d + 1], b1 = x0 * s[d + 1];
      o[d] = static_cast<T>(a0 + b0);
      o[d + 1] = static_cast<T>(a1 + b1);
    }
  } else {
    for (int64_t d = 0; d < h; ++d) {
      const float lo = static_cast<float>(xr[d]), hi = static_cast<float>(xr[d + h]);
      const float a0 = lo * c[d], b0 = hi * s[d], a1 = hi * c[d + h], b1 = lo * s[d + h];
      o[d] = static_cast<T>(a0 + b0);
      o[d + h] = static_cast<T>(a1 + b1);
    }
  }
  for (int64_t d = R; d < D; ++d) o[d] = xr[d];
}

template <typename T>
void rotate_rows(const T* x, const float* cos, const float* sin, T* out, int64_t rows, const int64_t* xoff,
                 const int64_t* coff, int64_t R, int64_t D, bool interleaved) {
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      rotate_row(x + xoff[r], cos + coff[r], sin + coff[r], out + r * D, R, D, interleaved);
  });
}

// x (4-D, unit stride in its last dim D) fp32 / bf16 / fp16; cos, sin_signed fp32 broadcastable to
// x[..., :R] (R even, <= D), unit stride in their last dim. Returns a contiguous tensor like x.
at::Tensor rope_rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  const at::ScalarType xt = x.scalar_type();
  TORCH_CHECK(x.dim() == 4 && x.device().is_cpu() && x.stride(3) == 1 &&
                  (xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf),
              "x must be a 4-D fp32 / bf16 / fp16 CPU tensor with unit stride in its last dim");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() &&
                  cos.dim() == 4,
              "cos and sin_signed must be 4-D fp32 tensors of one shape");
  const int64_t D = x.size(3), R = cos.size(3);
  TORCH_CHECK(R % 2 == 0 && R <= D, "the rotary width must be even and at most the head dim");
  const at::Tensor c = cos.expand({x.size(0), x.size(1), x.size(2), R});
  const at::Tensor s = sin.expand({x.size(0), x.size(1), x.size(2), R});
  TORCH_CHECK(c.stride(3) == 1 && s.stride(3) == 1 && c.strides() == s.strides(),
              "cos and sin_signed must share strides, with unit stride in their last dim");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n1 = x.size(1), n2 = x.size(2), rows = x.size(0) * n1 * n2;
  // Row offsets (x's and the angles' strides may be anything, broadcast ones 0).
  std::vector<int64_t> xoff(rows), coff(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i0 = r / (n1 * n2), i1 = (r / n2) % n1, i2 = r % n2;
    xoff[r] = i0 * x.stride(0) + i1 * x.stride(1) + i2 * x.stride(2);
    coff[r] = i0 * c.stride(0) + i1 * c.stride(1) + i2 * c.stride(2);
  }
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  switch (xt) {
    case at::kBFloat16:
      rotate_rows(x.data_ptr<c10::BFloat16>(), cp, sp, out.data_ptr<c10::BFloat16>(), rows, xoff.data(), coff.data(),
                  R, D, interleaved);
      break;
    case at::kHalf:
      rotate_rows(x.data_ptr<c10::Half>(), cp, sp, out.data_ptr<c10::Half>(), rows, xoff.data(), coff.data(), R, D,
                  interleaved);
      break;
    default:
      rotate_rows(x.data_ptr<float>(), cp, sp, out.data_ptr<float>(), rows, xoff.data(), coff.data(), R, D,
                  interleaved);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit_cpu, m) {
  m.def("rope_rotate(Tensor x, Tensor cos, Tensor sin_signed, bool interleaved) -> Tensor");
  m.impl("rope_rotate", c10::DispatchKey::CPU, TORCH_FN(rope_rotate));
}
