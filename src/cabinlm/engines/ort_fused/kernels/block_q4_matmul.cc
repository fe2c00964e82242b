// cabinlm's matmul over GGUF Q4_1 weights: an ONNX Runtime custom operator, ai.cabinlm::BlockQ4MatMul.
//
// It takes the place of com.microsoft::MatMulNBits in the cpu build's fused decoder
// (builders/ort_fused.py) for the layers' Q4_1 matrices: blocks of 32 weights along K, each weight
// d * q + m with a 4-bit code q and the block's float16 scale d and minimum m. Why an own kernel:
// MatMulNBits has no minimum, so the build ran each Q4_1 block as 8-bit codes with an integer zero
// point (twice the bytes a 4-bit block needs) or as 4-bit codes plus two more kernels per matrix for
// the minimum; a decode step reads every weight once, so its time is the bytes it reads.
//
//   inputs   0 x        float (..., K)
//            1 weights  uint8 (N / 16, K / 32, 320 or 384)  per tile of 16 columns and block of 32
//                       rows of W: 256 bytes of codes, then 16 scales and 16 minimums, as float16 (320
//                       bytes: a GGUF Q4_1's) or float32 (384: any other 4-bit blocks, a zero point z
//                       as the minimum -z d, a K-quant's super-block scale times its sub-scale)
//                       (block_q4_layout in engines/ort_fused/block_layouts.py writes them; byte 4 c + i
//                       of the j-th 64 bytes holds column c's codes for rows 4 j + i (low nibble) and
//                       4 (j + 4) + i (high))
//   output   0 y        float (..., N)                 y = x @ W
//
// ai.cabinlm::BlockQ4SwiGLUMatMul takes the MLP's gate | up product instead and multiplies its
// SwiGLU: x (..., 2 K) -> y = (silu(x[..., :K]) * x[..., K:]) @ W, silu(g) = g / (1 + exp(-g)),
// in place of a Split, a Sigmoid and two Muls per layer.
//
// How it computes (llama.cpp's Q4_1 x Q8_1 dot product): each row of x is quantized per block of 32
// to int8 codes c with the block's scale s = a / 127 (a its largest magnitude; rounded half to even);
// then, with x' = s c the quantized row,
//   y[n] = sum over blocks of  d[n] s (q[n] . c)  +  m[n] s sum(c)  =  sum over k of W[k, n] x'[k]
// with both integer sums exact (VNNI's unsigned x signed byte products): the exported weights times
// the quantized activations, minimums included. (The minimum times the float sum of x instead would
// leave the quantization error times d q, which does not average out as it does times W: measured,
// twice the logit error on SmolLM2.) The float terms are added block after block.
//
// Invariant the runtime relies on: a row's result is a function of that row alone, computed by one
// fixed sequence of operations (the same code for any number of rows; rows are grouped (by kRowBlock) to
// share each weight tile's unpacking, never to change a row's arithmetic): row i of a chunk is bit
// for bit the one-token step (speculative verification depends on it).
//
// Built for the profile's CPU (cpu_march), one path per library, the same arithmetic in each (the
// integer sums are exact, and every path adds the float terms with the same two fused multiply-adds
// per block, so the paths agree bit for bit):
//   "avx512-vnni"   x86 with AVX-512 VNNI (vpdpbusd: 64 unsigned x signed byte products a step)
//   "avx-vnni"      x86 with AVX2 and AVX-VNNI (the VEX vpdpbusd: 32 byte products a step)
//   "avx2"          any other x86 with AVX2, FMA and F16C (vpmaddubsw: 32 unsigned x signed byte
//                   products into 16-bit pair sums, which hold a block's 4-bit sums exactly, then
//                   vpmaddwd into 32 bits once per block)
//   "neon-dotprod"  Armv8.2-A and later with the dot product extension (sdot, vdotq_laneq_s32: 16
//                   signed byte products a step; the 4-bit codes are 0..15, so signed bytes hold
//                   them): every cockpit CPU (Cortex-A78AE, Kryo / Cortex-X1, Neoverse V3AE)
//   "neon-i8mm"     the same where the CPU also has the int8 matrix multiply (Armv8.6-A+ / Armv9:
//                   Thor's Neoverse V3AE): pairs of rows take smmla (vmmlaq_s32: a 2 x 8 by 8 x 2
//                   product, 32 byte products a step, twice sdot's), a lone row sdot
//   "generic"       plain C++ anywhere else (correct, not fast)
// (block_matmul.h chooses it from the compiler's macros). cabinlm_block_q4_isa() says which; the build
// records it in the manifest, and reads the answer from the file itself where it cannot load a library
// compiled for another CPU (kernels/compiler.py: the "cabinlm_block_q4_isa=" tag).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ort_api.h"
#include "block_matmul.h"  // the path: CABINLM_BLOCKS_*
#include "vector_math.h"

namespace {

using namespace cabinlm_ort;
using namespace cabinlm_vec;
using cabinlm_blocks::quantize_row;

using cabinlm_blocks::kBlock;  // rows of W per block
using cabinlm_blocks::kCols;   // columns per tile
constexpr int kCodeBytes = kCols * kBlock / 2;  // 256
// A tile block's bytes: its codes, then 16 scales and 16 minimums of type S (uint16_t: float16, float).
template <class S>
constexpr int64_t tile_block_bytes() { return kCodeBytes + 2 * kCols * static_cast<int64_t>(sizeof(S)); }
typedef uint16_t f16;  // a float16's bits
// Rows of x that share a tile's unpacking. NEON: 2, so that a group's int32 and float accumulators
// (8 + 8 vectors), its codes (4) and the tile's scales and minimums stay in the 32 registers. AVX-512:
// 8 (a group's 8 integer and 8 float accumulators, 64 bytes of codes unpacked at a time), so that a
// verified draft's 5 to 8 rows, or 4 seats' and their drafts', unpack each tile once instead of
// leaving one to three rows a pass of their own. AVX2: 4 (a group's 2 x 4 integer accumulators and
// the unpacked codes stay in the 16 registers; the float accumulators, touched once per block, may not).
#if CABINLM_BLOCKS_NEON_DOT
constexpr int kRowBlock = 2;
#elif CABINLM_BLOCKS_AVX2
constexpr int kRowBlock = 4;
#else
constexpr int kRowBlock = 8;
#endif

struct Problem : cabinlm_blocks::Operands {
  const int8_t* xq = nullptr;  // (M, nb, 32) the rows' codes
  const float* dx = nullptr;   // (M, nb) their scales
  const float* sx = nullptr;   // (M, nb) their scales times the blocks' code sums
};

float half_to_float(uint16_t h) {  // exact: every float16 is a float32
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: m * 2^-24
    float f = std::ldexp(static_cast<float>(man), -24);
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if CABINLM_BLOCKS_AVX512_VNNI
typedef int32_t int32_alias __attribute__((may_alias));

template <class S>
inline __m512 load16(const uint8_t* at) {  // 16 scales or minimums; float16 -> float32 is exact
  if constexpr (sizeof(S) == 2)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
  else
    return _mm512_loadu_ps(at);
}

// Rows r0 .. r0+R-1 of one tile of 16 columns: each 64 bytes of a block's codes unpacked once (low and
// high nibbles: 8 code rows of W) and met by every row's codes, four at a time (broadcast by the load
// itself, {1to16}), into that row's integer sums -- two per row for R <= 4 (to keep the dot-product
// chains short enough to overlap), one for more rows (R independent chains already; fewer registers).
// The integer sums are exact in any order, so the split changes no result.
template <int R, class S>
void tile_rows(const Problem& p, int64_t t, int64_t r0) {
  constexpr int A = R <= 4 ? 2 : 1;  // integer accumulators per row
  constexpr int64_t kBytes = tile_block_bytes<S>();
  const uint8_t* w = p.w + t * p.nb * kBytes;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.nb; ++b, w += kBytes) {
    cabinlm_blocks::fetch_ahead<kBytes>(w);
    __m512i dot[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) dot[r][a] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i packed = _mm512_loadu_si512(w + 64 * j);
      const __m512i lo = _mm512_and_si512(packed, low);                       // code rows 4 j .. 4 j + 3
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);  // code rows 16 + 4 j ..
      for (int r = 0; r < R; ++r) {
        const int32_alias* x4 = reinterpret_cast<const int32_alias*>(p.xq + ((r0 + r) * p.nb + b) * kBlock);
        dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], lo, _mm512_set1_epi32(x4[j]));
        dot[r][A - 1] = _mm512_dpbusd_epi32(dot[r][A - 1], hi, _mm512_set1_epi32(x4[j + 4]));
      }
    }
    const __m512 d = load16<S>(w + kCodeBytes), m = load16<S>(w + kCodeBytes + kCols * sizeof(S));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * p.nb + b;
      const __m512i sum = A == 2 ? _mm512_add_epi32(dot[r][0], dot[r][A - 1]) : dot[r][0];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(p.dx[at])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(p.sx[at]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(p.y + (r0 + r) * p.N + t * kCols, acc[r]);
}
#elif CABINLM_BLOCKS_AVX2
typedef int32_t int32_alias __attribute__((may_alias));

template <class S>
inline __m256 load8(const uint8_t* at) {  // 8 scales or minimums; float16 -> float32 is exact
  if constexpr (sizeof(S) == 2)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
  else
    return _mm256_loadu_ps(reinterpret_cast<const float*>(at));
}

// Rows r0 .. r0+R-1 of one tile of 16 columns, as two vectors of 8 columns (h = 0, 1): each 32 bytes
// of a block's codes (code rows 4 j .. 4 j + 3 of columns 8 h .. 8 h + 7) unpacked once (low and high
// nibbles) and met by every row's codes, four at a time, broadcast. With AVX-VNNI, vpdpbusd adds the
// four products into the column's 32-bit sum. With AVX2 alone, vpmaddubsw gives 16-bit sums of two
// products (at most 2 x 15 x 127 = 3810 in magnitude), eight of which a lane adds up over the block
// (at most 30480: exact in 16 bits, no saturation), and vpmaddwd adds its two lanes into the 32-bit
// sum once per block. The same integers as every path's, so the float terms below are the same.
template <int R, class S>
void tile_rows(const Problem& p, int64_t t, int64_t r0) {
  constexpr int64_t kBytes = tile_block_bytes<S>();
  const uint8_t* w = p.w + t * p.nb * kBytes;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.nb; ++b, w += kBytes) {
    cabinlm_blocks::fetch_ahead<kBytes>(w);
    __m256i dot[R][2];  // AVX-VNNI: 32-bit sums; AVX2: 16-bit pair sums until the block's end
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j)
      for (int h = 0; h < 2; ++h) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j + 32 * h));
        const __m256i lo = _mm256_and_si256(packed, low);                       // code rows 4 j .. 4 j + 3
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);  // code rows 16 + 4 j ..
        for (int r = 0; r < R; ++r) {
          const int32_alias* x4 = reinterpret_cast<const int32_alias*>(p.xq + ((r0 + r) * p.nb + b) * kBlock);
          const __m256i xl = _mm256_set1_epi32(x4[j]), xh = _mm256_set1_epi32(x4[j + 4]);
#if CABINLM_BLOCKS_AVX_VNNI
          dot[r][h] = cabinlm_blocks::dpbusd(cabinlm_blocks::dpbusd(dot[r][h], lo, xl), hi, xh);
#else
          dot[r][h] = _mm256_add_epi16(dot[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
#endif
        }
      }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = load8<S>(w + kCodeBytes + 8 * h * sizeof(S));
      const __m256 m = load8<S>(w + kCodeBytes + (kCols + 8 * h) * sizeof(S));
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * p.nb + b;
#if CABINLM_BLOCKS_AVX_VNNI
        const __m256i sum = dot[r][h];
#else
        const __m256i sum = _mm256_madd_epi16(dot[r][h], _mm256_set1_epi16(1));
#endif
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(p.dx[at])), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(p.sx[at]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(p.y + (r0 + r) * p.N + t * kCols + 8 * h, acc[r][h]);
}
#elif CABINLM_BLOCKS_NEON_DOT
// One group of 4 code rows j of a block (bytes 64 j .. 64 j + 63: columns 4 q .. 4 q + 3 in the q-th
// 16 bytes, four bytes per column), for R rows of x: the low nibbles are rows 4 j + i of W, so they
// meet the row's codes 4 j .. 4 j + 3 (lane j of its first 16 codes); the high nibbles are rows
// 16 + 4 j + i (lane j of its last 16). J is a template argument: sdot's lane is an immediate.
template <int J, int R>
inline void dot_group(const uint8_t* w, const int8x16_t (&lo_x)[R], const int8x16_t (&hi_x)[R], int32x4_t (&dot)[R][4]) {
  const uint8x16_t low = vdupq_n_u8(0x0F);
  for (int q = 0; q < 4; ++q) {
    const uint8x16_t packed = vld1q_u8(w + 64 * J + 16 * q);
    const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(packed, low)), hi = vreinterpretq_s8_u8(vshrq_n_u8(packed, 4));
    for (int r = 0; r < R; ++r) {
      dot[r][q] = vdotq_laneq_s32(dot[r][q], lo, lo_x[r], J);
      dot[r][q] = vdotq_laneq_s32(dot[r][q], hi, hi_x[r], J);
    }
  }
}

#if CABINLM_BLOCKS_NEON_I8MM
// Rows r0, r0 + 1 with smmla: one instruction multiplies the rows' codes for 8 consecutive k (a 2 x 8
// block) with two columns' codes for the same k (8 x 2) into the 2 x 2 integer sums. The code rows
// j = 2 h, 2 h + 1 of a block hold k = 8 h .. 8 h + 7 (low nibbles) and 16 + 8 h .. 16 + 8 h + 7
// (high); zipping their 32-bit lanes puts a column's 8 codes for those k side by side.
inline void block_dots_mmla(const uint8_t* w, const int8_t* x0, const int8_t* x1, int32x4_t (&dot)[2][4]) {
  const uint8x16_t low = vdupq_n_u8(0x0F);
  int8x16_t a[4];  // a[g]: the two rows' codes for k = 8 g .. 8 g + 7
  for (int g = 0; g < 4; ++g) a[g] = vcombine_s8(vld1_s8(x0 + 8 * g), vld1_s8(x1 + 8 * g));
  int32x4_t s[8];  // s[2 q + e]: columns 4 q + 2 e, 4 q + 2 e + 1 as [r0 c, r0 c + 1, r1 c, r1 c + 1]
  for (int i = 0; i < 8; ++i) s[i] = vdupq_n_s32(0);
  for (int h = 0; h < 2; ++h)
    for (int q = 0; q < 4; ++q) {
      const uint32x4_t pa = vreinterpretq_u32_u8(vld1q_u8(w + 64 * (2 * h) + 16 * q));
      const uint32x4_t pb = vreinterpretq_u32_u8(vld1q_u8(w + 64 * (2 * h + 1) + 16 * q));
      const uint32x4_t lo_a = vandq_u32(pa, vreinterpretq_u32_u8(low)), lo_b = vandq_u32(pb, vreinterpretq_u32_u8(low));
      const uint32x4_t hi_a = vreinterpretq_u32_u8(vshrq_n_u8(vreinterpretq_u8_u32(pa), 4));
      const uint32x4_t hi_b = vreinterpretq_u32_u8(vshrq_n_u8(vreinterpretq_u8_u32(pb), 4));
      s[2 * q] = vmmlaq_s32(s[2 * q], a[h], vreinterpretq_s8_u32(vzip1q_u32(lo_a, lo_b)));
      s[2 * q + 1] = vmmlaq_s32(s[2 * q + 1], a[h], vreinterpretq_s8_u32(vzip2q_u32(lo_a, lo_b)));
      s[2 * q] = vmmlaq_s32(s[2 * q], a[2 + h], vreinterpretq_s8_u32(vzip1q_u32(hi_a, hi_b)));
      s[2 * q + 1] = vmmlaq_s32(s[2 * q + 1], a[2 + h], vreinterpretq_s8_u32(vzip2q_u32(hi_a, hi_b)));
    }
  for (int q = 0; q < 4; ++q) {  // each row's 4 columns: 64-bit halves of the two pairs
    const int64x2_t e = vreinterpretq_s64_s32(s[2 * q]), o = vreinterpretq_s64_s32(s[2 * q + 1]);
    dot[0][q] = vreinterpretq_s32_s64(vzip1q_s64(e, o));
    dot[1][q] = vreinterpretq_s32_s64(vzip2q_s64(e, o));
  }
}
#endif

template <class S>
inline float32x4_t load4(const uint8_t* at) {  // 4 scales or minimums; float16 -> float32 is exact (fcvtl)
  if constexpr (sizeof(S) == 2)
    return vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(at)));
  else
    return vreinterpretq_f32_u8(vld1q_u8(at));
}

// Rows r0 .. r0+R-1 of one tile of 16 columns: four vectors of 4 columns each. The integer sums of a
// block by sdot (or, for two rows where the CPU has i8mm, smmla: the same exact integers); then the
// float terms, the same for every row.
template <int R, class S>
void tile_rows(const Problem& p, int64_t t, int64_t r0) {
  constexpr int64_t kBytes = tile_block_bytes<S>();
  const uint8_t* w = p.w + t * p.nb * kBytes;
  float32x4_t acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < p.nb; ++b, w += kBytes) {
    cabinlm_blocks::fetch_ahead<kBytes>(w);
    int32x4_t dot[R][4];  // integer: exact in any order
#if CABINLM_BLOCKS_NEON_I8MM
    if constexpr (R == 2) {
      block_dots_mmla(w, p.xq + (r0 * p.nb + b) * kBlock, p.xq + ((r0 + 1) * p.nb + b) * kBlock, dot);
    } else
#endif
    {
      int8x16_t lo_x[R], hi_x[R];
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = p.xq + ((r0 + r) * p.nb + b) * kBlock;
        lo_x[r] = vld1q_s8(xq);
        hi_x[r] = vld1q_s8(xq + 16);
        for (int q = 0; q < 4; ++q) dot[r][q] = vdupq_n_s32(0);
      }
      dot_group<0>(w, lo_x, hi_x, dot);
      dot_group<1>(w, lo_x, hi_x, dot);
      dot_group<2>(w, lo_x, hi_x, dot);
      dot_group<3>(w, lo_x, hi_x, dot);
    }
    for (int q = 0; q < 4; ++q) {
      const float32x4_t d = load4<S>(w + kCodeBytes + 4 * q * sizeof(S));
      const float32x4_t m = load4<S>(w + kCodeBytes + (kCols + 4 * q) * sizeof(S));
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * p.nb + b;
        acc[r][q] = vfmaq_f32(acc[r][q], vcvtq_f32_s32(dot[r][q]), vmulq_f32(d, vdupq_n_f32(p.dx[at])));
        acc[r][q] = vfmaq_f32(acc[r][q], m, vdupq_n_f32(p.sx[at]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) vst1q_f32(p.y + (r0 + r) * p.N + t * kCols + 4 * q, acc[r][q]);
}
#else
template <class S>
float scale_at(const uint8_t* at) {  // one scale or minimum; float16 -> float32 is exact
  S v;
  std::memcpy(&v, at, sizeof v);
  if constexpr (sizeof(S) == 2)
    return half_to_float(v);
  else
    return v;
}

template <int R, class S>
void tile_rows(const Problem& p, int64_t t, int64_t r0) {
  constexpr int64_t kBytes = tile_block_bytes<S>();
  const uint8_t* w = p.w + t * p.nb * kBytes;
  float acc[R][kCols] = {};
  for (int64_t b = 0; b < p.nb; ++b, w += kBytes) {
    float d[kCols], m[kCols];
    for (int c = 0; c < kCols; ++c) {
      d[c] = scale_at<S>(w + kCodeBytes + sizeof(S) * c);
      m[c] = scale_at<S>(w + kCodeBytes + sizeof(S) * (kCols + c));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * p.nb + b;
      const int8_t* xq = p.xq + at * kBlock;
      for (int c = 0; c < kCols; ++c) {
        int32_t dot = 0;
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = w[64 * j + 4 * c + i];
            dot += (byte & 0x0F) * xq[4 * j + i] + (byte >> 4) * xq[4 * (j + 4) + i];
          }
        acc[r][c] = std::fma(static_cast<float>(dot), d[c] * p.dx[at], acc[r][c]);
        acc[r][c] = std::fma(m[c], p.sx[at], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(p.y + (r0 + r) * p.N + t * kCols, acc[r], sizeof acc[r]);
}
#endif

template <class S>
struct Tiles {  // cabinlm_blocks::tile_unit's rows, for scales and minimums of type S
  template <int R>
  static void rows(const Problem& p, int64_t t, int64_t r0) { tile_rows<R, S>(p, t, r0); }
};

OrtStatus* compute(OrtKernelContext* ctx, bool swiglu) {
  const int64_t width = swiglu ? 2 : 1;  // x holds gate | up for the SwiGLU
  Problem p;
  CABIN_TRY(cabinlm_blocks::operands(ctx, swiglu ? "BlockQ4SwiGLUMatMul: " : "BlockQ4MatMul: ", width,
                                     {tile_block_bytes<f16>(), tile_block_bytes<float>()}, swiglu ? "2 K" : "K", &p));
  const float* x = p.x;
  if (p.M == 0) return nullptr;

  std::vector<int8_t> xq(static_cast<size_t>(p.M * p.K));
  std::vector<float> scales(static_cast<size_t>(p.M * p.nb)), sums(scales.size());
  std::vector<float> act(swiglu ? static_cast<size_t>(p.K) : 0);
  for (int64_t r = 0; r < p.M; ++r) {
    const float* row = x + r * width * p.K;
    if (swiglu) {
      swiglu_row(row, p.K, act.data());
      row = act.data();
    }
    quantize_row(row, p.nb, xq.data() + r * p.K, scales.data() + r * p.nb, sums.data() + r * p.nb);
  }
  p.xq = xq.data();
  p.dx = scales.data();
  p.sx = sums.data();
  const auto unit = p.tile_bytes == tile_block_bytes<f16>() ? cabinlm_blocks::tile_unit<Tiles<f16>, kRowBlock, Problem>
                                                            : cabinlm_blocks::tile_unit<Tiles<float>, kRowBlock, Problem>;
  return parallel_for(ctx, unit, cabinlm_blocks::tile_units(p.tiles), &p);
}

struct BlockQ4MatMul {
  static constexpr const char* kName = "BlockQ4MatMul";
  static constexpr ElementType kInputTypes[2] = {kFloat, kUint8};
  static OrtStatus* compute(OrtKernelContext* ctx) { return ::compute(ctx, false); }
};

struct BlockQ4SwiGLUMatMul {
  static constexpr const char* kName = "BlockQ4SwiGLUMatMul";
  static constexpr ElementType kInputTypes[2] = {kFloat, kUint8};
  static OrtStatus* compute(OrtKernelContext* ctx) { return ::compute(ctx, true); }
};

}  // namespace

const cabinlm_ort::CustomOp* cabinlm_ort::block_q4_matmul_op() {
  static const CustomOp op = make_op<BlockQ4MatMul>();
  return &op;
}

const cabinlm_ort::CustomOp* cabinlm_ort::block_q4_swiglu_matmul_op() {
  static const CustomOp op = make_op<BlockQ4SwiGLUMatMul>();
  return &op;
}

// Which path this library was compiled with: `cabinlm build` asks it (kernels/compiler.py, in a child
// process) and records the answer in the manifest (fused.kernels.matmul_isa) before choosing the kernel.
// A library cross-compiled for another CPU cannot be loaded to ask: the compiler reads the same answer
// from the tag below, which the function returns the tail of (so the tag is in every library).
namespace {
constexpr char kIsaTag[] = "cabinlm_block_q4_isa=" CABINLM_BLOCKS_ISA;
}

extern "C" __attribute__((visibility("default"))) const char* cabinlm_block_q4_isa() {
  return kIsaTag + sizeof("cabinlm_block_q4_isa=") - 1;
}
