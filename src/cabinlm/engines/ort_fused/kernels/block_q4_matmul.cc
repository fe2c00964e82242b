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
//            1 weights  uint8 (N / 16, K / 32, 320)  per tile of 16 columns and block of 32 rows of W:
//                       256 bytes of codes, 16 float16 scales, 16 float16 minimums (block_q4_layout
//                       in builders/block_layouts.py writes them; byte 4 c + i of the j-th 64 bytes holds
//                       column c's codes for rows 4 j + i (low nibble) and 4 (j + 4) + i (high))
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
//   "neon-dotprod"  Armv8.2-A and later with the dot product extension (sdot, vdotq_laneq_s32: 16
//                   signed byte products a step; the 4-bit codes are 0..15, so signed bytes hold
//                   them): every cockpit CPU (Cortex-A78AE, Kryo / Cortex-X1, Neoverse V3AE)
//   "neon-i8mm"     the same where the CPU also has the int8 matrix multiply (Armv8.6-A+ / Armv9:
//                   Thor's Neoverse V3AE): pairs of rows take smmla (vmmlaq_s32: a 2 x 8 by 8 x 2
//                   product, 32 byte products a step, twice sdot's), a lone row sdot
//   "generic"       plain C++ anywhere else (correct, not fast)
// cabinlm_block_q4_isa() says which; the build chooses this kernel by default only for the first two
// (engines/ort_fused/builder.py), and reads the answer from the file itself where it cannot load a
// library compiled for another CPU (kernels/compiler.py: the "cabinlm_block_q4_isa=" tag).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(CABINLM_GENERIC)
#define CABINLM_VNNI 1
#define CABINLM_Q4_ISA "avx512-vnni"
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD) && !defined(CABINLM_GENERIC)
#define CABINLM_NEON_DOT 1
#if defined(__ARM_FEATURE_MATMUL_INT8) && !defined(CABINLM_NO_I8MM)
#define CABINLM_NEON_I8MM 1
#define CABINLM_Q4_ISA "neon-i8mm"
#else
#define CABINLM_Q4_ISA "neon-dotprod"
#endif
#include <arm_neon.h>
#else
#define CABINLM_Q4_ISA "generic"
#endif

#include "ort_api.h"
#include "block_matmul.h"
#include "vector_math.h"

namespace {

using namespace cabinlm_ort;
using namespace cabinlm_vec;
using cabinlm_blocks::quantize_row;

using cabinlm_blocks::kBlock;  // rows of W per block
using cabinlm_blocks::kCols;   // columns per tile
constexpr int kCodeBytes = kCols * kBlock / 2;          // 256
constexpr int kTileBlockBytes = kCodeBytes + 4 * kCols;  // + 16 float16 scales + 16 float16 minimums
// Rows of x that share a tile's unpacking. NEON: 2, so that a group's int32 and float accumulators
// (8 + 8 vectors), its codes (4) and the tile's scales and minimums stay in the 32 registers. AVX-512:
// 8 (a group's 8 integer and 8 float accumulators, 64 bytes of codes unpacked at a time), so that a
// verified draft's 5 to 8 rows, or 4 seats' and their drafts', unpack each tile once instead of
// leaving one to three rows a pass of their own (docs/benchmarks.md section 20, stop 45).
#if CABINLM_NEON_DOT
constexpr int kRowBlock = 2;
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

// silu(gate) * up for one row of gate | up (2 K floats), 16 lanes at a time: sigmoid from exp of
// -|g| only (no overflow), exp_nonpositive's polynomial.
void swiglu_row(const float* gu, int64_t K, float* out) {
  for (int64_t k = 0; k < K; k += 16) {
    const vf16 g = load(gu + k), u = load(gu + K + k);
    const vi16 positive = g >= splat(0.0f);
    const vf16 e = exp_nonpositive(positive ? -g : g);
    const vf16 sigmoid = (positive ? splat(1.0f) : e) / (splat(1.0f) + e);
    store(out + k, g * sigmoid * u);
  }
}

#if CABINLM_VNNI
typedef int32_t int32_alias __attribute__((may_alias));

// Rows r0 .. r0+R-1 of one tile of 16 columns: each 64 bytes of a block's codes unpacked once (low and
// high nibbles: 8 code rows of W) and met by every row's codes, four at a time (broadcast by the load
// itself, {1to16}), into that row's integer sums -- two per row for R <= 4 (to keep the dot-product
// chains short enough to overlap), one for more rows (R independent chains already; fewer registers).
// The integer sums are exact in any order, so the split changes no result.
template <int R>
void tile_rows(const Problem& p, int64_t t, int64_t r0) {
  constexpr int A = R <= 4 ? 2 : 1;  // integer accumulators per row
  const uint8_t* w = p.w + t * p.nb * kTileBlockBytes;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.nb; ++b, w += kTileBlockBytes) {
    cabinlm_blocks::fetch_ahead<kTileBlockBytes>(w);
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
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kCodeBytes)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kCodeBytes + 32)));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * p.nb + b;
      const __m512i sum = A == 2 ? _mm512_add_epi32(dot[r][0], dot[r][A - 1]) : dot[r][0];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(p.dx[at])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(p.sx[at]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(p.y + (r0 + r) * p.N + t * kCols, acc[r]);
}
#elif CABINLM_NEON_DOT
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

#if CABINLM_NEON_I8MM
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

// Rows r0 .. r0+R-1 of one tile of 16 columns: four vectors of 4 columns each. The integer sums of a
// block by sdot (or, for two rows where the CPU has i8mm, smmla: the same exact integers); then the
// float terms, the same for every row.
template <int R>
void tile_rows(const Problem& p, int64_t t, int64_t r0) {
  const uint8_t* w = p.w + t * p.nb * kTileBlockBytes;
  float32x4_t acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < p.nb; ++b, w += kTileBlockBytes) {
    cabinlm_blocks::fetch_ahead<kTileBlockBytes>(w);
    int32x4_t dot[R][4];  // integer: exact in any order
#if CABINLM_NEON_I8MM
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
    for (int q = 0; q < 4; ++q) {  // float16 -> float32 is exact (fcvtl)
      const float32x4_t d = vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(w + kCodeBytes + 8 * q)));
      const float32x4_t m = vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(w + kCodeBytes + 2 * kCols + 8 * q)));
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
template <int R>
void tile_rows(const Problem& p, int64_t t, int64_t r0) {
  const uint8_t* w = p.w + t * p.nb * kTileBlockBytes;
  float acc[R][kCols] = {};
  for (int64_t b = 0; b < p.nb; ++b, w += kTileBlockBytes) {
    float d[kCols], m[kCols];
    for (int c = 0; c < kCols; ++c) {
      uint16_t h[2];
      std::memcpy(&h[0], w + kCodeBytes + 2 * c, 2);
      std::memcpy(&h[1], w + kCodeBytes + 2 * kCols + 2 * c, 2);
      d[c] = half_to_float(h[0]);
      m[c] = half_to_float(h[1]);
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

struct Tiles {  // cabinlm_blocks::tile_unit's rows
  template <int R>
  static void rows(const Problem& p, int64_t t, int64_t r0) { tile_rows<R>(p, t, r0); }
};

OrtStatus* compute(OrtKernelContext* ctx, bool swiglu) {
  const int64_t width = swiglu ? 2 : 1;  // x holds gate | up for the SwiGLU
  Problem p;
  CABIN_TRY(cabinlm_blocks::operands(ctx, swiglu ? "BlockQ4SwiGLUMatMul: " : "BlockQ4MatMul: ", width, kTileBlockBytes,
                                     swiglu ? "2 K" : "K", &p));
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
  return parallel_for(ctx, cabinlm_blocks::tile_unit<Tiles, kRowBlock, Problem>, cabinlm_blocks::tile_units(p.tiles), &p);
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
constexpr char kIsaTag[] = "cabinlm_block_q4_isa=" CABINLM_Q4_ISA;
}

extern "C" __attribute__((visibility("default"))) const char* cabinlm_block_q4_isa() {
  return kIsaTag + sizeof("cabinlm_block_q4_isa=") - 1;
}
