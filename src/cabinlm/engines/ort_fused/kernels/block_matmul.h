// What the block matmuls (block_q4_matmul.cc, block_q8_matmul.cc) share: their operands (x, the
// weight tiles, y), the rows of x as they read them (each row quantized per block of 32 to int8 codes
// c with the block's scale s = a / 127, a its largest magnitude, rounded half to even: llama.cpp's
// Q8_1 activations; one fixed sequence for every row, so a row's codes are a function of that row
// alone), and the walk over a tile's rows.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ort_api.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(CABINLM_GENERIC)
#include <immintrin.h>
#define CABINLM_ROW_QUANT_AVX512 1
#endif

namespace cabinlm_blocks {

constexpr int kBlock = 32;  // values per block along K

// Row r of x (K floats) -> its codes, scales and scaled code sums (and, where `sums` is given, the
// integer code sums); the same sequence for every row.
// (It runs before the parallel_for, on one thread: AVX-512 does a block in a few instructions, with
// the plain loop's results: the largest magnitude is exact in any order, x * inv is the same float
// product, rounding half to even is the default rounding mode's, the code sum an integer.)
#if CABINLM_ROW_QUANT_AVX512
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
// tile_bytes), y (..., N) allocated here; M the rows of x. A shape that is not that is the
// operator's error (`where` names it, `k_text` x's last dimension: "K", "2 K").
struct Operands {
  const float* x = nullptr;
  const uint8_t* w = nullptr;
  float* y = nullptr;
  int64_t M = 1, K = 0, N = 0, nb = 0, tiles = 0;
};

inline OrtStatus* operands(OrtKernelContext* ctx, const std::string& where, int64_t width, int64_t tile_bytes,
                           const char* k_text, Operands* o) {
  using namespace cabinlm_ort;
  const OrtValue *xv = nullptr, *wv = nullptr;
  std::vector<int64_t> dx, dw;
  CABIN_TRY(input(ctx, 0, &xv));
  CABIN_TRY(input(ctx, 1, &wv));
  CABIN_TRY(dims_of(xv, &dx));
  CABIN_TRY(dims_of(wv, &dw));
  if (dx.empty() || dw.size() != 3 || dw[2] != tile_bytes || dx.back() != width * dw[1] * kBlock)
    return error(kInvalidArgument, where + "x " + shape_str(dx) + " and weights " + shape_str(dw) + " are not (..., " +
                                       k_text + ") and (N / 16, K / 32, " + std::to_string(tile_bytes) + ")");
  o->K = dx.back() / width;
  o->nb = dw[1];
  o->tiles = dw[0];
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
// own prefetchers, which learn each tile anew (docs/benchmarks.md section 20, stop 49). Hints only:
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
