// What the block matmuls (block_q4_matmul.cc, block_q8_matmul.cc) share: which instructions a library
// runs them with (one path per library, chosen by the compiler's -march), their operands (x, the
// weight tiles, y), the rows of x as they read them (each row quantized per block of 32 to int8 codes
// c with the block's scale s = a / 127, a its largest magnitude, rounded half to even: llama.cpp's
// Q8_1 activations; one fixed sequence for every row, so a row's codes are a function of that row
// alone), and the walk over a tile's rows.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "ort_api.h"

// The block matmuls' path, from the compiler's predefined macros (CABINLM_GENERIC: the plain C++ one
// whatever the CPU). Every path computes the same exact integer dot products and adds the same float
// terms in the same order, so every path's results are the plain C++ path's, bit for bit.
//   CABINLM_BLOCKS_AVX512_VNNI  x86 with AVX-512 VNNI: vpdpbusd on 64 bytes
//   CABINLM_BLOCKS_AVX2         x86 with AVX2, FMA and F16C (x86-64-v3: every x86-64 CPU since 2013-2015):
//                               vpmaddubsw + vpmaddwd on 32 bytes, or, where the CPU has AVX-VNNI
//                               (CABINLM_BLOCKS_AVX_VNNI: Alder Lake and later, Zen 5), the
//                               VEX-encoded vpdpbusd on 32 bytes
//   CABINLM_BLOCKS_NEON_DOT     Armv8.2-A and later with the dot product (and CABINLM_BLOCKS_NEON_I8MM
//                               where the CPU has the int8 matrix multiply too)
//   none of them                plain C++ (correct anywhere, not fast)
// CABINLM_BLOCKS_ISA names the path, as cabinlm_block_q4_isa() reports it and the manifest records it
// (kernels/__init__.py: ISAS).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(CABINLM_GENERIC)
#define CABINLM_BLOCKS_AVX512_VNNI 1
#define CABINLM_BLOCKS_ISA "avx512-vnni"
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(CABINLM_GENERIC)
#define CABINLM_BLOCKS_AVX2 1
#if defined(__AVXVNNI__) || defined(CABINLM_AVX_VNNI_AS_AVX512VL)
#define CABINLM_BLOCKS_AVX_VNNI 1
#define CABINLM_BLOCKS_ISA "avx-vnni"
#else
#define CABINLM_BLOCKS_ISA "avx2"
#endif
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD) && !defined(CABINLM_GENERIC)
#define CABINLM_BLOCKS_NEON_DOT 1
#if defined(__ARM_FEATURE_MATMUL_INT8) && !defined(CABINLM_NO_I8MM)
#define CABINLM_BLOCKS_NEON_I8MM 1
#define CABINLM_BLOCKS_ISA "neon-i8mm"
#else
#define CABINLM_BLOCKS_ISA "neon-dotprod"
#endif
#include <arm_neon.h>
#else
#define CABINLM_BLOCKS_ISA "generic"
#endif

namespace cabinlm_blocks {

constexpr int kBlock = 32;  // values per block along K

#if CABINLM_BLOCKS_AVX_VNNI
// vpdpbusd on 32 bytes: acc's 32-bit lanes plus the sums of four unsigned bytes of u times the four
// signed bytes of s beside them (exact: at most 4 x 255 x 128 in magnitude).
#if defined(__AVXVNNI__)
__attribute__((always_inline)) inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(acc, u, s);  // the VEX encoding (AVX-VNNI)
}
#else
// CABINLM_AVX_VNNI_AS_AVX512VL, for tests only: the AVX-VNNI path on a CPU without AVX-VNNI that has
// AVX-512 VL and VNNI, whose EVEX vpdpbusd on 32 bytes is the same operation (a call each: slow).
__attribute__((target("avx512vl,avx512vnni"), noinline)) inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(acc, u, s);
}
#endif
#endif

// Row r of x (K floats) -> its codes, scales and scaled code sums (and, where `sums` is given, the
// integer code sums); the same sequence for every row.
// (It runs before the parallel_for, on one thread: AVX-512 or AVX2 do a block in a few instructions, with
// the plain loop's results: the largest magnitude is exact in any order, x * inv is the same float
// product, rounding half to even is the default rounding mode's, the code sum an integer.)
#if CABINLM_BLOCKS_AVX512_VNNI
inline void quantize_row(const float* x, int64_t nb, int8_t* q, float* d, float* s, int32_t* sums = nullptr) {
  for (int64_t b = 0; b < nb; ++b, x += kBlock, q += kBlock) {
    const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(lo, vinv), kNearest));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(hi, vinv), kNearest));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qhi));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    d[b] = amax / 127.0f;
    s[b] = d[b] * static_cast<float>(sum);
    if (sums) sums[b] = sum;
  }
}
#elif CABINLM_BLOCKS_AVX2
inline void quantize_row(const float* x, int64_t nb, int8_t* q, float* d, float* s, int32_t* sums = nullptr) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  // packs keep the order within each 128-bit lane: a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7 -> a b c d
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < nb; ++b, x += kBlock, q += kBlock) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
    const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i c[4];
    for (int i = 0; i < 4; ++i)
      c[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(packed, order));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    const int32_t sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
    d[b] = amax / 127.0f;
    s[b] = d[b] * static_cast<float>(sum);
    if (sums) sums[b] = sum;
  }
}
#else
inline void quantize_row(const float* x, int64_t nb, int8_t* q, float* d, float* s, int32_t* sums = nullptr) {
  for (int64_t b = 0; b < nb; ++b, x += kBlock, q += kBlock) {
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));  // |q| <= 127
      sum += q[i];
    }
    d[b] = amax / 127.0f;
    s[b] = d[b] * static_cast<float>(sum);
    if (sums) sums[b] = sum;
  }
}
#endif

constexpr int kCols = 16;  // columns per weight tile

// A block matmul's operands: x (..., width K) floats, the weight tiles uint8 (N / 16, K / 32,
// tile_bytes) with tile_bytes one of `layouts` (the kernel's layouts of a tile block), y (..., N)
// allocated here; M the rows of x. A shape that is not that is the operator's error (`where` names
// it, `k_text` x's last dimension: "K", "2 K").
struct Operands {
  const float* x = nullptr;
  const uint8_t* w = nullptr;
  float* y = nullptr;
  int64_t M = 1, K = 0, N = 0, nb = 0, tiles = 0, tile_bytes = 0;
};

inline OrtStatus* operands(OrtKernelContext* ctx, const std::string& where, int64_t width,
                           std::initializer_list<int64_t> layouts, const char* k_text, Operands* o) {
  using namespace cabinlm_ort;
  const OrtValue *xv = nullptr, *wv = nullptr;
  std::vector<int64_t> dx, dw;
  CABIN_TRY(input(ctx, 0, &xv));
  CABIN_TRY(input(ctx, 1, &wv));
  CABIN_TRY(dims_of(xv, &dx));
  CABIN_TRY(dims_of(wv, &dw));
  const bool known = dw.size() == 3 && std::find(layouts.begin(), layouts.end(), dw[2]) != layouts.end();
  if (dx.empty() || !known || dx.back() != width * dw[1] * kBlock) {
    std::string sizes;
    for (const int64_t n : layouts) sizes += (sizes.empty() ? "" : " or ") + std::to_string(n);
    return error(kInvalidArgument, where + "x " + shape_str(dx) + " and weights " + shape_str(dw) + " are not (..., " +
                                       k_text + ") and (N / 16, K / 32, " + sizes + ")");
  }
  o->K = dx.back() / width;
  o->nb = dw[1];
  o->tiles = dw[0];
  o->tile_bytes = dw[2];
  o->N = o->tiles * kCols;
  o->M = 1;
  for (size_t i = 0; i + 1 < dx.size(); ++i) o->M *= dx[i];
  CABIN_TRY(data_of(xv, &o->x));
  CABIN_TRY(data_of(wv, &o->w));
  std::vector<int64_t> dy(dx);
  dy.back() = o->N;
  OrtValue* yv = nullptr;
  CABIN_TRY(output(ctx, 0, dy, &yv));
  return data_of(yv, &o->y);
}

// The weights are asked for ahead of their use. Tile t's blocks lie one after another, tile t + 1's
// right after them, and a parallel_for unit takes kTilesPerUnit neighbouring tiles, so a unit's weights
// are one contiguous run: each block asks for the bytes kAheadBlocks blocks further on (the tile's
// later blocks, then its neighbour's). Without the hints the weights arrive at the pace of the core's
// own prefetchers, which learn each tile anew: with them, decode steps are 8-12% shorter. Hints only:
// they change no arithmetic, and the last tiles' hints, which point past the weights' end, never
// fault (a prefetch of an unmapped address is dropped, on x86 and AArch64 alike). Always inlined,
// because GCC finds a function that only prefetches pure and deletes its calls.
constexpr int64_t kAheadBlocks = 24;
constexpr int64_t kTilesPerUnit = 2;

template <int64_t kBlockBytes>
__attribute__((always_inline)) inline void fetch_ahead(const uint8_t* block) {
  for (int64_t at = 0; at < kBlockBytes; at += 64) __builtin_prefetch(block + kAheadBlocks * kBlockBytes + at, 0, 3);
}

// The parallel_for units of `tiles` weight tiles: kTilesPerUnit neighbours each.
inline size_t tile_units(int64_t tiles) { return static_cast<size_t>((tiles + kTilesPerUnit - 1) / kTilesPerUnit); }

// The last `left` (0 .. R) rows of a tile, from row r, in one group of that many.
template <class Tiles, int R, class Problem>
inline void rest_rows(const Problem& p, int64_t t, int64_t r, int64_t left) {
  if constexpr (R > 0) {
    if (left == R)
      Tiles::template rows<R>(p, t, r);
    else
      rest_rows<Tiles, R - 1>(p, t, r, left);
  }
}

// One parallel_for unit (of tile_units(p.tiles)): its tiles one after another, each tile's every row
// kRowBlock rows at a time, then the rest (1 .. kRowBlock - 1) in one group; Tiles::rows<R>(problem,
// tile, r0) computes rows r0 .. r0 + R - 1 of the tile. A tile's result does not depend on the unit
// it falls in.
template <class Tiles, int kRowBlock, class Problem>
void tile_unit(void* data, size_t unit) {
  const Problem& p = *static_cast<const Problem*>(data);
  const int64_t first = static_cast<int64_t>(unit) * kTilesPerUnit;
  for (int64_t t = first; t < std::min(first + kTilesPerUnit, p.tiles); ++t) {
    int64_t r = 0;
    for (; r + kRowBlock <= p.M; r += kRowBlock) Tiles::template rows<kRowBlock>(p, t, r);
    rest_rows<Tiles, kRowBlock - 1>(p, t, r, p.M - r);
  }
}

}  // namespace cabinlm_blocks
