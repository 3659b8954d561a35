// The fp32 vector types and helpers the native kernels share (splitk.cpp, linear.cpp), through the
// compilers' vector extensions (GCC, Clang). The width follows the instruction set the library is
// compiled for (-march=native): 16 lanes with AVX-512, else 8.
//
// The sources are compiled as one translation unit (attnkit/native/build.py), so this header is
// read once there (include guard) and its names live in namespace attnkit_simd; each source
// takes the ones it uses with using-declarations.

#ifndef ATTNKIT_NATIVE_SIMD_H_
#define ATTNKIT_NATIVE_SIMD_H_

#include <cstdint>

#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

namespace attnkit_simd {
namespace {  // internal linkage, as each kernel's own helpers have

#if defined(__AVX512F__)
constexpr int64_t VL = 16;       // fp32 lanes per vector
constexpr int kVectorRegs = 32;  // zmm0-31
#else
constexpr int64_t VL = 8;
constexpr int kVectorRegs = 16;  // ymm0-15
#endif

// bf16 against bf16 by AVX-512-BF16's dot product (VDPBF16PS) where the CPU has it, else widened
// to fp32 first.
#if defined(__AVX512BF16__)
constexpr bool kDotBF16 = true;
#else
constexpr bool kDotBF16 = false;
#endif

typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef float vf_u __attribute__((vector_size(VL * sizeof(float)), aligned(sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(VL * sizeof(uint32_t))));

// VL floats from any float-aligned address, and back.
inline vf vload(const float* p) { return *reinterpret_cast<const vf_u*>(p); }
inline void vstore(float* p, vf v) { *reinterpret_cast<vf_u*>(p) = v; }

// x in every lane.
inline vf vsplat(float x) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(x);
#elif defined(__AVX__)
  return (vf)_mm256_set1_ps(x);
#else
  return vf{} + x;
#endif
}

// The sum of a vector's lanes, pairwise (a few shuffles and adds, not VL dependent adds: a
// score of one query row against one key, or a short row's dot product, pays it once per sum).
inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX__)
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
#else
  float s = 0.0f;
  for (int64_t i = 0; i < VL; ++i) s += v[i];
  return s;
#endif
}

}  // namespace
}  // namespace attnkit_simd

#endif  // ATTNKIT_NATIVE_SIMD_H_
