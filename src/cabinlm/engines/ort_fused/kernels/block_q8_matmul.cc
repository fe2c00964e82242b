// cabinlm's matmul over symmetric int8 weight blocks: an ONNX Runtime custom operator,
// ai.cabinlm::BlockQ8MatMul, the fused cpu build's LM head (engines/ort_fused/graph.py).
//
// It takes the place of com.microsoft::MatMulNBits (8 bits, accuracy level 4) for the head's int8
// blocks: blocks of 32 weights along K, each weight s * q with a code q in -127..127 and the block's
// float32 scale s. Why an own kernel: a session packs its own copy of every MatMulNBits matrix
// (vocab x hidden x ~1.35 bytes: 38 MB for SmolLM2's head, 226 MB for Gemma 3's), once per graph that
// holds it, so the batched graphs ran the head in a session of its own, whose threads woke for every
// step; this kernel reads the blocks in place from the build's one map of the weights, so every graph
// holds the head and no copy is made.
//
//   inputs   0 x        float (..., K)
//            1 weights  uint8 (N / 16, K / 32, 576)  per tile of 16 columns and block of 32 rows of W:
//                       512 bytes of codes, then 16 float32 scales (block_q8_layout in
//                       engines/ort_fused/block_layouts.py writes them; byte 64 j + 4 c + i holds
//                       column c's code for row 4 j + i, plus 128, as unsigned)
//   output   0 y        float (..., N)                 y = x @ W
//
// How it computes (llama.cpp's Q8_0 x Q8_0 dot product; MatMulNBits' accuracy level 4 does the
// same): each row of x quantized per block of 32 (block_matmul.h, as BlockQ4MatMul's rows), then
//   y[n] = sum over blocks of  s[n] d (q[n] . c)
// with the integer sum exact: VNNI (AVX-512 or AVX-VNNI) multiplies the unsigned q + 128 by c and
// takes 128 sum(c) off; AVX2 flips the stored byte's top bit back to the signed q and multiplies |q|
// by c with q's sign (vpmaddubsw: two products of at most 127 x 127 fit its 16 bits), then adds the
// pairs into 32 bits (vpmaddwd); NEON flips the top bit too and multiplies signed by signed. The
// float terms are added block after block, one fused multiply-add each.
//
// Invariant the runtime relies on (as BlockQ4MatMul's): a row's result is a function of that row
// alone, one fixed sequence of operations whatever the rows beside it (rows are grouped to share
// each tile's loads, never to change a row's arithmetic): a batched graph's row is its seat's own
// row bit for bit, and a chunk's row its one-token step. Every path computes the same integers and
// adds the same float terms in the same order, so the paths agree bit for bit.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ort_api.h"
#include "block_matmul.h"  // the path: CABINLM_BLOCKS_*

namespace {

using namespace cabinlm_ort;
using cabinlm_blocks::kBlock;
using cabinlm_blocks::kCols;
using cabinlm_blocks::quantize_row;

constexpr int kCodeBytes = kCols * kBlock;                              // 512
constexpr int kTileBlockBytes = kCodeBytes + kCols * sizeof(float);    // + 16 float32 scales
#if CABINLM_BLOCKS_NEON_DOT
constexpr int kRowBlock = 2;  // a group's 2 x 4 integer and float accumulators, its codes, in 32 registers
#else
constexpr int kRowBlock = 4;
#endif

struct Problem : cabinlm_blocks::Operands {
  const int8_t* xq = nullptr;     // (M, nb, 32) the rows' codes
  const float* dx = nullptr;      // (M, nb) their scales
  const int32_t* csum = nullptr;  // (M, nb) their blocks' code sums
};

#if CABINLM_BLOCKS_AVX512_VNNI
typedef int32_t int32_alias __attribute__((may_alias));

// Rows r0 .. r0+R-1 of one tile of 16 columns.
template <int R>
void tile_rows(const Problem& p, int64_t t, int64_t r0) {
  const uint8_t* w = p.w + t * p.nb * kTileBlockBytes;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.nb; ++b, w += kTileBlockBytes) {
    cabinlm_blocks::fetch_ahead<kTileBlockBytes>(w);
    __m512i codes[8];
    for (int j = 0; j < 8; ++j) codes[j] = _mm512_loadu_si512(w + 64 * j);
    float d_[kCols];
    std::memcpy(d_, w + kCodeBytes, sizeof d_);
    const __m512 d = _mm512_loadu_ps(d_);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * p.nb + b;
      const int32_alias* x4 = reinterpret_cast<const int32_alias*>(p.xq + at * kBlock);
      // (q + 128) . c - 128 sum(c) = q . c: integers, exact in any order
      __m512i even = _mm512_set1_epi32(-128 * p.csum[at]), odd = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        even = _mm512_dpbusd_epi32(even, codes[j], _mm512_set1_epi32(x4[j]));
        odd = _mm512_dpbusd_epi32(odd, codes[j + 1], _mm512_set1_epi32(x4[j + 1]));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(p.dx[at])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(p.y + (r0 + r) * p.N + t * kCols, acc[r]);
}
#elif CABINLM_BLOCKS_AVX2
typedef int32_t int32_alias __attribute__((may_alias));

// Rows r0 .. r0+R-1 of one tile of 16 columns, as two vectors of 8 columns (h = 0, 1): each 32 bytes
// of codes (code rows 4 j .. 4 j + 3 of columns 8 h .. 8 h + 7) loaded once and met by every row's
// codes 4 j .. 4 j + 3, broadcast.
template <int R>
void tile_rows(const Problem& p, int64_t t, int64_t r0) {
  const uint8_t* w = p.w + t * p.nb * kTileBlockBytes;
#if !CABINLM_BLOCKS_AVX_VNNI
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.nb; ++b, w += kTileBlockBytes) {
    cabinlm_blocks::fetch_ahead<kTileBlockBytes>(w);
    __m256i dot[R][2];  // integer: exact in any order
    for (int r = 0; r < R; ++r) {
#if CABINLM_BLOCKS_AVX_VNNI
      dot[r][0] = dot[r][1] = _mm256_set1_epi32(-128 * p.csum[(r0 + r) * p.nb + b]);  // (q + 128) . c - 128 sum(c)
#else
      dot[r][0] = dot[r][1] = _mm256_setzero_si256();
#endif
    }
    for (int j = 0; j < 8; ++j)
      for (int h = 0; h < 2; ++h) {
        const __m256i stored = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j + 32 * h));  // q + 128
#if !CABINLM_BLOCKS_AVX_VNNI
        const __m256i q = _mm256_xor_si256(stored, flip), magnitude = _mm256_sign_epi8(q, q);  // |q| <= 127
#endif
        for (int r = 0; r < R; ++r) {
          const int32_alias* x4 = reinterpret_cast<const int32_alias*>(p.xq + ((r0 + r) * p.nb + b) * kBlock);
          const __m256i c = _mm256_set1_epi32(x4[j]);
#if CABINLM_BLOCKS_AVX_VNNI
          dot[r][h] = cabinlm_blocks::dpbusd(dot[r][h], stored, c);
#else
          const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(c, q));  // |q| (sign(q) c) = q c
          dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(pairs, ones));
#endif
        }
      }
    float d_[kCols];
    std::memcpy(d_, w + kCodeBytes, sizeof d_);
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_loadu_ps(d_ + 8 * h);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * p.nb + b;
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(d, _mm256_set1_ps(p.dx[at])), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(p.y + (r0 + r) * p.N + t * kCols + 8 * h, acc[r][h]);
}
#elif CABINLM_BLOCKS_NEON_DOT
// Code rows j of a block (bytes 64 j .. 64 j + 63: columns 4 q .. 4 q + 3 in the q-th 16 bytes, four
// bytes a column, rows 4 j .. 4 j + 3) against lane j % 4 of the row's codes j / 4 (J: an immediate).
template <int J, int R>
inline void dot_rows(const uint8_t* w, const int8x16_t (&x)[R][2], int32x4_t (&dot)[R][4]) {
  const uint8x16_t flip = vdupq_n_u8(0x80);
  for (int q = 0; q < 4; ++q) {
    const int8x16_t codes = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(w + 64 * J + 16 * q), flip));  // q + 128 -> q
    for (int r = 0; r < R; ++r) dot[r][q] = vdotq_laneq_s32(dot[r][q], codes, x[r][J / 4], J % 4);
  }
}

template <int R>
void tile_rows(const Problem& p, int64_t t, int64_t r0) {
  const uint8_t* w = p.w + t * p.nb * kTileBlockBytes;
  float32x4_t acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < p.nb; ++b, w += kTileBlockBytes) {
    cabinlm_blocks::fetch_ahead<kTileBlockBytes>(w);
    int8x16_t x[R][2];
    int32x4_t dot[R][4];  // integer: exact in any order
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = p.xq + ((r0 + r) * p.nb + b) * kBlock;
      x[r][0] = vld1q_s8(xq);
      x[r][1] = vld1q_s8(xq + 16);
      for (int q = 0; q < 4; ++q) dot[r][q] = vdupq_n_s32(0);
    }
    dot_rows<0>(w, x, dot);
    dot_rows<1>(w, x, dot);
    dot_rows<2>(w, x, dot);
    dot_rows<3>(w, x, dot);
    dot_rows<4>(w, x, dot);
    dot_rows<5>(w, x, dot);
    dot_rows<6>(w, x, dot);
    dot_rows<7>(w, x, dot);
    for (int q = 0; q < 4; ++q) {
      float d_[4];
      std::memcpy(d_, w + kCodeBytes + 16 * q, sizeof d_);
      const float32x4_t d = vld1q_f32(d_);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * p.nb + b;
        acc[r][q] = vfmaq_f32(acc[r][q], vcvtq_f32_s32(dot[r][q]), vmulq_f32(d, vdupq_n_f32(p.dx[at])));
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
    float d[kCols];
    std::memcpy(d, w + kCodeBytes, sizeof d);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * p.nb + b;
      const int8_t* xq = p.xq + at * kBlock;
      for (int c = 0; c < kCols; ++c) {
        int32_t dot = 0;
        for (int j = 0; j < 8; ++j)
          for (int i = 0; i < 4; ++i) dot += (static_cast<int32_t>(w[64 * j + 4 * c + i]) - 128) * xq[4 * j + i];
        acc[r][c] = std::fma(static_cast<float>(dot), d[c] * p.dx[at], acc[r][c]);
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

struct BlockQ8MatMul {
  static constexpr const char* kName = "BlockQ8MatMul";
  static constexpr ElementType kInputTypes[2] = {kFloat, kUint8};

  static OrtStatus* compute(OrtKernelContext* ctx) {
    Problem p;
    CABIN_TRY(cabinlm_blocks::operands(ctx, "BlockQ8MatMul: ", 1, {kTileBlockBytes}, "K", &p));
    const float* x = p.x;
    if (p.M == 0) return nullptr;

    std::vector<int8_t> xq(static_cast<size_t>(p.M * p.K));
    std::vector<float> scales(static_cast<size_t>(p.M * p.nb)), scaled(scales.size());
    std::vector<int32_t> sums(scales.size());
    for (int64_t r = 0; r < p.M; ++r)
      quantize_row(x + r * p.K, p.nb, xq.data() + r * p.K, scales.data() + r * p.nb, scaled.data() + r * p.nb,
                   sums.data() + r * p.nb);
    p.xq = xq.data();
    p.dx = scales.data();
    p.csum = sums.data();
    return parallel_for(ctx, cabinlm_blocks::tile_unit<Tiles, kRowBlock, Problem>, cabinlm_blocks::tile_units(p.tiles), &p);
  }
};

}  // namespace

const cabinlm_ort::CustomOp* cabinlm_ort::block_q8_matmul_op() {
  static const CustomOp op = make_op<BlockQ8MatMul>();
  return &op;
}
