// attnkit's CPU split-K attention kernel: the one engine behind the `decode` and `paged` backends.
//
// Notation: B batch, Hq / Hkv query / KV heads, G = Hq / Hkv, Sq queries per sequence, D / Dv
// key / value head dims, M = G * Sq query rows per KV head, Sk logical keys per sequence.
//
// Work is split into units (b, kv head, key slice); each unit streams its keys once for all M
// query rows of the KV head (K/V are never read per query head), widening fp16/bf16 rows to fp32
// in registers (or in a small tile buffer for widths that are not whole vectors), with an online
// softmax over tiles sized from the core's L2. Built with -march=native, the same source takes
// 16-lane vectors on AVX-512 and, where the CPU has AVX-512-BF16, scores bf16 queries against bf16
// keys with its dot product instead of widening the keys. Partial
// results (row max m, sum of exp l, unnormalised P @ V) of the slices of one (b, kv head) merge
// exactly by the log-sum-exp rule; sinks join the denominator once, in that merge.
//
// Quantized K/V (int8, fp8 e4m3; attnkit.kvquant) carry one fp32 scale per row: the rows are
// widened to fp32 in registers like bf16 ones, a key's score is multiplied by its K scale, and
// its probability by its V scale before P @ V (attention over data * scale, never built).
//
// Keys are read through a row locator: contiguous caches (B, Hkv, Sk, D) by their strides, paged
// pools (N, bs, Hkv, D) through a block table, so scattered blocks cost no copy.
//
// Query row (b, i) sees keys j with lo[b, i] <= j < hi[b, i] (causal, windows, padding: the mask
// as a range), or, with a per-query selection, the keys of a list (below), plus an optional additive fp32 bias (any other mask), ALiBi (slope[h] * (j -
// qpos[b, i])) and soft-capping (c * tanh(s / c), on the scaled score, before bias and ALiBi).
//
// Selections (attnkit.masks.SelectedKeys / SelectedBlocks): the caller passes each query's ids
// as given (any order, repeats, negative = unused), a block size, the interval R that cuts them
// and optionally an interval W joined to them. build_lists() turns each into the ascending
// distinct key positions its rows see (a bitmap over R, so sorting costs nothing), and the walk
// runs over list entries instead of key positions: a tile is the next n entries, consecutive
// positions in one block read as one run, so the cost is the selection's length, not the
// context's. Each q sequence of the call reads the K/V sequence b / seq_div, so a prefill's
// queries, each with its own list, go as B * Sq sequences of one query (seq_div = Sq).
//
// Invariants: a row with no visible key gets exactly 0 (and lse -inf); NaN in a visible score
// propagates to the row's output (only the mask decides emptiness); threads come from torch's
// own intra-op pool (at::parallel_for) with the caller's thread count, which is never changed.
//
// Bounds: everything the workers will read (each sequence's key range against Sk or its block
// table, every table entry in that range, the bias's extent) is checked on the calling thread
// before the parallel region (check_reads), so no read depends on the thread count, the tile
// size or the ISA. Workers never throw (exceptions thrown in several OpenMP workers at once can
// bring the process down): what they cannot do (an allocation that fails) is flagged and raised
// on the calling thread after the region.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#include <unistd.h>

#include "simd.h"

namespace {

using attnkit_simd::hsum;
using attnkit_simd::kDotBF16;
using attnkit_simd::VL;
using attnkit_simd::vf;
using attnkit_simd::vi;
using attnkit_simd::vload;
using attnkit_simd::vsplat;
using attnkit_simd::vstore;
using attnkit_simd::vu;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// max that propagates NaN (std::max drops it): a NaN score poisons its row, as it should.
inline float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

template <typename T>
inline void to_f32(const T* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

template <>
inline void to_f32<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* o = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) o[d] = static_cast<uint32_t>(s[d]) << 16;
}

#if defined(__F16C__)
template <>
inline void to_f32<c10::Half>(const c10::Half* src, float* dst, int64_t n) {
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))));
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}
#endif

struct Args {
  int64_t B, Hq, Hkv, G, Sq, D, Dv;
  const void* q;  // (B, Hq, Sq, D) contiguous, of q_type; multiplied by scale as it is copied
  at::ScalarType q_type;
  float scale;
  int64_t Sk;  // dense key length: the rows' interval when lo / hi are absent
  const void* k;   // dense: strides (b, h, j); paged: strides (block, slot, h)
  int64_t ks0, ks1, ks2;
  const void* v;   // nullptr: V is the first Dv channels of K
  int64_t vs0, vs1, vs2;
  // Quantized K/V: fp32 row scales indexed like the rows without their last dim (nullptr: float
  // K/V). ``vsc`` is nullptr when V is read from K (then K's scales serve V).
  const float* ksc;
  int64_t kss0, kss1, kss2;
  const float* vsc;
  int64_t vss0, vss1, vss2;
  bool paged;
  const int64_t* block_table;  // (B, W) block ids (paged)
  int64_t block_table_s0, block_size, num_blocks, block_table_w;
  const int64_t* lo;  // (B, Sq), or nullptr: rows start at key 0
  const int64_t* hi;  // (B, Sq), or nullptr: rows end at Sk (dense)
  const float* bias;  // optional, strides (b, h, i, j)
  int64_t bs0, bs1, bs2, bs3;
  const float* slopes;  // optional (Hq,)
  const int64_t* qpos;  // (B, Sq) with slopes, or nullptr: bottom-right, query i at i + Sk - Sq (dense)
  float softcap;        // 0: off
  // A selection (nullptr: none): keys (B, Hs, n) int32 ascending key positions with strides
  // (key_s0, key_s1, 1); the rows of KV head h read list h / (Hkv / Hs), entries [klo, khi)
  // ((B, Hs) int64 each). lo, hi and bias are absent then.
  const int32_t* keys;
  int64_t key_s0, key_s1, Hs;
  const int64_t* klo;
  const int64_t* khi;
  int64_t seq_div;  // q sequence b reads the K/V (or block-table row) of sequence b / seq_div
  int64_t tile;         // keys per tile (a multiple of VL), decided once per call (tile_keys)
  // Set by a worker that met what check_reads rules out (a bad block id) or could not get its
  // scratch memory; the call raises after the parallel region.
  std::atomic<int>* failed;
};

// Why a worker gave up (the values of Args::failed).
constexpr int kBadBlock = 1, kNoMemory = 2;

inline int64_t row_lo(const Args& a, int64_t b, int64_t i) { return a.lo ? a.lo[b * a.Sq + i] : 0; }
inline int64_t row_hi(const Args& a, int64_t b, int64_t i) { return a.hi ? a.hi[b * a.Sq + i] : a.Sk; }

// With a selection: the list KV head h of q sequence b reads (its index in klo / khi), and the list.
inline int64_t list_index(const Args& a, int64_t b, int64_t h) { return b * a.Hs + h / (a.Hkv / a.Hs); }
inline const int32_t* list_of(const Args& a, int64_t b, int64_t h) {
  return a.keys == nullptr ? nullptr : a.keys + b * a.key_s0 + (h / (a.Hkv / a.Hs)) * a.key_s1;
}

// q row ``src`` (D elements of the call's dtype) times the scale, into fp32 ``dst``.
inline void load_q(const Args& a, int64_t row, float* dst) {
  const int64_t off = row * a.D;
  switch (a.q_type) {
    case at::kBFloat16: to_f32(static_cast<const c10::BFloat16*>(a.q) + off, dst, a.D); break;
    case at::kHalf: to_f32(static_cast<const c10::Half*>(a.q) + off, dst, a.D); break;
    default: std::copy(static_cast<const float*>(a.q) + off, static_cast<const float*>(a.q) + off + a.D, dst);
  }
  for (int64_t d = 0; d < a.D; ++d) dst[d] *= a.scale;
}

// Heads h .. h + nh - 1 of sequence b over keys [s0, s1); its partial results go to slots
// slot .. slot + nh - 1 (one per head).
struct Unit {
  int64_t b, h, nh, s0, s1, slot;
};

// Where a unit's rows of one tensor (K, V or their scales) lie: the row of key ``off`` of a run
// in block ``id`` (paged; dense: id 0, off the key) for the unit's first head is start(id, off);
// consecutive keys of a run are ``key`` elements apart, consecutive heads ``head``.
template <typename T>
struct Rows {
  const T* base;
  int64_t block, key, head;

  // Strides (s0, s1, s2): dense (b, h, j) of sequence b; paged (block, slot, h).
  Rows(const Args& a, const void* p, int64_t s0, int64_t s1, int64_t s2, int64_t b, int64_t h)
      : base(static_cast<const T*>(p) + (a.paged ? h * s2 : b * s0 + h * s1)),
        block(a.paged ? s0 : 0),
        key(a.paged ? s1 : s2),
        head(a.paged ? s2 : s1) {}

  const T* start(int64_t id, int64_t off) const { return base + id * block + off * key; }
};

// Calls f(j0, run, id, off) for the runs of keys t0 .. t0 + n - 1 of sequence b that lie in one
// block: keys t0 + j0 .. t0 + j0 + run - 1 are rows off .. off + run - 1 of block id (dense: one
// run, block 0, off = t0). One block-table read per block, no division per key.
//
// With a selection ``list`` (the unit's list of key positions), t0 .. t0 + n - 1 are list entries:
// a run is entries whose positions follow one another (inside one block, paged).
template <typename F>
__attribute__((always_inline)) inline void for_runs(const Args& a, int64_t b, const int32_t* list, int64_t t0,
                                                    int64_t n, F&& f) {
  if (n <= 0) return;
  if (list != nullptr) {
    for (int64_t j0 = 0; j0 < n;) {
      const int64_t pos = list[t0 + j0];
      int64_t id = 0, off = pos, limit = n - j0;
      if (a.paged) {
        const int64_t slot = pos / a.block_size;
        off = pos - slot * a.block_size;
        limit = std::min(limit, a.block_size - off);
        id = slot < a.block_table_w ? a.block_table[b * a.block_table_s0 + slot] : -1;
        if (__builtin_expect(id < 0 || id >= a.num_blocks, 0)) {  // as below
          a.failed->store(kBadBlock, std::memory_order_relaxed);
          id = 0;
        }
      }
      int64_t run = 1;
      while (run < limit && list[t0 + j0 + run] == pos + run) ++run;
      f(j0, run, id, off);
      j0 += run;
    }
    return;
  }
  if (!a.paged) return f(int64_t{0}, n, int64_t{0}, t0);
  int64_t slot = t0 / a.block_size, off = t0 - slot * a.block_size;
  for (int64_t j0 = 0; j0 < n; ++slot, off = 0) {
    const int64_t run = std::min(n - j0, a.block_size - off);
    int64_t id = slot < a.block_table_w ? a.block_table[b * a.block_table_s0 + slot] : -1;
    if (__builtin_expect(id < 0 || id >= a.num_blocks, 0)) {
      // Ruled out by check_reads (which also saw a valid block, so block 0 exists). A worker
      // must not throw: flag it, read block 0, and the call raises after the parallel region.
      a.failed->store(kBadBlock, std::memory_order_relaxed);
      id = 0;
    }
    f(j0, run, id, off);
    j0 += run;
  }
}

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Scores of 4 query rows x 2 bf16 keys with AVX-512-BF16's dot product (VDPBF16PS: pairs of bf16
// products, exact in fp32, summed into fp32 lanes): the key rows are read as they are, no
// widening, half the instructions of widen-then-FMA. ``q`` holds the 4 rows unscaled in bf16, ``Dp``
// apart (Dp a multiple of 32); the caller multiplies the sums by the scale.
#if defined(__AVX512BF16__)
inline void dot_4x2_bf16(const uint16_t* q, int64_t Dp, const c10::BFloat16* k0, const c10::BFloat16* k1, float* sums) {
  __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
  for (int64_t d = 0; d < Dp; d += 32) {
    const __m512bh x0 = (__m512bh)_mm512_loadu_si512(k0 + d), x1 = (__m512bh)_mm512_loadu_si512(k1 + d);
    const __m512bh y0 = (__m512bh)_mm512_loadu_si512(q + d), y1 = (__m512bh)_mm512_loadu_si512(q + Dp + d);
    const __m512bh y2 = (__m512bh)_mm512_loadu_si512(q + 2 * Dp + d), y3 = (__m512bh)_mm512_loadu_si512(q + 3 * Dp + d);
    c00 = _mm512_dpbf16_ps(c00, y0, x0); c01 = _mm512_dpbf16_ps(c01, y0, x1);
    c10 = _mm512_dpbf16_ps(c10, y1, x0); c11 = _mm512_dpbf16_ps(c11, y1, x1);
    c20 = _mm512_dpbf16_ps(c20, y2, x0); c21 = _mm512_dpbf16_ps(c21, y2, x1);
    c30 = _mm512_dpbf16_ps(c30, y3, x0); c31 = _mm512_dpbf16_ps(c31, y3, x1);
  }
  sums[0] = _mm512_reduce_add_ps(c00); sums[1] = _mm512_reduce_add_ps(c01);
  sums[2] = _mm512_reduce_add_ps(c10); sums[3] = _mm512_reduce_add_ps(c11);
  sums[4] = _mm512_reduce_add_ps(c20); sums[5] = _mm512_reduce_add_ps(c21);
  sums[6] = _mm512_reduce_add_ps(c30); sums[7] = _mm512_reduce_add_ps(c31);
}
#else
inline void dot_4x2_bf16(const uint16_t*, int64_t, const c10::BFloat16*, const c10::BFloat16*, float*) {}
#endif

#if defined(__AVX2__)
// The eight int32 sums of 4 query rows x 2 keys, each spread over the 8 lanes of h[x] in the order
// (row 0, key 0), (row 0, key 1), (row 1, key 0), ...: summed by a tree of horizontal adds,
// converted once and multiplied by the row's scale ``rs`` (4) into ``sr`` (rows TILE apart).
inline void store_sums_4x2(const __m256i h[8], const float* rs, int64_t TILE, float* sr) {
  const __m256i t0 = _mm256_hadd_epi32(h[0], h[1]), t1 = _mm256_hadd_epi32(h[2], h[3]);
  const __m256i t2 = _mm256_hadd_epi32(h[4], h[5]), t3 = _mm256_hadd_epi32(h[6], h[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
  // each row's two sums times its scale, stored as one 64-bit pair
  const __m256 scale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(rs)),
                                                _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), scale);
  const __m128 lo = _mm256_castps256_ps128(f), hi = _mm256_extractf128_ps(f, 1);
  _mm_storel_pi(reinterpret_cast<__m64*>(sr), lo);
  _mm_storeh_pi(reinterpret_cast<__m64*>(sr + TILE), lo);
  _mm_storel_pi(reinterpret_cast<__m64*>(sr + 2 * TILE), hi);
  _mm_storeh_pi(reinterpret_cast<__m64*>(sr + 3 * TILE), hi);
}
#endif

// Scores of 4 query rows x 2 int8 keys with AVX-512-VNNI's integer dot product (VPDPWSSD: pairs
// of int16 x int16 products summed exactly into int32 lanes). ``q`` holds the 4 rows Dp apart as
// int16 (quantize_q_i16: row r is rs[r] * q[r] to 2^-16 of the row's largest element, far below
// a bf16 / fp16 query's own rounding), so the keys need only a sign extension where the fp32 path
// widens, converts and issues twice the multiply-adds. Exact integer sums (|sum| < 2^31 for
// D <= 256), each converted once and multiplied by its row's scale into ``sr`` (rows TILE apart).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kDotI16 = true;
inline void dot_4x2_i16(const int16_t* q, int64_t Dp, const int8_t* k0, const int8_t* k1, const float* rs,
                        int64_t TILE, float* sr) {
  __m512i c00 = _mm512_setzero_si512(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
  for (int64_t d = 0; d < Dp; d += 32) {
    const __m512i x0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k0 + d)));
    const __m512i x1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k1 + d)));
    const __m512i y0 = _mm512_loadu_si512(q + d), y1 = _mm512_loadu_si512(q + Dp + d);
    const __m512i y2 = _mm512_loadu_si512(q + 2 * Dp + d), y3 = _mm512_loadu_si512(q + 3 * Dp + d);
    c00 = _mm512_dpwssd_epi32(c00, y0, x0); c01 = _mm512_dpwssd_epi32(c01, y0, x1);
    c10 = _mm512_dpwssd_epi32(c10, y1, x0); c11 = _mm512_dpwssd_epi32(c11, y1, x1);
    c20 = _mm512_dpwssd_epi32(c20, y2, x0); c21 = _mm512_dpwssd_epi32(c21, y2, x1);
    c30 = _mm512_dpwssd_epi32(c30, y3, x0); c31 = _mm512_dpwssd_epi32(c31, y3, x1);
  }
  // each vector folded to 256 bits, then the AVX2 tree
  const __m512i c[8] = {c00, c01, c10, c11, c20, c21, c30, c31};
  __m256i h[8];
  for (int x = 0; x < 8; ++x) h[x] = _mm256_add_epi32(_mm512_castsi512_si256(c[x]), _mm512_extracti64x4_epi64(c[x], 1));
  store_sums_4x2(h, rs, TILE, sr);
}
#elif defined(__AVX2__)
// AVX2 (no VNNI): VPMADDWD multiplies the int16 pairs and sums each pair exactly into an int32
// lane (|pair| < 2^23 here), then VPADDD accumulates: 2 instructions per 16 products, where the
// fp32 path widens each key element to fp32 (2 instructions per 8) and issues one FMA per 8.
constexpr bool kDotI16 = true;
inline void dot_4x2_i16(const int16_t* q, int64_t Dp, const int8_t* k0, const int8_t* k1, const float* rs,
                        int64_t TILE, float* sr) {
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
  for (int64_t d = 0; d < Dp; d += 16) {
    const __m256i x0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k0 + d)));
    const __m256i x1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k1 + d)));
    const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + d));
    const __m256i y1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + Dp + d));
    const __m256i y2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 2 * Dp + d));
    const __m256i y3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 3 * Dp + d));
    c00 = _mm256_add_epi32(c00, _mm256_madd_epi16(y0, x0)); c01 = _mm256_add_epi32(c01, _mm256_madd_epi16(y0, x1));
    c10 = _mm256_add_epi32(c10, _mm256_madd_epi16(y1, x0)); c11 = _mm256_add_epi32(c11, _mm256_madd_epi16(y1, x1));
    c20 = _mm256_add_epi32(c20, _mm256_madd_epi16(y2, x0)); c21 = _mm256_add_epi32(c21, _mm256_madd_epi16(y2, x1));
    c30 = _mm256_add_epi32(c30, _mm256_madd_epi16(y3, x0)); c31 = _mm256_add_epi32(c31, _mm256_madd_epi16(y3, x1));
    asm("" : "+x"(c00), "+x"(c01), "+x"(c10), "+x"(c11), "+x"(c20), "+x"(c21), "+x"(c30), "+x"(c31));  // see pv_i16
  }
  const __m256i h[8] = {c00, c01, c10, c11, c20, c21, c30, c31};
  store_sums_4x2(h, rs, TILE, sr);
}
#else
constexpr bool kDotI16 = false;
inline void dot_4x2_i16(const int16_t*, int64_t, const int8_t*, const int8_t*, const float*, int64_t, float*) {}
#endif

// The scaled fp32 q row ``x`` (Dp, zero-padded) as int16 ``out`` times the scale ``rs``: x / rs
// rounded, rs = max|x| / 32767, so |x - rs * out| <= rs / 2. False for a row with NaN or inf
// (the caller then scores in fp32, so the NaN reaches the row's output).
inline bool quantize_q_i16(const float* x, int64_t Dp, int16_t* out, float& rs) {
  float amax = 0.0f;
  for (int64_t d = 0; d < Dp; ++d) amax = std::max(amax, std::fabs(x[d]));
  for (int64_t d = 0; d < Dp; ++d)
    if (!std::isfinite(x[d])) return false;
  rs = amax > 0.0f ? amax / 32767.0f : 1.0f;
  const float inv = 1.0f / rs;
  for (int64_t d = 0; d < Dp; ++d)
    out[d] = static_cast<int16_t>(std::max(-32767.0f, std::min(32767.0f, std::nearbyint(x[d] * inv))));
  return true;
}

// Bytes of key rows one tile holds (all of a unit's heads): 1/16 of the core's L2, 16 to 64 KiB.
// A tile and the next one (prefetched) of K and V then take 1/4 of L2 at most; longer tiles
// spread the online softmax's per-tile work over more keys, which matters most to paged units
// (they walk every KV head of a block: 32 keys of 8 int8 heads in 32 KiB). The share and the
// bounds were chosen on paged int8 decode, where the tile length matters most.
// ATTNKIT_SPLITK_TILE_BYTES (read once per process) forces the size, so tests reach every tile
// length on any machine.
int64_t tile_key_bytes() {
  static const int64_t bytes = [] {
    if (const char* forced = std::getenv("ATTNKIT_SPLITK_TILE_BYTES")) {
      char* end = nullptr;
      const long long v = std::strtoll(forced, &end, 10);
      if (end != forced && *end == '\0' && v > 0) return static_cast<int64_t>(v);
    }
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return std::clamp<int64_t>(l2 > 0 ? l2 / 16 : 0, 16384, 65536);
  }();
  return bytes;
}

// Keys per tile for rows of ``width`` elements of ``elem`` bytes, ``heads`` heads a key: what
// tile_key_bytes() holds, 8 to kMaxTileKeys keys, rounded up to whole vectors (the softmax runs
// over whole vectors of a tile's scores; lanes past the tile's keys are -inf).
constexpr int64_t kMaxTileKeys = 128;
int64_t tile_keys(int64_t width, int64_t heads, int64_t elem) {
  const int64_t row = std::max<int64_t>(1, width * heads * elem);
  return round_up(std::max<int64_t>(8, std::min<int64_t>(kMaxTileKeys, tile_key_bytes() / row)), VL);
}

// exp(x) in fp32, lane by lane (Cephes' expf polynomial after Cody-Waite reduction, ~1 ulp):
// exp(-inf) and anything below the normal range is 0, NaN stays NaN.
inline vf vexp(vf x) {
  const vf lo = vsplat(-87.33654475f), hi = vsplat(88.0f), magic = vsplat(12582912.0f);
  vf xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const vf n = (xc * 1.44269504088896341f + magic) - magic;
  vf r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = vsplat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  const vf res = p * reinterpret_cast<const vf&>(bits);
  return x < lo ? vf{} : res;
}

// The same for one value (the online softmax's rescale factors, the slices' merge).
inline float exp_f32(float x) { return vexp(vsplat(x))[0]; }

// tanh_f32 on a whole vector.
inline vf vtanh(vf x) {
  const vi sign_mask = vi{} + static_cast<int32_t>(0x80000000u);
  const vi xb = reinterpret_cast<const vi&>(x);
  const vi ab = xb & ~sign_mask;
  const vf ax = reinterpret_cast<const vf&>(ab);
  const vf e = vexp(ax * -2.0f);
  const vf big = (1.0f - e) / (1.0f + e);
  const vf x2 = ax * ax;
  const vf small = ax * (1.0f + x2 * (-1.0f / 3.0f + x2 * (2.0f / 15.0f + x2 * (-17.0f / 315.0f + x2 * (62.0f / 2835.0f)))));
  const vf t = ax < 0.25f ? small : big;
  const vi tb = reinterpret_cast<const vi&>(t) | (xb & sign_mask);
  return reinterpret_cast<const vf&>(tb);
}

// Eight dot-product accumulators to their eight sums, [sum(c0), ..., sum(c7)]: each 512-bit
// vector folded to 256 bits (its halves added), then the AVX2 tree of horizontal adds; a lane
// loop per vector would cost as much as the dot products themselves.
inline void hsum8(const vf c[8], float* out) {
#if defined(__AVX512F__)
  __m256 h[8];
  for (int k = 0; k < 8; ++k)
    h[k] = _mm256_add_ps(_mm512_castps512_ps256((__m512)c[k]),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)c[k]), 1)));
  const __m256 t0 = _mm256_hadd_ps(h[0], h[1]), t1 = _mm256_hadd_ps(h[2], h[3]);
  const __m256 t2 = _mm256_hadd_ps(h[4], h[5]), t3 = _mm256_hadd_ps(h[6], h[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
#elif defined(__AVX__)
  const __m256 t0 = _mm256_hadd_ps((__m256)c[0], (__m256)c[1]), t1 = _mm256_hadd_ps((__m256)c[2], (__m256)c[3]);
  const __m256 t2 = _mm256_hadd_ps((__m256)c[4], (__m256)c[5]), t3 = _mm256_hadd_ps((__m256)c[6], (__m256)c[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
#else
  for (int k = 0; k < 8; ++k) out[k] = hsum(c[k]);
#endif
}

// Vector loads of VL key / value elements stored as R, widened to fp32 in registers.
template <typename R>
inline vf vload_as_f32(const R* p);
template <>
inline vf vload_as_f32<float>(const float* p) { return vload(p); }
typedef uint16_t vh __attribute__((vector_size(VL * sizeof(uint16_t))));
typedef uint16_t vh_u __attribute__((vector_size(VL * sizeof(uint16_t)), aligned(sizeof(uint16_t))));
// bf16 is the top half of an fp32: zero-extend each 16-bit lane to 32 bits and shift it up.
template <>
inline vf vload_as_f32<c10::BFloat16>(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif defined(__AVX2__)
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
  const vi w = __builtin_convertvector(*reinterpret_cast<const vh_u*>(p), vi) << 16;
  return reinterpret_cast<const vf&>(w);
#endif
}
#if defined(__AVX512F__)
template <>
inline vf vload_as_f32<c10::Half>(const c10::Half* p) {
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
constexpr bool kHalfInRegisters = true;
#elif defined(__F16C__)
template <>
inline vf vload_as_f32<c10::Half>(const c10::Half* p) {
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
constexpr bool kHalfInRegisters = true;
#else
template <>
inline vf vload_as_f32<c10::Half>(const c10::Half* p) {
  vf out;
  for (int64_t i = 0; i < VL; ++i) out[i] = static_cast<float>(p[i]);
  return out;
}
constexpr bool kHalfInRegisters = false;
#endif

// int8 rows: sign-extend each byte to 32 bits and convert.
template <>
inline vf vload_as_f32<int8_t>(const int8_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vf out;
  for (int64_t i = 0; i < VL; ++i) out[i] = static_cast<float>(p[i]);
  return out;
#endif
}
// fp8 e4m3 (no infinities; 0x7F / 0xFF are NaN), from each byte sign-extended to 32 bits: shifted
// up by 20, its sign lands in the fp32 sign bit and its 7 magnitude bits at the top of the
// exponent and mantissa fields (masked to those), read as +-2^(e - 127) * 1.m (a subnormal when
// e = 0); times 2^120 that is +-2^(e - 7) * 1.m (and m/8 * 2^-6 for e = 0): exactly e4m3's value.
// The NaN codes (the byte's low 7 bits all set: shifted up by 25, 0xFE000000) become all-ones
// lanes, a NaN. The sign extension carries the sign, so it is never masked and moved on its own.
template <>
inline vf vload_as_f32<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* p) {
#if defined(__AVX512F__)
  const vu b = (vu)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  const vu b = (vu)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  vu b;
  for (int64_t i = 0; i < VL; ++i) b[i] = static_cast<uint32_t>(reinterpret_cast<const int8_t*>(p)[i]);
#endif
  const vu bits = (b << 20) & 0x87F00000u;
  const vf f = reinterpret_cast<const vf&>(bits) * 0x1p120f;
  const vu out = reinterpret_cast<const vu&>(f) | (vu)((b << 25) == 0xFE000000u);
  return reinterpret_cast<const vf&>(out);
}
template <typename T>
constexpr bool kQuantized = std::is_same<T, int8_t>::value || std::is_same<T, c10::Float8_e4m3fn>::value;

// ``v`` grown to at least ``n`` elements (never shrunk), or nullptr when memory runs out: code
// the workers run reports failures instead of throwing.
template <typename X>
X* grown(std::vector<X>& v, int64_t n) noexcept {
  n = std::max<int64_t>(n, 1);  // never the null data() of an empty vector
  if (static_cast<int64_t>(v.size()) < n) {
    try {
      v.resize(n);
    } catch (...) {
      return nullptr;
    }
  }
  return v.data();
}

// A call's selection as build_lists() takes it: ids (B0, Hs, seq_div, n) int64 by strides, B0 1 or
// B / seq_div; block size; R and W per q sequence, (B,) int64 each (W optional).
struct Selection {
  const int64_t* ids;
  int64_t s0, s1, s2, s3, B0, n, block;
  const int64_t *lo, *hi, *ulo, *uhi;
};

// Each (q sequence b, list s)'s keys, ascending and distinct, into lists[(b * Hs + s) * L ...],
// their count into count[b * Hs + s]: the ids' blocks' keys inside [lo, hi) (clamped to [0,
// cap): the keys K/V holds), and W's keys inside it. L bounds every count (the caller's
// n * block + the longest W, at most cap). Lists are independent: built in parallel, each on a
// bitmap of its R; false when a worker could not get memory.
bool build_lists(const Selection& sel, int64_t B, int64_t Hs, int64_t seq_div, int64_t cap, int64_t L,
                 int32_t* lists, int64_t* count) {
  std::atomic<bool> ok{true};
  at::parallel_for(0, B * Hs, 16, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<uint64_t> bits_buf;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / Hs, s = p % Hs, kb = b / seq_div, i = b % seq_div;
      const int64_t lo = std::clamp<int64_t>(sel.lo[b], 0, cap), hi = std::clamp<int64_t>(sel.hi[b], 0, cap);
      count[p] = 0;
      if (lo >= hi) continue;
      const int64_t words = (hi - lo + 63) / 64;
      uint64_t* bits = grown(bits_buf, words);
      if (bits == nullptr) {
        ok.store(false, std::memory_order_relaxed);
        return;
      }
      std::fill(bits, bits + words, uint64_t{0});
      const auto set_range = [&](int64_t a, int64_t e) {  // keys [a, e) inside [lo, hi)
        a = std::max(a, lo) - lo;
        e = std::min(e, hi) - lo;
        for (int64_t x = a; x < e; ++x) bits[x >> 6] |= uint64_t{1} << (x & 63);
      };
      const int64_t* row = sel.ids + (sel.B0 == 1 ? 0 : kb) * sel.s0 + s * sel.s1 + i * sel.s2;
      for (int64_t j = 0; j < sel.n; ++j) {
        const int64_t id = row[j * sel.s3];
        if (id < 0 || id >= (cap + sel.block - 1) / sel.block) continue;  // unused; past the keys (never read)
        set_range(id * sel.block, id * sel.block + sel.block);
      }
      if (sel.ulo != nullptr) set_range(sel.ulo[b], sel.uhi[b]);
      int32_t* out = lists + p * L;
      int64_t c = 0;
      for (int64_t w = 0; w < words; ++w)
        for (uint64_t x = bits[w]; x != 0 && c < L; x &= x - 1)
          out[c++] = static_cast<int32_t>(lo + w * 64 + __builtin_ctzll(x));
      count[p] = c;
    }
  });
  return ok.load();
}

// A unit's working memory, carved from buffers each thread keeps across its units (one set per
// instantiation of run_unit: the thread_locals live in unit_scratch<T, InPlace>).
//   q (NH, M, Dp): the scaled fp32 q rows, zero-padded to whole vectors; qb (NH, M, Dp): the
//   same rows for a dot product (nullptr when it is not used): unscaled bf16 against bf16 keys,
//   int16 against int8 keys, with their scales in qs (NH, M); kbuf / vbuf
//   (NH, TILE, Dp / Dvp): a tile's rows widened to fp32 (empty when read in place); s (M, TILE):
//   one head's scores, then probabilities; acc (NH, M, Dvp); rlo / rhi (M): each row's keys in
//   the unit; krow / vrow (NH, TILE): where a tile's key / value rows are read; ks / vs (NH,
//   TILE): a tile's K / V row scales (quantized K/V); kpf / vpf (TILE): where the next tile's
//   key / value rows start (all NH heads; nullptr past its keys), prefetched while this tile's
//   scores are computed.
template <typename R>
struct UnitScratch {
  float *q, *kbuf, *vbuf, *s, *acc, *ks, *vs, *qs;
  uint16_t* qb;
  int64_t *rlo, *rhi;
  const R **krow, **vrow;
  const char **kpf, **vpf;
};

// Takes (and zeroes) the unit's scratch; false when memory ran out, which the caller reports
// instead of throwing. Plain pointers from here on: every access to a thread_local in the loops
// would go through the TLS lookup of a shared library.
template <typename T, bool InPlace, typename R>
inline bool unit_scratch(int64_t NH, int64_t M, int64_t Dp, int64_t Dvp, int64_t TILE, bool v_from_k, bool dot,
                         UnitScratch<R>& w) {
  thread_local std::vector<float> scratch;
  thread_local std::vector<int64_t> bounds;
  thread_local std::vector<const void*> rows;
  thread_local std::vector<uint16_t> qbits;
  const int64_t kbuf_n = InPlace ? 0 : NH * TILE * Dp, vbuf_n = (InPlace || v_from_k) ? 0 : NH * TILE * Dvp;
  const int64_t scales_n = kQuantized<T> ? NH * TILE : 0;
  const int64_t scratch_n = NH * M * Dp + kbuf_n + vbuf_n + M * TILE + NH * M * Dvp + 2 * scales_n + NH * M;
  float* const qbuf = grown(scratch, scratch_n);
  int64_t* const rlo = grown(bounds, 2 * M);
  const R** const krow = reinterpret_cast<const R**>(grown(rows, 2 * NH * TILE + 2 * TILE));
  uint16_t* const qb = dot ? grown(qbits, NH * M * Dp) : nullptr;
  if (qbuf == nullptr || rlo == nullptr || krow == nullptr || (dot && qb == nullptr)) return false;
  std::fill(qbuf, qbuf + scratch_n, 0.0f);  // padding lanes must add 0 to the dot products
  w.q = qbuf;
  w.kbuf = qbuf + NH * M * Dp;
  w.vbuf = w.kbuf + kbuf_n;
  w.s = w.vbuf + vbuf_n;
  w.acc = w.s + M * TILE;
  w.ks = scales_n ? w.acc + NH * M * Dvp : nullptr;
  w.vs = scales_n ? w.ks + scales_n : nullptr;
  w.qs = w.acc + NH * M * Dvp + 2 * scales_n;
  w.qb = qb;
  w.rlo = rlo;
  w.rhi = rlo + M;
  w.krow = krow;
  w.vrow = krow + NH * TILE;
  w.kpf = reinterpret_cast<const char**>(krow + 2 * NH * TILE);
  w.vpf = w.kpf + TILE;
  if (dot) std::fill(qb, qb + NH * M * Dp, 0);  // as above
  return true;
}

// The unit's NH * M query rows, scaled, into ``qbuf``, and for a dot product into ``qb``: for
// bf16 keys the rows unscaled (the sums are scaled instead, so the bf16 products stay exact),
// for int8 keys as int16 with their scales in ``qs``. Returns whether the dot product can be
// used: not for int8 keys when a row holds NaN or inf.
template <typename T>
__attribute__((always_inline)) inline bool load_unit_q(const Args& a, const Unit& u, int64_t M, int64_t Dp, bool dot,
                                                       float* qbuf, uint16_t* qb, float* qs) {
  for (int64_t r = 0; r < u.nh * M; ++r) {
    const int64_t hh = r / M, rr = r % M, row = (u.b * a.Hq + (u.h + hh) * a.G + rr / a.Sq) * a.Sq + rr % a.Sq;
    load_q(a, row, qbuf + r * Dp);
    if (!dot) continue;
    if constexpr (std::is_same<T, int8_t>::value)
      dot = quantize_q_i16(qbuf + r * Dp, Dp, reinterpret_cast<int16_t*>(qb + r * Dp), qs[r]);
    else
      std::memcpy(qb + r * Dp, static_cast<const uint16_t*>(a.q) + row * a.D, a.D * sizeof(uint16_t));
  }
  return dot;
}

// Each row's keys inside the unit, [rlo[r], rhi[r]), and the span [start, end) the unit walks:
// the union of the non-empty ones (start >= end when no row sees any key of the unit).
__attribute__((always_inline)) inline void unit_key_bounds(const Args& a, const Unit& u, int64_t M, int64_t* rlo,
                                                           int64_t* rhi, int64_t& start, int64_t& end) {
  start = u.s1;
  end = u.s0;
  const int64_t li = a.keys != nullptr ? list_index(a, u.b, u.h) : 0;  // a unit's heads share one list
  for (int64_t r = 0; r < M; ++r) {
    const int64_t i = r % a.Sq;
    rlo[r] = std::max(a.keys != nullptr ? a.klo[li] : row_lo(a, u.b, i), u.s0);
    rhi[r] = std::min(a.keys != nullptr ? a.khi[li] : row_hi(a, u.b, i), u.s1);
    if (rlo[r] < rhi[r]) {
      start = std::min(start, rlo[r]);
      end = std::max(end, rhi[r]);
    }
  }
}

// A quantized row's scale as the kernel uses it: inf or NaN is a NaN row (attnkit.kvquant), whose
// score and weight become NaN, never +-inf (an -inf score would silently mask the key).
inline float finite_or_nan(float x) { return std::isfinite(x) ? x : std::numeric_limits<float>::quiet_NaN(); }

// dst[j] = finite_or_nan(src[j * stride]) for j < n; contiguous scales (a dense cache's) a vector
// at a time: the compiler vectorizes only the unit-stride loop.
inline void copy_scales(const float* __restrict src, int64_t stride, int64_t n, float* __restrict dst) {
  if (stride == 1) {
    for (int64_t j = 0; j < n; ++j) dst[j] = finite_or_nan(src[j]);
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = finite_or_nan(src[j * stride]);
  }
}

// The key and value rows of a unit's NH heads, a tile at a time. gather() points krow / vrow
// (NH, TILE) at a tile's rows (in place, or copied to fp32 buffers) and kpf / vpf (TILE) at the
// next tile's (its keys' rows of the unit's first head), which the score loops prefetch (NextRows).
template <typename T, bool InPlace>
struct TileRows {
  using R = typename std::conditional<InPlace, T, float>::type;
  const Args& a;
  const int64_t b;        // the K/V sequence (its block-table row)
  const int32_t* list;    // the unit's selection (nullptr: keys are positions)
  Rows<T> k, v;
  Rows<float> ks, vs;  // the rows' scales (quantized K/V)
  const int64_t NH, D, Dv, Dp, Dvp, TILE;
  const bool v_from_k;

  TileRows(const Args& args, const Unit& u)
      : a(args),
        b(u.b / args.seq_div),
        list(list_of(args, u.b, u.h)),
        k(a, a.k, a.ks0, a.ks1, a.ks2, b, u.h),
        v(a, a.v == nullptr ? a.k : a.v, a.vs0, a.vs1, a.vs2, b, u.h),
        ks(a, a.ksc, a.kss0, a.kss1, a.kss2, b, u.h),
        vs(a.vsc == nullptr ? ks : Rows<float>(a, a.vsc, a.vss0, a.vss1, a.vss2, b, u.h)),
        NH(u.nh),
        D(a.D),
        Dv(a.Dv),
        Dp(round_up(a.D, VL)),
        Dvp(round_up(a.Dv, VL)),
        TILE(a.tile),
        v_from_k(a.v == nullptr) {}

  // The scales of a run of keys from ``first`` (all NH heads), a line at a time, where they lie
  // together (as the caches lay them out); scattered ones (a strided view) are left to the loads.
  __attribute__((always_inline)) inline void prefetch_scales(const float* first, const Rows<float>& r,
                                                             int64_t run) const {
    const int64_t span = (run - 1) * r.key + (NH - 1) * r.head + 1;  // elements from first to last
    if (span > 2 * run * NH) return;
    for (int64_t c = 0; c < span; c += 64 / sizeof(float)) __builtin_prefetch(first + c, 0, 3);
  }

  // The n keys from t0 (the unit walks up to ``end``); quantized K/V also put the rows' scales
  // in ``kscale`` / ``vscale`` (NH, TILE). Rows are addressed by arithmetic on locals, a block
  // run at a time: the compiler keeps it in registers (stepping walkers kept in memory, which
  // every row pointer stored might alias, are reloaded after every store).
  __attribute__((always_inline)) inline void gather(int64_t t0, int64_t n, int64_t end, const R** krow, const R** vrow,
                                                    const char** kpf, const char** vpf, float* kbuf, float* vbuf,
                                                    float* kscale, float* vscale) const {
    const int64_t NH = this->NH, D = this->D, Dv = this->Dv, Dp = this->Dp, Dvp = this->Dvp, TILE = this->TILE;
    const bool v_from_k = this->v_from_k;
    const Rows<T> k = this->k, v = v_from_k ? this->k : this->v;  // V = K[:Dv] reads the K rows
    const Rows<float> ks = this->ks, vs = this->vs;
    for_runs(a, b, list, t0, n, [&](int64_t j0, int64_t run, int64_t id, int64_t off) {
      const int64_t kkey = k.key, vkey = v.key;
      for (int64_t hh = 0; hh < NH; ++hh) {
        const T* const k0 = k.start(id, off) + hh * k.head;
        const T* const v0 = v.start(id, off) + hh * v.head;
        const int64_t x = hh * TILE + j0;
        if constexpr (InPlace) {
          for (int64_t jj = 0; jj < run; ++jj) {
            krow[x + jj] = k0 + jj * kkey;
            vrow[x + jj] = v0 + jj * vkey;
          }
        } else {
          for (int64_t jj = 0; jj < run; ++jj) {
            float* const kb = kbuf + (x + jj) * Dp;
            to_f32<T>(k0 + jj * kkey, kb, D);
            krow[x + jj] = kb;
            if (v_from_k) {
              vrow[x + jj] = kb;  // lanes past Dv hold K's other channels: accumulated, dropped
            } else {
              float* const vb = vbuf + (x + jj) * Dvp;
              to_f32<T>(v0 + jj * vkey, vb, Dv);
              vrow[x + jj] = vb;
            }
          }
        }
        if constexpr (kQuantized<T>) {
          copy_scales(ks.start(id, off) + hh * ks.head, ks.key, run, kscale + x);
          copy_scales(vs.start(id, off) + hh * vs.head, vs.key, run, vscale + x);
        }
      }
    });
    // The next tile's rows (its first ``ahead`` keys, inside the unit's walk); its scales are
    // prefetched here (a few lines), its rows by the score loops.
    const int64_t ahead = std::min(TILE, std::max<int64_t>(0, end - t0 - TILE));
    for (int64_t j = ahead; j < n; ++j) kpf[j] = vpf[j] = nullptr;
    for_runs(a, b, list, t0 + TILE, ahead, [&](int64_t j0, int64_t run, int64_t id, int64_t off) {
      const T* const k0 = k.start(id, off);
      const T* const v0 = v.start(id, off);
      for (int64_t jj = 0; jj < run; ++jj) {
        kpf[j0 + jj] = reinterpret_cast<const char*>(k0 + jj * k.key);
        vpf[j0 + jj] = v_from_k ? nullptr : reinterpret_cast<const char*>(v0 + jj * v.key);
      }
      if constexpr (kQuantized<T>) {
        prefetch_scales(ks.start(id, off), ks, run);
        prefetch_scales(vs.start(id, off), vs, run);
      }
    });
  }
};

// Scores of 4 rows x 2 keys by bf16 dot products of the unscaled q, scaled afterwards, into
// ``sr`` (rows TILE apart).
__attribute__((always_inline)) inline void score_4x2_bf16dot(const uint16_t* qb, int64_t Dp, const c10::BFloat16* k0,
                                                             const c10::BFloat16* k1, float scale, int64_t TILE,
                                                             float* sr) {
  float sums[8];
  dot_4x2_bf16(qb, Dp, k0, k1, sums);
  for (int64_t x = 0; x < 4; ++x) {
    sr[x * TILE] = sums[2 * x] * scale;
    sr[x * TILE + 1] = sums[2 * x + 1] * scale;
  }
}

// Scores of 4 rows x 2 keys by fp32 FMAs: 8 accumulators in registers, every key and q vector
// loaded once per pass over D. ``q0`` holds the 4 rows Dp apart; ``sr`` takes them TILE apart.
template <typename R>
__attribute__((always_inline)) inline void score_4x2_fma(const float* q0, int64_t Dp, const R* k0, const R* k1,
                                                         int64_t TILE, float* sr) {
  vf c00 = {}, c01 = {}, c10 = {}, c11 = {}, c20 = {}, c21 = {}, c30 = {}, c31 = {};
  for (int64_t d = 0; d < Dp; d += VL) {
    const vf x0 = vload_as_f32(k0 + d), x1 = vload_as_f32(k1 + d);
    const vf y0 = vload(q0 + d), y1 = vload(q0 + Dp + d), y2 = vload(q0 + 2 * Dp + d), y3 = vload(q0 + 3 * Dp + d);
    c00 += y0 * x0; c01 += y0 * x1;
    c10 += y1 * x0; c11 += y1 * x1;
    c20 += y2 * x0; c21 += y2 * x1;
    c30 += y3 * x0; c31 += y3 * x1;
  }
  const vf c[8] = {c00, c01, c10, c11, c20, c21, c30, c31};
  float sums[8];
  hsum8(c, sums);
  sr[0] = sums[0]; sr[1] = sums[1];
  sr[TILE] = sums[2]; sr[TILE + 1] = sums[3];
  sr[2 * TILE] = sums[4]; sr[2 * TILE + 1] = sums[5];
  sr[3 * TILE] = sums[6]; sr[3 * TILE + 1] = sums[7];
}

// One row's scores against keys j, j + 1 (the rows past the last group of 4).
template <typename R>
__attribute__((always_inline)) inline void score_1x2_fma(const float* q0, int64_t Dp, const R* k0, const R* k1,
                                                         float* sr) {
  vf c0 = {}, c1 = {};
  for (int64_t d = 0; d < Dp; d += VL) {
    const vf y = vload(q0 + d);
    c0 += y * vload_as_f32(k0 + d);
    c1 += y * vload_as_f32(k1 + d);
  }
  sr[0] = hsum(c0);
  sr[1] = hsum(c1);
}

// One row's score against one key (the tile's odd last key).
template <typename R>
__attribute__((always_inline)) inline float score_1x1_fma(const float* q0, int64_t Dp, const R* k0) {
  vf c0 = {};
  for (int64_t d = 0; d < Dp; d += VL) c0 += vload(q0 + d) * vload_as_f32(k0 + d);
  return hsum(c0);
}

// The next tile's rows, prefetched a (key, head) row at a time by the score loops: the unit's NH
// heads' loops over this tile's n keys take the next tile's NH * n rows in turn, head hh's loop
// rows hh * n .. hh * n + n - 1 in (key, head) order, which is address order in a paged pool
// (block, slot, head): the core's own prefetcher then streams along with them. One row per key's
// scores spreads the requests over the tile's arithmetic, where one burst would stall on the
// core's few outstanding misses (line fill buffers) with nothing to overlap. (A head at a time
// would step through the pool rows 1 KiB apart, a stride some cores' prefetchers, Zen 3's among
// them, do not follow.) Key j's row of head x is ``klen`` (``vlen``) bytes from
// ``k[j] + x * khead`` (``v[j] + x * vhead``); null entries (past the next tile, V read from K)
// are skipped.
struct NextRows {
  const char* const* k;
  const char* const* v;
  int64_t klen, khead, vlen, vhead, nh;
  int64_t key = 0, x = 0;  // the row prefetch() takes next

  // Positions at row ``first`` (hh * n for head hh's loop).
  __attribute__((always_inline)) inline void seek(int64_t first) {
    key = first / nh;
    x = first - key * nh;
  }

  __attribute__((always_inline)) inline void prefetch() {
    if (const char* p = k[key])
      for (int64_t c = 0; c < klen; c += 64) __builtin_prefetch(p + x * khead + c, 0, 3);
    if (const char* p = v[key])
      for (int64_t c = 0; c < vlen; c += 64) __builtin_prefetch(p + x * vhead + c, 0, 3);
    if (++x == nh) {
      x = 0;
      ++key;
    }
  }
};

// s[r][j] = q_r . k_j (scaled) for the M rows of one head and the tile's n keys ``krh``: two keys
// and four rows per pass, through the bf16 dot product where ``qbh`` is given (DotType: the
// instantiation can take it), else by FMAs. A row of the next tile is prefetched with each key's
// scores.
template <typename R, bool DotType>
__attribute__((always_inline)) inline void score_tile(const float* qh, const uint16_t* qbh, const float* qsh,
                                                      const R* const* krh,
                                                      int64_t M, int64_t Dp, int64_t n, int64_t TILE, float scale,
                                                      NextRows& next, float* sbuf) {
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    next.prefetch();
    next.prefetch();
    const R* k0 = krh[j];
    const R* k1 = krh[j + 1];
    int64_t r = 0;
    if constexpr (DotType) {
      if (qbh != nullptr) {
        if constexpr (std::is_same<R, int8_t>::value) {
          for (; r + 4 <= M; r += 4)
            dot_4x2_i16(reinterpret_cast<const int16_t*>(qbh) + r * Dp, Dp, k0, k1, qsh + r, TILE, sbuf + r * TILE + j);
        } else {
          for (; r + 4 <= M; r += 4)
            score_4x2_bf16dot(qbh + r * Dp, Dp, reinterpret_cast<const c10::BFloat16*>(k0),
                              reinterpret_cast<const c10::BFloat16*>(k1), scale, TILE, sbuf + r * TILE + j);
        }
      }
    }
    for (; r + 4 <= M; r += 4) score_4x2_fma(qh + r * Dp, Dp, k0, k1, TILE, sbuf + r * TILE + j);
    for (; r < M; ++r) score_1x2_fma(qh + r * Dp, Dp, k0, k1, sbuf + r * TILE + j);
  }
  for (; j < n; ++j) {
    next.prefetch();
    for (int64_t r = 0; r < M; ++r) sbuf[r * TILE + j] = score_1x1_fma(qh + r * Dp, Dp, krh[j]);
  }
}

// Soft cap, bias and ALiBi on row i (query head hq) of a tile's n scores from key t0 (list entry
// t0 with a selection ``list``), in that order (the cap applies to the scaled score alone).
__attribute__((always_inline)) inline void modify_scores(const Args& a, int64_t b, int64_t hq, int64_t i, int64_t t0,
                                                         int64_t n, const int32_t* list, float* s) {
  if (a.softcap > 0.0f) {
    const float c = a.softcap, inv = 1.0f / a.softcap;
    for (int64_t jj = 0; jj < n; jj += VL) vstore(s + jj, vtanh(vload(s + jj) * inv) * c);
  }
  if (a.bias != nullptr) {
    const float* br = a.bias + b * a.bs0 + hq * a.bs1 + i * a.bs2;
    for (int64_t jj = 0; jj < n; ++jj) s[jj] += br[(t0 + jj) * a.bs3];
  }
  if (a.slopes != nullptr) {
    const float slope = a.slopes[hq];
    const int64_t p = a.qpos ? a.qpos[b * a.Sq + i] : i + a.Sk - a.Sq;
    if (list != nullptr) {  // the entries' own positions (|distance| < 2^24: exact floats)
      for (int64_t jj = 0; jj < n; ++jj) s[jj] += slope * static_cast<float>(list[t0 + jj] - p);
      return;
    }
    // distances t0 + jj - p as exact floats (|d| < 2^24), a vector at a time (lanes past n are
    // overwritten with -inf by the caller)
    vf dist;
    for (int64_t x = 0; x < VL; ++x) dist[x] = static_cast<float>(t0 - p + x);
    const vf sl = vsplat(slope), step = vsplat(static_cast<float>(VL));
    for (int64_t jj = 0; jj < n; jj += VL, dist += step) vstore(s + jj, vload(s + jj) + sl * dist);
  }
}

// The online softmax over one row's scores ``s``, nv of them (a whole number of vectors: the
// tile's n keys, then -inf; masked ones -inf too): s becomes p = exp(s - m_new), and the row's
// running max m, sum l and accumulator ``ar`` (Dvp) are rescaled to m_new. False, with s zeroed,
// while every visible score so far is -inf (masked by the bias). nv, not the tile's capacity: a
// short context's or the last tile's few keys pay for their own exponentials only.
__attribute__((always_inline)) inline bool online_softmax_row(float* s, int64_t nv, float& m, float& l, float* ar,
                                                              int64_t Dvp) {
  vf vmax = vsplat(kNegInf);
  for (int64_t jj = 0; jj < nv; jj += VL) {
    const vf x = vload(s + jj);
    vmax = (x != x || x > vmax) ? x : vmax;  // NaN-propagating
  }
  float mt = kNegInf;
  for (int64_t k = 0; k < VL; ++k) mt = nan_max(vmax[k], mt);
  const float m_new = nan_max(mt, m);
  if (m_new == kNegInf) {
    std::fill(s, s + nv, 0.0f);
    return false;
  }
  // 0 while m is -inf; NaN poisons the row; 1 (exp(0)) when the max stayed, as most tiles' does
  const float alpha = m_new == m ? 1.0f : exp_f32(m - m_new);
  vf vsum = {};
  const vf mv = vsplat(m_new);
  for (int64_t jj = 0; jj < nv; jj += VL) {
    const vf p = vexp(vload(s + jj) - mv);
    vstore(s + jj, p);
    vsum += p;
  }
  l = l * alpha + hsum(vsum);
  if (alpha != 1.0f) {
    const vf va = vsplat(alpha);
    for (int64_t d = 0; d < Dvp; d += VL) vstore(ar + d, vload(ar + d) * va);
  }
  m = m_new;
  return true;
}

// Modifiers, the rows' intervals and the online softmax over one head's tile (n keys from t0):
// the scores in ``sbuf`` become probabilities (0 where a row sees nothing). Returns in
// [vis_lo, vis_hi) the tile's keys some row sees (vis_lo >= vis_hi: none).
//
// Quantized K/V (``ksh`` / ``vsh``: the head's TILE row scales): each score is first multiplied by
// its key's scale, and each probability, once the row's sum has it, by its value's scale.
__attribute__((always_inline)) inline void softmax_tile(const Args& a, const Unit& u, int64_t hh, int64_t M,
                                                        int64_t t0, int64_t n, int64_t TILE, const int64_t* rlo,
                                                        const int64_t* rhi, float* sbuf, float* mh, float* lh,
                                                        float* ach, int64_t Dvp, const float* ksh, const float* vsh,
                                                        const int32_t* list, int64_t& vis_lo, int64_t& vis_hi) {
  vis_lo = n;
  vis_hi = 0;
  const int64_t nv = (n + VL - 1) / VL * VL;  // <= TILE, a multiple of VL
  for (int64_t r = 0; r < M; ++r) {
    float* s = sbuf + r * TILE;
    const int64_t jlo = std::max<int64_t>(0, rlo[r] - t0), jhi = std::min<int64_t>(n, rhi[r] - t0);
    if (jlo >= jhi) {  // nothing of this tile is visible to r: contributes p = 0
      std::fill(s, s + n, 0.0f);
      continue;
    }
    const int64_t g = r / a.Sq, i = r % a.Sq, hq = (u.h + hh) * a.G + g;
    if (ksh != nullptr)
      for (int64_t jj = jlo; jj < jhi; ++jj) s[jj] *= ksh[jj];
    modify_scores(a, u.b, hq, i, t0, n, list, s);
    for (int64_t jj = 0; jj < jlo; ++jj) s[jj] = kNegInf;
    for (int64_t jj = jhi; jj < nv; ++jj) s[jj] = kNegInf;  // also the padding past n
    if (!online_softmax_row(s, nv, mh[r], lh[r], ach + r * Dvp, Dvp)) continue;
    if (vsh != nullptr)
      for (int64_t jj = jlo; jj < jhi; ++jj) s[jj] *= vsh[jj];
    vis_lo = std::min(vis_lo, jlo);
    vis_hi = std::max(vis_hi, jhi);
  }
}

// acc (4 rows Dvp apart, W vectors from d) += P @ V over keys [lo, hi): 4 * W accumulators stay
// in registers while the V rows stream by (per key W V loads and four broadcasts feed 4 * W
// FMAs); ``p0`` holds the 4 rows' probabilities TILE apart. W is what the register file holds
// with the V vectors and broadcasts beside the accumulators: 4 with AVX-512's 32 registers, 2
// with AVX2's 16.
#if defined(__AVX512F__)
constexpr int64_t kPVW = 4;
#else
constexpr int64_t kPVW = 2;
#endif
template <typename R>
__attribute__((always_inline)) inline void pv_4xW(float* a0, const float* p0, const R* const* vrh, int64_t d,
                                                  int64_t Dvp, int64_t TILE, int64_t lo, int64_t hi) {
  vf x[4][kPVW] = {};
  for (int64_t jj = lo; jj < hi; ++jj) {
    const R* vr = vrh[jj] + d;
    vf v[kPVW];
    for (int64_t w = 0; w < kPVW; ++w) v[w] = vload_as_f32(vr + w * VL);
    for (int64_t r = 0; r < 4; ++r) {
      const vf p = vsplat(p0[r * TILE + jj]);
      for (int64_t w = 0; w < kPVW; ++w) x[r][w] += p * v[w];
    }
  }
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t w = 0; w < kPVW; ++w) vstore(a0 + r * Dvp + w * VL, vload(a0 + r * Dvp + w * VL) + x[r][w]);
}

// One row, two vectors (the rows past the last group of 4).
template <typename R>
__attribute__((always_inline)) inline void pv_1x2(float* a0, const float* p0, const R* const* vrh, int64_t d,
                                                  int64_t lo, int64_t hi) {
  vf x0 = {}, y0 = {};
  for (int64_t jj = lo; jj < hi; ++jj) {
    const vf pp = vsplat(p0[jj]);
    x0 += pp * vload_as_f32(vrh[jj] + d);
    y0 += pp * vload_as_f32(vrh[jj] + d + VL);
  }
  vstore(a0, vload(a0) + x0);
  vstore(a0 + VL, vload(a0 + VL) + y0);
}

// One row, one vector (an odd last vector of Dvp).
template <typename R>
__attribute__((always_inline)) inline void pv_1x1(float* a0, const float* p0, const R* const* vrh, int64_t d,
                                                  int64_t lo, int64_t hi) {
  vf x0 = {};
  for (int64_t jj = lo; jj < hi; ++jj) x0 += p0[jj] * vload_as_f32(vrh[jj] + d);
  vstore(a0, vload(a0) + x0);
}

// P @ V for NR rows over int8 V by integer multiply-adds (bf16 / fp16 queries, as the scores'
// dot product). p0 (NR, TILE): the rows' probabilities, TILE apart; vrh (TILE): the tile's V rows
// (int8, Dvp channels); acc a0 (NR, Dvp). Each row's probabilities over [lo, hi), already times
// the values' scales, as
// int16 to 2^-16 of the row's largest (far below the rounding of a bf16 / fp16 result), two keys
// to an int32 lane, against the two keys' V rows interleaved channel by channel. VPMADDWD
// multiplies and sums each pair exactly into int32 (|sum| <= kMaxTileKeys * 32767 * 128 < 2^31);
// the fp32 path converts every V element to fp32 and issues twice the multiply-adds. acc += the
// sums times each row's scale, once per tile. False, with nothing done, when a row's
// probabilities hold NaN or inf (the fp32 path carries those into the output) or are all below
// 32767 * FLT_MIN (their int16 step would be subnormal).
// AVX2 builds only: AVX-512 keeps its 16-lane fp32 FMAs (the integer path was measured on AVX2,
// benchmarks/results/quantized.md).
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int64_t kPVI16 = 16;  // channels per block
#else
constexpr int64_t kPVI16 = 0;  // no integer P @ V
#endif
template <int NR>  // 1 or 4
__attribute__((always_inline)) inline bool pv_i16(float* a0, const float* p0, const int8_t* const* vrh, int64_t Dvp,
                                                  int64_t TILE, int64_t lo, int64_t hi) {
  static_assert(NR == 1 || NR == 4, "pv_i16 runs 1 or 4 rows");
  if constexpr (kPVI16 == 0) {
    return false;
  } else {
    int32_t pairs[NR][kMaxTileKeys / 2 + 1];
    float rs[NR];
    const int64_t np = (hi - lo + 1) / 2;
    for (int r = 0; r < NR; ++r) {
      const float* p = p0 + r * TILE;
      const int64_t whole = lo + (hi - lo) / 16 * 16;  // [lo, whole) in vectors, the rest one by one
      __m256 vmx = _mm256_setzero_ps(), vpoison = _mm256_setzero_ps();
      const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
      for (int64_t j = lo; j < whole; j += 8) {
        const __m256 x = _mm256_loadu_ps(p + j);
        vmx = _mm256_max_ps(vmx, _mm256_andnot_ps(sign, x));
        vpoison = _mm256_add_ps(vpoison, _mm256_mul_ps(x, zero));  // NaN once any p is NaN or inf
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      bool poisoned = _mm256_movemask_ps(_mm256_cmp_ps(vpoison, vpoison, _CMP_UNORD_Q)) != 0;
      for (int64_t j = whole; j < hi; ++j) {
        mx = std::max(mx, std::fabs(p[j]));
        poisoned |= !std::isfinite(p[j]);
      }
      // NaN / inf, or a largest probability so small that its int16 step (mx / 32767) would be
      // subnormal (and 32767 / mx overflow): the fp32 path
      if (poisoned || (mx > 0.0f && mx < 32767.0f * std::numeric_limits<float>::min())) return false;
      rs[r] = mx / 32767.0f;
      const float inv = mx > 0.0f ? 32767.0f / mx : 0.0f;
      // 16 keys -> 8 pairs: round to int32 (the default rounding, to nearest), pack with
      // saturation to int16 (in-lane, so the two middle quarters swap), put the quarters back
      const __m256 vinv = _mm256_set1_ps(inv);
      for (int64_t j = lo; j < whole; j += 16) {
        const __m256i c0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + j), vinv));
        const __m256i c1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + j + 8), vinv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs[r] + (j - lo) / 2),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(c0, c1), 0xD8));
      }
      auto q16 = [&](int64_t j) -> uint32_t {
        const float x = std::max(-32767.0f, std::min(32767.0f, std::nearbyint(p[j] * inv)));
        return static_cast<uint16_t>(static_cast<int16_t>(x));
      };
      for (int64_t j = whole; j < hi; j += 2)
        pairs[r][(j - lo) / 2] = static_cast<int32_t>(q16(j) | (j + 1 < hi ? q16(j + 1) << 16 : 0u));
    }
    for (int64_t d = 0; d < Dvp; d += kPVI16) {
      __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
              c31 = c00;
      for (int64_t k = 0; k < np; ++k) {
        const int64_t j = lo + 2 * k;
        const __m256i x0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vrh[j] + d)));
        const __m256i x1 = _mm256_cvtepi8_epi16(  // the last key of an odd count pairs with itself (p 0)
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(vrh[std::min(j + 1, hi - 1)] + d)));
        const __m256i il = _mm256_unpacklo_epi16(x0, x1), ih = _mm256_unpackhi_epi16(x0, x1);
        __m256i b = _mm256_set1_epi32(pairs[0][k]);
        c00 = _mm256_add_epi32(c00, _mm256_madd_epi16(b, il));
        c01 = _mm256_add_epi32(c01, _mm256_madd_epi16(b, ih));
        if constexpr (NR > 1) {
          b = _mm256_set1_epi32(pairs[1][k]);
          c10 = _mm256_add_epi32(c10, _mm256_madd_epi16(b, il));
          c11 = _mm256_add_epi32(c11, _mm256_madd_epi16(b, ih));
          b = _mm256_set1_epi32(pairs[2][k]);
          c20 = _mm256_add_epi32(c20, _mm256_madd_epi16(b, il));
          c21 = _mm256_add_epi32(c21, _mm256_madd_epi16(b, ih));
          b = _mm256_set1_epi32(pairs[3][k]);
          c30 = _mm256_add_epi32(c30, _mm256_madd_epi16(b, il));
          c31 = _mm256_add_epi32(c31, _mm256_madd_epi16(b, ih));
        }
        // keeps the eight accumulators in registers: without it GCC spills one to the stack
        asm("" : "+x"(c00), "+x"(c01), "+x"(c10), "+x"(c11), "+x"(c20), "+x"(c21), "+x"(c30), "+x"(c31));
      }
      const __m256i c[4][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
      for (int r = 0; r < NR; ++r) {
        // il / ih hold channels (0-3, 8-11) / (4-7, 12-15): back in order
        const __m256 s = _mm256_set1_ps(rs[r]);
        float* ar = a0 + r * Dvp + d;
        _mm256_storeu_ps(ar, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_permute2x128_si256(c[r][0], c[r][1], 0x20)), s,
                                             _mm256_loadu_ps(ar)));
        _mm256_storeu_ps(ar + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_permute2x128_si256(c[r][0], c[r][1], 0x31)),
                                                 s, _mm256_loadu_ps(ar + 8)));
      }
    }
    return true;
  }
}

// accumulate_pv's fp32 multiply-adds, for M rows.
template <typename R>
__attribute__((always_inline)) inline void accumulate_pv_fp32(float* ach, const float* sbuf, const R* const* vrh,
                                                              int64_t M, int64_t Dvp, int64_t TILE, int64_t vis_lo,
                                                              int64_t vis_hi) {
  int64_t r = 0;
  for (; r + 4 <= M; r += 4) {
    int64_t d = 0;
    for (; d + kPVW * VL <= Dvp; d += kPVW * VL)
      pv_4xW(ach + r * Dvp + d, sbuf + r * TILE, vrh, d, Dvp, TILE, vis_lo, vis_hi);
    for (; d < Dvp; d += VL)
      for (int64_t x = r; x < r + 4; ++x) pv_1x1(ach + x * Dvp + d, sbuf + x * TILE, vrh, d, vis_lo, vis_hi);
  }
  int64_t d = 0;
  for (; d + 2 * VL <= Dvp; d += 2 * VL)
    for (int64_t x = r; x < M; ++x) pv_1x2(ach + x * Dvp + d, sbuf + x * TILE, vrh, d, vis_lo, vis_hi);
  for (; d < Dvp; d += VL)
    for (int64_t x = r; x < M; ++x) pv_1x1(ach + x * Dvp + d, sbuf + x * TILE, vrh, d, vis_lo, vis_hi);
}

// acc += P @ V for one head's tile, over the keys some row sees (p = 0 for the others, as in
// P @ V of the math). Each tile's sum starts from zero and is added to acc once (blocked
// summation): a long single-threaded walk does not add every key's term to one running total,
// whose rounding would grow with the number of keys. ``int_pv``: int8 V for a bf16 / fp16 query,
// summed by pv_i16 where it can.
template <typename R>
__attribute__((always_inline)) inline void accumulate_pv(float* ach, const float* sbuf, const R* const* vrh, int64_t M,
                                                         int64_t Dvp, int64_t TILE, int64_t vis_lo, int64_t vis_hi,
                                                         bool int_pv) {
  if constexpr (kPVI16 > 0 && std::is_same<R, int8_t>::value) {
    if (int_pv && vis_lo < vis_hi && Dvp % kPVI16 == 0) {
      int64_t r = 0;
      for (; r + 4 <= M; r += 4)
        if (!pv_i16<4>(ach + r * Dvp, sbuf + r * TILE, vrh, Dvp, TILE, vis_lo, vis_hi))
          accumulate_pv_fp32(ach + r * Dvp, sbuf + r * TILE, vrh, 4, Dvp, TILE, vis_lo, vis_hi);
      for (; r < M; ++r)
        if (!pv_i16<1>(ach + r * Dvp, sbuf + r * TILE, vrh, Dvp, TILE, vis_lo, vis_hi))
          accumulate_pv_fp32(ach + r * Dvp, sbuf + r * TILE, vrh, 1, Dvp, TILE, vis_lo, vis_hi);
      return;
    }
  }
  accumulate_pv_fp32(ach, sbuf, vrh, M, Dvp, TILE, vis_lo, vis_hi);
}

// The unit's unnormalised accumulators, (rows, Dvp) with padding lanes, to its partials (rows, Dv).
inline void write_unit_partials(const float* acc, int64_t rows, int64_t Dvp, int64_t Dv, float* acc_out) {
  for (int64_t r = 0; r < rows; ++r) std::copy(acc + r * Dvp, acc + r * Dvp + Dv, acc_out + r * Dv);
}

// One unit: all M rows of each of its nh KV heads over keys [s0, s1). Writes m (nh, M), l (nh, M)
// and the unnormalised acc (nh, M, Dv). The heads of a unit share the walk over the keys: a tile's
// rows of all nh heads are gathered (prefetched) together, then each head runs over them in turn.
//
// InPlace: the loops read key and value rows as T itself, in place in the cache, widened to fp32
// in registers (when whole vectors cover D and Dv); else as floats from a tile buffer the rows are
// copied (converted) into (other widths: q and the buffers are zero-padded to whole vectors, so padding
// lanes add 0 to the dot products; V lanes past Dv are accumulated and dropped).
template <typename T, bool InPlace>
void run_unit(const Args& a, const Unit& u, float* m, float* l, float* acc_out) {
  using R = typename std::conditional<InPlace, T, float>::type;
  const int64_t M = a.G * a.Sq, Dv = a.Dv, NH = u.nh;
  const int64_t Dp = round_up(a.D, VL), Dvp = round_up(Dv, VL);
  const int64_t TILE = a.tile;
  // bf16 K read in place by the CPU's bf16 dot product, for bf16 queries (exact in bf16 already);
  // int8 K by the integer one, for bf16 / fp16 queries (fp32 ones keep fp32 products: int16 holds
  // fewer digits than they have), D <= 256 (the int32 sums cannot overflow).
  constexpr bool kDotType = InPlace && ((kDotBF16 && std::is_same<T, c10::BFloat16>::value) ||
                                        (kDotI16 && std::is_same<T, int8_t>::value));
  const bool dot = kDotType && Dp % 32 == 0 &&
                   (std::is_same<T, int8_t>::value ? (a.q_type != at::kFloat && Dp <= 256) : a.q_type == at::kBFloat16);
  UnitScratch<R> w;
  if (!unit_scratch<T, InPlace>(NH, M, Dp, Dvp, TILE, a.v == nullptr, dot, w)) {
    a.failed->store(kNoMemory, std::memory_order_relaxed);
    return;
  }
  const bool use_dot = load_unit_q<T>(a, u, M, Dp, dot, w.q, w.qb, w.qs);
  int64_t start, end;
  unit_key_bounds(a, u, M, w.rlo, w.rhi, start, end);
  std::fill(m, m + NH * M, kNegInf);
  std::fill(l, l + NH * M, 0.0f);

  TileRows<T, InPlace> tiles(a, u);
  constexpr int64_t elem = sizeof(T);
  NextRows next{w.kpf, w.vpf, a.D * elem, tiles.k.head * elem, a.Dv * elem, tiles.v.head * elem, NH};
  for (int64_t t0 = start; t0 < end; t0 += TILE) {
    const int64_t n = std::min(TILE, end - t0);
    tiles.gather(t0, n, end, w.krow, w.vrow, w.kpf, w.vpf, w.kbuf, w.vbuf, w.ks, w.vs);
    for (int64_t hh = 0; hh < NH; ++hh) {
      float* const ach = w.acc + hh * M * Dvp;
      next.seek(hh * n);
      score_tile<R, kDotType>(w.q + hh * M * Dp, use_dot ? w.qb + hh * M * Dp : nullptr, w.qs + hh * M,
                              w.krow + hh * TILE, M, Dp, n, TILE, a.scale, next, w.s);
      int64_t vis_lo, vis_hi;
      softmax_tile(a, u, hh, M, t0, n, TILE, w.rlo, w.rhi, w.s, m + hh * M, l + hh * M, ach, Dvp,
                   w.ks ? w.ks + hh * TILE : nullptr, w.vs ? w.vs + hh * TILE : nullptr, tiles.list, vis_lo, vis_hi);
      accumulate_pv(ach, w.s, w.vrow + hh * TILE, M, Dvp, TILE, vis_lo, vis_hi, use_dot);
    }
  }
  write_unit_partials(w.acc, NH * M, Dvp, Dv, acc_out);
}

// Each sequence's key range [start, end): the union of its rows' intervals (rows that see nothing
// left out; empty: 0, 0). Every unit of the sequence walks inside it, tile and prefetch included,
// so these are the keys (and, paged, the block-table entries) the workers may read.
struct Ranges {
  std::vector<int64_t> start, end;
};

//
// With a selection these are list entries: the union of the sequence's lists' [klo, khi).
Ranges key_ranges(const Args& a) {
  Ranges r;
  r.start.assign(a.B, 0);
  r.end.assign(a.B, 0);
  for (int64_t b = 0; b < a.B; ++b) {
    int64_t s = std::numeric_limits<int64_t>::max(), e = 0;
    for (int64_t i = 0; i < (a.keys != nullptr ? a.Hs : a.Sq); ++i) {
      const int64_t lo = std::max<int64_t>(0, a.keys != nullptr ? a.klo[b * a.Hs + i] : row_lo(a, b, i));
      const int64_t hi = a.keys != nullptr ? a.khi[b * a.Hs + i] : row_hi(a, b, i);
      if (lo < hi) {
        s = std::min(s, lo);
        e = std::max(e, hi);
      }
    }
    if (e > s) {
      r.start[b] = s;
      r.end[b] = e;
    }
  }
  return r;
}

// Keys (of one head) the planner may split at most: key counts times heads and pieces stay far
// from int64 overflow.
constexpr int64_t kMaxKeys = int64_t{1} << 52;

// On the calling thread, before any worker runs: every read the workers will make is inside the
// tensors, whatever the thread count, tile size or ISA. Bad arguments raise ValueError naming
// them; nothing is read before this returns.
void check_reads(const Args& a, const Ranges& r, const c10::optional<at::Tensor>& bias, int64_t list_len) {
  if (a.keys != nullptr) {
    // Every entry a row reads: inside its list, a key of the sequence (dense: < Sk; paged: in a
    // block the table holds, whose id is in the pool). Entries ascend, so one pass per list.
    for (int64_t b = 0; b < a.B; ++b) {
      const int64_t kb = b / a.seq_div;
      for (int64_t s = 0; s < a.Hs; ++s) {
        const int64_t lo = a.klo[b * a.Hs + s], hi = a.khi[b * a.Hs + s];
        if (lo >= hi) continue;
        TORCH_CHECK_VALUE(lo >= 0 && hi <= list_len, "attnkit split-K: selection entries [", lo, ", ", hi,
                          ") of sequence ", b, " are outside its list of ", list_len);
        const int32_t* list = a.keys + b * a.key_s0 + s * a.key_s1;
        int64_t last_slot = -1;
        for (int64_t t = lo; t < hi; ++t) {
          const int64_t pos = list[t];
          TORCH_CHECK_VALUE(pos >= 0 && (t == lo || pos > list[t - 1]), "attnkit split-K: selection of sequence ", b,
                            " is not ascending distinct key positions at entry ", t, " (", pos, ")");
          if (!a.paged) {
            TORCH_CHECK_VALUE(pos < a.Sk, "attnkit split-K: selection of sequence ", b, " reads key ", pos,
                              " but k holds Sk=", a.Sk);
            continue;
          }
          const int64_t slot = pos / a.block_size;
          if (slot == last_slot) continue;
          last_slot = slot;
          TORCH_CHECK_VALUE(slot < a.block_table_w, "attnkit paged attention: selection of sequence ", b,
                            " reads key ", pos, " but its block_table row holds ", a.block_table_w, " blocks of ",
                            a.block_size, " tokens");
          const int64_t id = a.block_table[kb * a.block_table_s0 + slot];
          TORCH_CHECK_VALUE(id >= 0 && id < a.num_blocks, "attnkit paged attention: block_table entry ", id,
                            " (sequence ", kb, ", block ", slot, ") is outside the pool of ", a.num_blocks,
                            " blocks");
        }
      }
    }
    return;
  }
  int64_t reach = 0;  // the furthest key any row reads, + 1
  for (int64_t b = 0; b < a.B; ++b) {
    if (r.end[b] == 0) continue;
    reach = std::max(reach, r.end[b]);
    if (!a.paged) {
      TORCH_CHECK_VALUE(r.end[b] <= a.Sk, "attnkit split-K: rows of sequence ", b, " read keys up to ", r.end[b],
                        " but k holds Sk=", a.Sk);
      continue;
    }
    const int64_t last = (r.end[b] - 1) / a.block_size;  // the last block the rows reach
    TORCH_CHECK_VALUE(last < a.block_table_w, "attnkit paged attention: rows of sequence ", b, " read keys up to ", r.end[b],
                      " but its block_table row holds ", a.block_table_w, " blocks of ", a.block_size, " tokens");
    TORCH_CHECK_VALUE(r.end[b] - r.start[b] <= kMaxKeys, "attnkit paged attention: sequence ", b,
                      " has rows reading keys [", r.start[b], ", ", r.end[b], "): more than 2^52 keys");
    for (int64_t slot = r.start[b] / a.block_size; slot <= last; ++slot) {
      const int64_t id = a.block_table[b * a.block_table_s0 + slot];
      TORCH_CHECK_VALUE(id >= 0 && id < a.num_blocks, "attnkit paged attention: block_table entry ", id,
                        " (sequence ", b, ", block ", slot, ") is outside the pool of ", a.num_blocks,
                        " blocks");
    }
  }
  if (bias.has_value()) {
    const at::Tensor& t = *bias;
    TORCH_CHECK_VALUE(t.size(0) == a.B && t.size(1) == a.Hq && t.size(2) == a.Sq && t.size(3) >= reach,
                      "attnkit split-K: bias ", t.sizes(), " must be (B, Hq, Sq, >= ", reach, ") = (", a.B, ", ",
                      a.Hq, ", ", a.Sq, ", ", reach, ")");
  }
}

// Splits each sequence's key range into slices of about equal length, enough of them that
// torch's threads (static partition of the unit list) get balanced work. The partial results of
// (b, kv head) are in slots ``first[p] + i * stride[p]`` for i < count[p]. The unit count is
// about 4 per thread, plus at most one per thread and one per (sequence, unit of heads), whatever
// the key counts (so memory for the plan and the partials never follows the lengths).
//
// Dense caches (B, Hkv, Sk, D) hold each head's rows contiguously: a unit is one head of a slice.
// Paged pools interleave the KV heads of a token (N, bs, Hkv, D): a unit is every head of a slice,
// so the walk reads each block's rows front to back, once, as a dense unit reads its head's rows.
//
// A selection with a list per KV head (Hs > 1) makes a unit one head in either layout: the heads
// of a paged slice would walk different keys.
inline int64_t unit_heads(const Args& a) { return a.paged && (a.keys == nullptr || a.Hs == 1) ? a.Hkv : 1; }

struct Plan {
  std::vector<Unit> units;
  std::vector<int64_t> first, stride, count;
  int64_t slots = 0;
};

Plan plan_units(const Args& a, const Ranges& rg) {
  const int64_t threads = std::max(1, at::get_num_threads());
  const std::vector<int64_t>&start = rg.start, &end = rg.end;
  // key rows of all heads (check_reads bounds each sequence's keys by Sk or kMaxKeys; summed in 128 bits)
  __int128 total = 0;
  for (int64_t b = 0; b < a.B; ++b) total += static_cast<__int128>(end[b] - start[b]) * a.Hkv;
  const int64_t nh = unit_heads(a);  // heads per unit
  const bool grouped = nh > 1;
  // keys (of one head) per unit: ~4 units per thread, at least 256 key rows of work
  const __int128 share = (total + 4 * threads - 1) / (4 * threads);
  const int64_t per_unit = static_cast<int64_t>(std::clamp<__int128>(std::max<__int128>(256, share) / nh, 1, kMaxKeys));
  std::vector<int64_t> npieces(a.B);
  int64_t units = 0;
  for (int64_t b = 0; b < a.B; ++b) {
    npieces[b] = std::max<int64_t>(1, (end[b] - start[b] + per_unit - 1) / per_unit);
    units += npieces[b] * (a.Hkv / nh);
  }
  // torch's threads take equal runs of the unit list: a count that does not divide leaves one
  // thread a unit more (4097 keys over 9 units on 2 threads: 5 against 4). Split the sequence with
  // the longest pieces once more until the count divides (at most ``threads`` rounds).
  for (int64_t round = 0; round < threads && units % threads != 0; ++round) {
    int64_t b = 0;
    for (int64_t c = 1; c < a.B; ++c)
      if (static_cast<__int128>(end[c] - start[c]) * npieces[b] > static_cast<__int128>(end[b] - start[b]) * npieces[c])
        b = c;
    npieces[b] += 1;
    units += a.Hkv / nh;
  }
  Plan plan;
  const int64_t P = a.B * a.Hkv;
  plan.first.assign(P, 0);
  plan.stride.assign(P, 1);
  plan.count.assign(P, 0);
  plan.units.reserve(units);
  for (int64_t b = 0; b < a.B; ++b) {
    const int64_t len = end[b] - start[b];
    const int64_t pieces = npieces[b];
    const int64_t base = plan.slots;  // slots of b: (head, piece), or (piece, head) for units of all heads
    for (int64_t h = 0; h < a.Hkv; ++h) {
      plan.first[b * a.Hkv + h] = grouped ? base + h : base + h * pieces;
      plan.stride[b * a.Hkv + h] = grouped ? a.Hkv : 1;
      plan.count[b * a.Hkv + h] = pieces;
    }
    for (int64_t h = 0; h < a.Hkv; h += nh)
      for (int64_t p = 0; p < pieces; ++p) {
        const int64_t slot = grouped ? base + p * a.Hkv : base + h * pieces + p;
        const int64_t s0 = start[b] + static_cast<int64_t>(static_cast<__int128>(len) * p / pieces);
        const int64_t s1 = start[b] + static_cast<int64_t>(static_cast<__int128>(len) * (p + 1) / pieces);
        plan.units.push_back({b, h, nh, s0, s1, slot});
      }
    plan.slots += pieces * a.Hkv;
  }
  return plan;
}

// The merged row ``o`` (Dv fp32) into the output row of q's dtype.
inline void store_row(const float* o, void* out, at::ScalarType type, int64_t row, int64_t Dv) {
  switch (type) {
    case at::kBFloat16: {
      c10::BFloat16* dst = static_cast<c10::BFloat16*>(out) + row * Dv;
      for (int64_t d = 0; d < Dv; ++d) dst[d] = c10::BFloat16(o[d]);
      break;
    }
    case at::kHalf: {
      c10::Half* dst = static_cast<c10::Half*>(out) + row * Dv;
      for (int64_t d = 0; d < Dv; ++d) dst[d] = c10::Half(o[d]);
      break;
    }
    default: std::copy(o, o + Dv, static_cast<float*>(out) + row * Dv);
  }
}

template <typename T>
void run_all(Args a, const Ranges& ranges, at::Tensor& out, float* lse, const float* sinks, bool sink_per_row) {
  const int64_t M = a.G * a.Sq, Dv = a.Dv;
  const Plan plan = plan_units(a, ranges);
  const std::vector<Unit>& units = plan.units;
  const int64_t U = static_cast<int64_t>(units.size());
  std::vector<float> pm(plan.slots * M), pl(plan.slots * M), pacc(plan.slots * M * Dv);
  // Rows are read in place when whole vectors cover them (and the type widens in registers).
  const bool in_place = a.D % VL == 0 && a.Dv % VL == 0 && (!std::is_same<T, c10::Half>::value || kHalfInRegisters);
  const int64_t nh = unit_heads(a);
  a.tile = tile_keys(std::max(round_up(a.D, VL), round_up(a.Dv, VL)), nh, in_place ? sizeof(T) : sizeof(float));
  std::atomic<int> failed{0};
  a.failed = &failed;
  at::parallel_for(0, U, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t x = units[u].slot;
      if (in_place)
        run_unit<T, true>(a, units[u], &pm[x * M], &pl[x * M], &pacc[x * M * Dv]);
      else
        run_unit<T, false>(a, units[u], &pm[x * M], &pl[x * M], &pacc[x * M * Dv]);
    }
  });
  // Raised here, on the calling thread, after every worker has finished.
  TORCH_CHECK(failed.load() != kBadBlock, "attnkit paged attention: a worker met a block id that check_reads had "
              "accepted (the block table changed during the call?)");
  if (failed.load() == kNoMemory) throw std::bad_alloc();
  // Merge the slices of each (b, kv head): exact log-sum-exp rule; sinks join the denominator.
  void* const out_ptr = out.data_ptr();
  const at::ScalarType out_type = out.scalar_type();
  at::parallel_for(0, a.B * a.Hkv, 1, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> orow;
    float* const o = grown(orow, Dv);
    if (o == nullptr) {
      failed.store(kNoMemory, std::memory_order_relaxed);
      return;
    }
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / a.Hkv, h = p % a.Hkv, u0 = plan.first[p], us = plan.stride[p];
      const int64_t u1 = u0 + plan.count[p] * us;
      for (int64_t r = 0; r < M; ++r) {
        const int64_t g = r / a.Sq, i = r % a.Sq, hq = h * a.G + g;
        float mx = kNegInf;
        for (int64_t u = u0; u < u1; u += us) mx = nan_max(pm[u * M + r], mx);
        const int64_t row = (b * a.Hq + hq) * a.Sq + i;
        std::fill(o, o + Dv, 0.0f);
        float den = 0.0f;
        if (mx != kNegInf) {
          for (int64_t u = u0; u < u1; u += us) {
            const float w = exp_f32(pm[u * M + r] - mx);  // a slice with nothing visible: 0
            den += w * pl[u * M + r];
            const float* ar = &pacc[(u * M + r) * Dv];
#pragma omp simd
            for (int64_t d = 0; d < Dv; ++d) o[d] += w * ar[d];
          }
        }
        const float den_keys = den;  // the lse is over the keys alone (a ring merges it; sinks join once)
        if (sinks != nullptr && mx != kNegInf) den += exp_f32(sinks[sink_per_row ? row : hq] - mx);
        // den is >= 1 for a row with any visible key (its largest score gives exp(0)); 0 for an
        // empty row, whose output stays exactly 0; NaN propagates.
        if (den != 0.0f) {
          const float inv = 1.0f / den;
#pragma omp simd
          for (int64_t d = 0; d < Dv; ++d) o[d] *= inv;
        }
        store_row(o, out_ptr, out_type, row, Dv);
        if (lse != nullptr) lse[(b * a.Hq + hq) * a.Sq + i] = den_keys != 0.0f ? mx + std::log(den_keys) : kNegInf;
      }
    }
  });
  if (failed.load() == kNoMemory) throw std::bad_alloc();
}

// q (B, Hq, Sq, D) contiguous fp32 / bf16 / fp16 (multiplied by ``scale`` here); k / v: dense
// (B, Hkv, Sk, D) or paged pools (N, bs, Hkv, D) (v undefined: V = K[..., :Dv]); lo / hi (B, Sq)
// int64, each optional (lo: 0; hi: all Sk keys of a dense cache; paged pools need hi); bias fp32
// broadcastable (B, Hq, Sq, Sk) (expanded strides); slopes (Hq,) fp32; sinks fp32, (Hq,) one per
// query head or (B, Hq, Sq) one per query row; qpos (B, Sq) int64
// (optional for a dense cache: bottom-right positions). A selection (Sq 1): sel_ids (1 or
// B / seq_div, Hs, seq_div, n) int64 as given (Hs divides Hkv; query i of K/V sequence kb is q
// sequence kb * seq_div + i), sel_block its block size, sel_lo / sel_hi (B,) the interval R that
// cuts it, union_lo / union_hi (B,) an interval W joined to it (optional); lo / hi / bias absent.
// seq_div: q sequence b reads K/V sequence b / seq_div (dense k (B / seq_div, ...), block_table
// rows B / seq_div).
// Returns out (B, Hq, Sq, Dv) in q's dtype and lse (B, Hq, Sq) fp32 (empty unless return_lse).
// Everything a decode step needs happens in this one op: no scaled copy of q, no default bounds,
// no output cast (each a dispatch of its own, on every layer of every step).
std::tuple<at::Tensor, at::Tensor> splitk_attention(
    const at::Tensor& q, const at::Tensor& k, const c10::optional<at::Tensor>& v,
    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale, int64_t v_head_dim,
    const c10::optional<at::Tensor>& block_table, const c10::optional<at::Tensor>& lo,
    const c10::optional<at::Tensor>& hi, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& slopes, const c10::optional<at::Tensor>& qpos,
    const c10::optional<at::Tensor>& sinks, double scale, double softcap, int64_t num_kv_heads, bool return_lse,
    const c10::optional<at::Tensor>& sel_ids, int64_t sel_block, const c10::optional<at::Tensor>& sel_lo,
    const c10::optional<at::Tensor>& sel_hi, const c10::optional<at::Tensor>& union_lo,
    const c10::optional<at::Tensor>& union_hi, int64_t seq_div) {
  const at::ScalarType qt = q.scalar_type();
  TORCH_CHECK(q.dim() == 4 && (qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf) && q.is_contiguous() &&
                  q.device().is_cpu(),
              "q must be a contiguous fp32 / bf16 / fp16 CPU tensor (B, Hq, Sq, D)");
  // A last dim of size 1 has no meaningful stride (torch calls such tensors contiguous whatever it is).
  const auto rows_ok = [](const at::Tensor& t) { return t.dim() == 4 && (t.stride(3) == 1 || t.size(3) <= 1); };
  TORCH_CHECK(rows_ok(k) && k.device().is_cpu(), "k must be a 4-D CPU tensor with unit stride in its last dim, got ",
              k.sizes(), " strides ", k.strides());
  const bool paged = block_table.has_value();
  Args a{};
  a.B = q.size(0);
  a.Hq = q.size(1);
  a.Sq = q.size(2);
  a.D = q.size(3);
  a.Hkv = num_kv_heads;
  TORCH_CHECK(a.Hkv > 0 && a.Hq % a.Hkv == 0, "query heads must be a multiple of KV heads");
  a.G = a.Hq / a.Hkv;
  TORCH_CHECK_VALUE(seq_div >= 1 && a.B % seq_div == 0, "seq_div must be >= 1 and divide B=", a.B, ", got ", seq_div);
  a.seq_div = seq_div;
  const int64_t kv_batch = a.B / seq_div;
  a.Dv = v_head_dim;
  TORCH_CHECK(a.Dv >= 0, "v_head_dim must be >= 0, got ", a.Dv);
  TORCH_CHECK(k.size(3) == a.D, "k's last dim must equal q's: k ", k.sizes(), ", q ", q.sizes());
  a.q = q.data_ptr();
  a.q_type = qt;
  a.scale = static_cast<float>(scale);
  a.Sk = paged ? 0 : k.size(2);
  a.k = k.data_ptr();
  a.ks0 = k.stride(0);
  a.ks1 = k.stride(1);
  a.ks2 = k.stride(2);
  a.paged = paged;
  if (paged) {
    // pools (N, bs, Hkv, D): row of (block, slot, h)
    TORCH_CHECK(k.size(2) == a.Hkv, "k_pool ", k.sizes(), " must be (N, bs, Hkv=", a.Hkv, ", D)");
    TORCH_CHECK_VALUE(k.size(1) > 0, "attnkit paged attention: the pools' block size must be >= 1, got k_pool ",
                      k.sizes());
    const at::Tensor& t = *block_table;
    TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 2 && t.size(0) == kv_batch && t.stride(1) == 1 &&
                    t.device().is_cpu(),
                "block_table must be a (B=", kv_batch, ", W) int64 CPU tensor with unit stride, got ", t.sizes());
    a.block_table = t.data_ptr<int64_t>();
    a.block_table_s0 = t.stride(0);
    a.block_table_w = t.size(1);
    a.block_size = k.size(1);
    a.num_blocks = k.size(0);
  } else {
    TORCH_CHECK(k.size(0) == kv_batch && k.size(1) == a.Hkv, "k ", k.sizes(), " must be (B=", kv_batch, ", Hkv=",
                a.Hkv, ", Sk, D)");
  }
  if (v.has_value()) {
    TORCH_CHECK(rows_ok(*v) && v->device().is_cpu() && v->scalar_type() == k.scalar_type() &&
                    v->sizes().slice(0, 3) == k.sizes().slice(0, 3),
                "v must match k: k ", k.sizes(), ", v ", v->sizes());
    TORCH_CHECK(v->size(3) == a.Dv, "v's last dim must equal v_head_dim");
    a.v = v->data_ptr();
    a.vs0 = v->stride(0);
    a.vs1 = v->stride(1);
    a.vs2 = v->stride(2);
  } else {
    TORCH_CHECK(a.Dv <= a.D, "v_head_dim must be <= D when V is read from K");
    a.v = nullptr;
  }
  const bool quantized = k.scalar_type() == at::kChar || k.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(quantized == k_scale.has_value(), quantized ? "quantized k (int8 / fp8) needs k_scale"
                                                          : "k_scale is for quantized (int8 / fp8) k only");
  TORCH_CHECK(!v_scale.has_value() || (quantized && v.has_value()), "v_scale needs quantized v");
  TORCH_CHECK(!quantized || v_scale.has_value() == v.has_value(), "quantized v needs v_scale");
  a.ksc = a.vsc = nullptr;
  const auto scales_ok = [](const at::Tensor& s, const at::Tensor& rows) {
    return s.scalar_type() == at::kFloat && s.dim() == 3 && s.device().is_cpu() &&
           s.sizes() == rows.sizes().slice(0, 3);
  };
  if (k_scale.has_value()) {
    TORCH_CHECK_VALUE(scales_ok(*k_scale, k), "k_scale must be fp32 of shape k.shape[:3] = ", k.sizes().slice(0, 3),
                      ", got ", k_scale->sizes());
    a.ksc = k_scale->data_ptr<float>();
    a.kss0 = k_scale->stride(0);
    a.kss1 = k_scale->stride(1);
    a.kss2 = k_scale->stride(2);
  }
  if (v_scale.has_value()) {
    TORCH_CHECK_VALUE(scales_ok(*v_scale, *v), "v_scale must be fp32 of shape v.shape[:3] = ", v->sizes().slice(0, 3),
                      ", got ", v_scale->sizes());
    a.vsc = v_scale->data_ptr<float>();
    a.vss0 = v_scale->stride(0);
    a.vss1 = v_scale->stride(1);
    a.vss2 = v_scale->stride(2);
  }
  TORCH_CHECK(hi.has_value() || !paged || sel_ids.has_value(), "paged pools need hi (the sequences' lengths)");
  const auto index_ok = [&](const at::Tensor& t) {
    return t.scalar_type() == at::kLong && t.is_contiguous() && t.numel() == a.B * a.Sq && t.device().is_cpu();
  };
  a.lo = a.hi = nullptr;
  if (lo.has_value()) {
    TORCH_CHECK(index_ok(*lo), "lo must be (B, Sq) int64");
    a.lo = lo->data_ptr<int64_t>();
  }
  if (hi.has_value()) {
    TORCH_CHECK(index_ok(*hi), "hi must be (B, Sq) int64");
    a.hi = hi->data_ptr<int64_t>();
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 4 && bias->device().is_cpu(),
                "bias must be a 4-D fp32 CPU tensor");
    a.bias = bias->data_ptr<float>();
    a.bs0 = bias->stride(0);
    a.bs1 = bias->stride(1);
    a.bs2 = bias->stride(2);
    a.bs3 = bias->stride(3);
  }
  if (slopes.has_value()) {
    TORCH_CHECK(qpos.has_value() || !paged, "ALiBi over paged pools needs qpos");
    TORCH_CHECK(slopes->scalar_type() == at::kFloat && slopes->is_contiguous() && slopes->numel() == a.Hq &&
                    slopes->device().is_cpu(),
                "slopes must be (Hq,) fp32");
    TORCH_CHECK(!qpos.has_value() || index_ok(*qpos), "qpos must be (B, Sq) int64");
    a.slopes = slopes->data_ptr<float>();
    a.qpos = qpos.has_value() ? qpos->data_ptr<int64_t>() : nullptr;
  }
  const float* sink_ptr = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    (sinks->numel() == a.Hq || sinks->numel() == a.B * a.Hq * a.Sq) && sinks->device().is_cpu(),
                "sinks must be fp32, (Hq,) or (B, Hq, Sq) contiguous");
    sink_ptr = sinks->data_ptr<float>();
  }
  const bool sink_per_row = sink_ptr != nullptr && sinks->numel() != a.Hq;
  a.softcap = static_cast<float>(softcap);
  a.keys = nullptr;
  a.Hs = 1;
  int64_t list_len = 0;
  std::vector<int32_t> lists;
  std::vector<int64_t> list_lo, list_hi;
  if (sel_ids.has_value()) {
    const at::Tensor& t = *sel_ids;
    TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 4 && (t.size(0) == 1 || t.size(0) == kv_batch) &&
                    t.size(2) == seq_div && t.size(1) >= 1 && a.Hkv % t.size(1) == 0 && t.device().is_cpu(),
                "sel_ids must be a (1 or B=", kv_batch, ", Hs dividing Hkv=", a.Hkv, ", seq_div=", seq_div,
                ", n) int64 CPU tensor, got ", t.sizes());
    TORCH_CHECK(a.Sq == 1, "a selection takes one query per q sequence (seq_div queries of a K/V sequence)");
    TORCH_CHECK_VALUE(sel_block >= 1, "sel_block must be >= 1, got ", sel_block);
    TORCH_CHECK(!lo.has_value() && !hi.has_value() && !bias.has_value(),
                "a selection's rows see its keys: lo, hi and bias must be absent");
    const auto bounds_ok = [&](const c10::optional<at::Tensor>& b) {
      return b->scalar_type() == at::kLong && b->is_contiguous() && b->numel() == a.B && b->device().is_cpu();
    };
    TORCH_CHECK(sel_lo.has_value() && sel_hi.has_value() && bounds_ok(sel_lo) && bounds_ok(sel_hi),
                "sel_lo and sel_hi must be (B,) int64 contiguous");
    TORCH_CHECK(union_lo.has_value() == union_hi.has_value() &&
                    (!union_lo.has_value() || (bounds_ok(union_lo) && bounds_ok(union_hi))),
                "union_lo and union_hi must both be (B,) int64 contiguous, or both absent");
    Selection sel{t.data_ptr<int64_t>(), t.stride(0), t.stride(1), t.stride(2), t.stride(3), t.size(0), t.size(3),
                  sel_block, sel_lo->data_ptr<int64_t>(), sel_hi->data_ptr<int64_t>(),
                  union_lo.has_value() ? union_lo->data_ptr<int64_t>() : nullptr,
                  union_hi.has_value() ? union_hi->data_ptr<int64_t>() : nullptr};
    // The keys K/V holds: a dense Sk; a paged sequence, its table's blocks (R, with the paged
    // lengths folded in, cuts them further; check_reads checks the blocks the lists reach).
    const int64_t cap = paged ? a.block_table_w * a.block_size : a.Sk;
    int64_t widest = 0;  // the longest W inside R
    if (sel.ulo != nullptr)
      for (int64_t b = 0; b < a.B; ++b)
        widest = std::max(widest, std::min({sel.uhi[b], sel.hi[b], cap}) - std::max({sel.ulo[b], sel.lo[b], int64_t{0}}));
    const __int128 longest = static_cast<__int128>(sel.n) * sel_block + widest;
    list_len = static_cast<int64_t>(std::min<__int128>(longest, cap));
    a.Hs = t.size(1);
    lists.resize(std::max<int64_t>(1, a.B * a.Hs * list_len));
    list_lo.assign(a.B * a.Hs, 0);
    list_hi.resize(a.B * a.Hs);
    if (!build_lists(sel, a.B, a.Hs, seq_div, cap, list_len, lists.data(), list_hi.data())) throw std::bad_alloc();
    a.keys = lists.data();
    a.key_s0 = a.Hs * list_len;
    a.key_s1 = list_len;
    a.klo = list_lo.data();
    a.khi = list_hi.data();
  }
  const Ranges ranges = key_ranges(a);
  check_reads(a, ranges, bias, list_len);
  at::Tensor out = at::empty({a.B, a.Hq, a.Sq, a.Dv}, q.options());
  at::Tensor lse = at::empty({return_lse ? a.B : 0, a.Hq, a.Sq}, q.options().dtype(at::kFloat));
  float* lse_ptr = return_lse ? lse.data_ptr<float>() : nullptr;
  switch (k.scalar_type()) {
    case at::kFloat: run_all<float>(a, ranges, out, lse_ptr, sink_ptr, sink_per_row); break;
    case at::kBFloat16: run_all<c10::BFloat16>(a, ranges, out, lse_ptr, sink_ptr, sink_per_row); break;
    case at::kHalf: run_all<c10::Half>(a, ranges, out, lse_ptr, sink_ptr, sink_per_row); break;
    case at::kChar: run_all<int8_t>(a, ranges, out, lse_ptr, sink_ptr, sink_per_row); break;
    case at::kFloat8_e4m3fn: run_all<c10::Float8_e4m3fn>(a, ranges, out, lse_ptr, sink_ptr, sink_per_row); break;
    default: TORCH_CHECK(false, "k must be fp32, bf16, fp16, int8 or fp8 e4m3, got ", k.scalar_type());
  }
  return {out, lse};
}

// The outputs' shapes and dtypes only (the Meta kernel): what torch.compile's fake tensors see
// when a traced decode step calls the op (the CPU kernel runs when the graph does).
std::tuple<at::Tensor, at::Tensor> splitk_attention_meta(
    const at::Tensor& q, const at::Tensor&, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
    const c10::optional<at::Tensor>&, int64_t v_head_dim, const c10::optional<at::Tensor>&,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, double,
    double, int64_t, bool return_lse, const c10::optional<at::Tensor>&, int64_t, const c10::optional<at::Tensor>&,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(q.dim() == 4, "q must be (B, Hq, Sq, D), got ", q.sizes());
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v_head_dim}, q.options());
  at::Tensor lse = at::empty({return_lse ? q.size(0) : 0, q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  return {out, lse};
}

}  // namespace

// No argument has a default, so every call names them all. Inductor caches a compiled graph by its
// code, which names the op and the arguments a call passed but not the op's schema: a graph cached
// before a schema change would call the new op with the old arguments from its C++ wrapper
// (cpp_wrapper), and the dispatcher would read past them. A schema change must change what a call
// passes (here, the number of arguments) or the op's name; tests/test_compile_safety.py pins the
// schema so the change is made on purpose.
TORCH_LIBRARY(attnkit_cpu, m) {
  m.def(
      "splitk_attention(Tensor q, Tensor k, Tensor? v, Tensor? k_scale, Tensor? v_scale, int v_head_dim, Tensor? block_table, Tensor? lo, "
      "Tensor? hi, Tensor? bias, Tensor? slopes, Tensor? qpos, Tensor? sinks, float scale, float softcap, "
      "int num_kv_heads, bool return_lse, Tensor? sel_ids, int sel_block, Tensor? sel_lo, Tensor? sel_hi, "
      "Tensor? union_lo, Tensor? union_hi, int seq_div) -> (Tensor, Tensor)");
  m.impl("splitk_attention", c10::DispatchKey::CPU, TORCH_FN(splitk_attention));
  m.impl("splitk_attention", c10::DispatchKey::Meta, TORCH_FN(splitk_attention_meta));
}
