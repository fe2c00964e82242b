// The rows of x as the block matmuls read them (block_q4_matmul.cc, block_q8_matmul.cc): each row
// quantized per block of 32 to int8 codes c with the block's scale s = a / 127 (a its largest
// magnitude; rounded half to even), llama.cpp's Q8_1 activations. One fixed sequence for every row,
// so a row's codes are a function of that row alone.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(CABINLM_GENERIC)
#include <immintrin.h>
#define CABINLM_ROW_QUANT_AVX512 1
#endif

namespace cabinlm_rows {

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

}  // namespace cabinlm_rows
