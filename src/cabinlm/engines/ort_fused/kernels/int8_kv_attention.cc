// cabinlm's attention over an int8 KV cache: an ONNX Runtime custom operator, ai.cabinlm::Int8KVAttention.
//
// It takes the place of com.microsoft::GroupQueryAttention in the cpu build's fused decoder
// (engines/ort_fused/graph.py), with the same first inputs and meaning, for int8 KV with static
// per-channel scales. Why an own kernel: ONNX Runtime's quantized-cache path computes a chunk of tokens
// one row at a time with the cache de-quantized per row, which makes a prefill chunk over a full window
// about three times as slow as over a float32 cache (measured on SmolLM2's shapes); and a verified
// draft must see the cache as its one-token step would, which only an own kernel can arrange.
//
// ai.cabinlm::FloatKVAttention is the same operator over a float32 cache (fp32 KV builds, the
// vision-language decoders among them): the code below is templated on the cache's element type C,
// a chunk's keys and values stored as computed instead of quantized, k_scale / v_scale ones (which
// leave every product and quotient exact), so its rows, steps and seats keep every invariant below.
// What is int8 below (caches, the step keys) is float there.
//
//   inputs   0 qkv                   float (1, n, (H + 2 Hkv) D)  the chunk's un-rotated q | k | v
//            1 key_cache             int8  (1, Hkv, R, D)  keys rotated at write time; rows F .. F+n-1 are
//            2 value_cache           int8  (1, Hkv, R, D)  written here, in place (F = total - n)
//            3 seqlens_k             int32 (1,)            F + n - 1
//            4 total_sequence_length int32 ()              F + n
//            5 rope_cos, 6 rope_sin  float (rows, D / 2)   the rotation of the row position_ids names
//            7 position_ids          int64 (1, n)
//            8 attention_bias        float (1, 1, n, F + n) additive (0, or -1e30 for a slot not to see):
//                                                          columns 0..F-1 the cache's slots, F+m chunk row m
//            9 k_scale, 10 v_scale   float (Hkv * D)       per channel: keys per rotation pair, values
//   optional, all five or none (the rows as one-token steps, below):
//           11 key_source            float (1, layers * Hkv, P, D)  the sink / pinned tokens' keys, un-rotated
//           12 source_cos, 13 source_sin float (V, K, D / 2)  their rotation, V = 1 (every row) or n (row i:
//                                                          version i); the first K <= P rows, K <= F
//           14 layer                 int64 (1,)            this node's layer in key_source
//           15 row_slots             int64 (n,)            the slot each chunk row goes to
//   output   0 attention             float (1, n, H D)
//
// What row i sees. It attends positions 0 .. X_i, X_i = max(F, 1 + row_slots[0 .. i-1]):
//   position X_i                 its own key and value (written at row F+i);
//   position row_slots[m], m < i chunk row m's (row F+m; the latest m where two rows share a slot);
//   any other position j < F     the cache's row j, except that the first K positions' keys are the
//                                sink / pinned keys rotated from key_source by the row's version of
//                                source_cos / source_sin (quantized as the chunk's own keys are);
//   any other position >= F      nothing (an empty slot: weight 0).
// Without inputs 11..15 the slots are F, F+1, ... and K = 0: row i sees the cache as it was before the
// chunk and the rows before it, the exported graph's chunk semantics. With row_slots the rows'
// destination slots and V = n, row i computes exactly the one-token step that follows i one-token
// steps over the chunk's first i tokens -- after the window has turned over too, where those steps
// overwrite the oldest window slots and move the sink / pinned keys' rotation on (runtime/rotated.py).
// That is what lets a verified draft be plain decoding, bit for bit, for a whole dialogue.
//
// Invariants the runtime relies on:
//  * the chunk's K/V are rotated (keys), divided by their scales, rounded half to even and saturated to
//    +-127, then written to rows F .. F+n-1 of the caches before any row attends, read back as int8,
//    exactly as a one-token step would write them;
//  * a row's result is a function of what that row sees (above), computed in one fixed order (a score
//    over the head dimension in 16 lanes reduced by one fixed tree, a position's score a function of
//    its query, key and bias alone, the softmax sum in 16 lanes by position, the values added position
//    after position): row i is bit for bit the one-token step that sees the same keys at the same
//    positions. How rows are grouped (blocks of 4 rows of one kv head, which share each key's
//    conversion to float where they see the same key; tiles of 16 or 32 positions; whole tiles no row
//    of a block sees, skipped) changes the work, never a row's arithmetic;
//  * a key whose biased score is below the row's maximum by more than 87 weighs exactly 0.
//
// Compiled by `cabinlm build` for the profile's CPU (kernels/compiler.py) into one library with the other
// kernels; it reaches the ONNX Runtime C API through ort_api.h.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define CABINLM_ATTENTION_ISA "avx512"
#elif defined(__AVX2__)
#include <immintrin.h>
#define CABINLM_ATTENTION_ISA "avx2"
#define CABINLM_ATTENTION_HALVES 1  // vectors of 8 floats where 16 would live in memory (qk_tile_n, pv_*)
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#define CABINLM_ATTENTION_ISA "neon"
#else
#define CABINLM_ATTENTION_ISA "generic"
#endif

#include "ort_api.h"
#include "vector_math.h"

namespace {

using namespace cabinlm_ort;
using namespace cabinlm_vec;

// --- the arithmetic ------------------------------------------------------------------------------

constexpr int kLanes = 16;  // every sum below runs over 16 fixed lanes, in one fixed order
constexpr int kMaxGroup = 16;
constexpr int kMaxHeadDim = 256;
constexpr int kRowBlock = 4;  // rows of one kv head that share each key's conversion to float
constexpr int kTile = 32;     // keys converted to float at a time for P V

inline vf16 load_int8(const int8_t* p) {  // 16 int8 -> 16 float, exactly
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  vf16 v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#elif defined(__AVX2__)
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  vf16 v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
#elif defined(__ARM_NEON)
  const int8x16_t b = vld1q_s8(p);
  const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_s8(vget_high_s8(b));
  const float32x4_t f[4] = {vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))),
                            vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)))};
  vf16 v;
  std::memcpy(&v, f, sizeof v);
  return v;
#else
  vb16 b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(__builtin_convertvector(b, vi16), vf16);  // sign-extend, then convert
#endif
}

inline float hsum(vf16 v) {  // a fixed tree: 16 -> 8 -> 4 -> 1
  vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
inline bool all_at_most(vf16 v, float x) {  // every lane <= x
  const vi16 le = v <= splat(x);
  int32_t all = -1;
  for (int l = 0; l < kLanes; ++l) all &= le[l];
  return all != 0;
}
inline float hmax(vf16 v) {  // exact in any order
  float m = v[0];
  for (int l = 1; l < kLanes; ++l) m = v[l] > m ? v[l] : m;
  return m;
}

inline int8_t quantize(float x) {  // half to even, saturated to +-127
  float r = std::nearbyint(x);
  r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
  return static_cast<int8_t>(r);
}

// The cache's element type C: int8_t (Int8KVAttention: codes times the static per-channel scales) or
// float (FloatKVAttention: the values themselves; its graph passes scales of 1, which leave every
// product and quotient below exact). Every other line of the arithmetic is the same for both.
inline vf16 load_kv(const int8_t* p) { return load_int8(p); }
inline vf16 load_kv(const float* p) { return load(p); }
template <typename C>
C to_cache(float x);
template <>
inline int8_t to_cache<int8_t>(float x) { return quantize(x); }
template <>
inline float to_cache<float>(float x) { return x; }
// A row of D values divided by their per-channel scales into the cache's element type (to_cache),
// every element on its own: vectorized where the target has the instructions, the same results.
template <typename C>
inline void to_cache_row(const float* __restrict x, const float* __restrict scale, int64_t D, C* __restrict out) {
  for (int64_t d = 0; d < D; ++d) out[d] = to_cache<C>(x[d] / scale[d]);
}
template <typename C>
struct Names;
template <>
struct Names<int8_t> {
  static constexpr const char* single = "Int8KVAttention: ";
  static constexpr const char* seats = "Int8KVSeatsAttention: ";
};
template <>
struct Names<float> {
  static constexpr const char* single = "FloatKVAttention: ";
  static constexpr const char* seats = "FloatKVSeatsAttention: ";
};

// rotate-half rotary embedding of one head (x: D values), into out. The pointers never overlap (out
// is a local row): declared so, the loops below vectorize, each lane the same operations as a scalar
// element (the compiler contracts the same products in both forms).
inline void rotate(const float* __restrict x, const float* __restrict cos, const float* __restrict sin, int64_t D,
                   float* __restrict out) {
  const int64_t h = D / 2;
  for (int64_t d = 0; d < h; ++d) {
    out[d] = x[d] * cos[d] - x[d + h] * sin[d];
    out[d + h] = x[d + h] * cos[d] + x[d] * sin[d];
  }
}

#if !CABINLM_ATTENTION_HALVES
template <int NV>
vf16 qk_tile_n(const float* q, const float* keys, int64_t D) {
  vf16 qv[NV], v[kLanes];
  for (int c = 0; c < NV; ++c) qv[c] = load(q + c * kLanes);
  for (int l = 0; l < kLanes; ++l) {
    const float* k = keys + l * D;
    vf16 a = qv[0] * load(k);
    for (int c = 1; c < NV; ++c) a += qv[c] * load(k + c * kLanes);
    v[kBitReversed[l]] = a;
  }
  return reduce16(v);
}
#else
// AVX2 (16 registers of 8 floats: reduce16's 16 vectors of 16 would not stay in them): each key's
// products as two vectors of 8 lanes, its 16 lanes summed as soon as they are made by reduce16's own
// tree (m and m+8, then m and m+4, m and m+2, m and m+1), so every score is the other paths' bit for bit.
inline vf8 load8(const float* p) {
  vf8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, vf8 v) { std::memcpy(p, &v, sizeof v); }
constexpr int kHalf = kLanes / 2;

template <int NV>
vf16 qk_tile_n(const float* q, const float* keys, int64_t D) {
  vf8 qv[2 * NV];
  alignas(64) float scores[kLanes];
  for (int c = 0; c < 2 * NV; ++c) qv[c] = load8(q + c * kHalf);
  for (int l = 0; l < kLanes; ++l) {
    const float* k = keys + l * D;
    vf8 lo = qv[0] * load8(k), hi = qv[1] * load8(k + kHalf);
    for (int c = 1; c < NV; ++c) {
      lo += qv[2 * c] * load8(k + c * kLanes);
      hi += qv[2 * c + 1] * load8(k + c * kLanes + kHalf);
    }
    // The products are rounded before the first sum, as the 16-lane path's shuffles leave them: for
    // one vector a row (head_dim 16) lo and hi are plain products, which the compiler would otherwise
    // fuse into the sum below (-ffp-contract=fast) and round once.
    asm("" : "+x"(lo), "+x"(hi));
    const vf8 s8 = lo + hi;
    const vf4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    scores[l] = (s4[0] + s4[2]) + (s4[1] + s4[3]);
  }
  return load(scores);
}
#endif

// The 16 scores q . keys[l] (keys: 16 rows of D floats), lane l for key l.
inline vf16 qk_tile(int64_t nv, const float* q, const float* keys, int64_t D) {
  switch (nv) {
#define CABIN_QK(N) \
  case N:           \
    return qk_tile_n<N>(q, keys, D);
    CABIN_QK(1) CABIN_QK(2) CABIN_QK(3) CABIN_QK(4) CABIN_QK(5) CABIN_QK(6) CABIN_QK(7) CABIN_QK(8)
    CABIN_QK(9) CABIN_QK(10) CABIN_QK(11) CABIN_QK(12) CABIN_QK(13) CABIN_QK(14) CABIN_QK(15) CABIN_QK(16)
#undef CABIN_QK
  }
  return splat(0.0f);
}

#if CABINLM_ATTENTION_HALVES
// AVX2: the sums below are kept as vectors of 8 floats (a register each) rather than 16 (which the
// compiler keeps in memory there); every lane's own sequence of fused multiply-adds is the same.
inline vf8 load8_kv(const float* p) { return load8(p); }
inline vf8 load8_kv(const int8_t* p) {  // 8 int8 -> 8 float, exactly
  return (vf8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int NV>
void pv_tile_n(const float* w, const float* tile, int64_t count, int64_t D, float* o) {
  vf8 acc[2 * NV];
  for (int c = 0; c < 2 * NV; ++c) acc[c] = load8(o + c * kHalf);
  for (int64_t j = 0; j < count; ++j) {
    const float wj = w[j];
    if (wj == 0.0f) continue;  // a masked key: adds exactly nothing
    for (int c = 0; c < 2 * NV; ++c) acc[c] += wj * load8(tile + j * D + c * kHalf);
  }
  for (int c = 0; c < 2 * NV; ++c) store8(o + c * kHalf, acc[c]);
}
#else
template <int NV>
void pv_tile_n(const float* w, const float* tile, int64_t count, int64_t D, float* o) {
  vf16 acc[NV];
  for (int c = 0; c < NV; ++c) acc[c] = load(o + c * kLanes);
  for (int64_t j = 0; j < count; ++j) {
    const float wj = w[j];
    if (wj == 0.0f) continue;  // a masked key: adds exactly nothing
    for (int c = 0; c < NV; ++c) acc[c] += wj * load(tile + j * D + c * kLanes);
  }
  for (int c = 0; c < NV; ++c) store(o + c * kLanes, acc[c]);
}
#endif

// o[0 .. D) += sum over the tile's keys j (in order) of w[j] * tile[j]: D / 16 accumulators in registers.
inline void pv_tile(int64_t nv, const float* w, const float* tile, int64_t count, int64_t D, float* o) {
  switch (nv) {
#define CABIN_PV(N) \
  case N:           \
    return pv_tile_n<N>(w, tile, count, D, o);
    CABIN_PV(1) CABIN_PV(2) CABIN_PV(3) CABIN_PV(4) CABIN_PV(5) CABIN_PV(6) CABIN_PV(7) CABIN_PV(8)
    CABIN_PV(9) CABIN_PV(10) CABIN_PV(11) CABIN_PV(12) CABIN_PV(13) CABIN_PV(14) CABIN_PV(15) CABIN_PV(16)
#undef CABIN_PV
  }
}

// Accumulators held at once for NV vectors each: about 24 of the 32 vector registers (AVX-512, NEON);
// AVX2 has 16 registers of half the width (a vector of 16 floats takes two), so fewer. How many run
// at once never changes an accumulator's own sums.
#if CABINLM_ATTENTION_HALVES
constexpr int many_for(int nv) { return nv <= 2 ? 2 : 1; }
#else
constexpr int many_for(int nv) { return nv <= 4 ? 6 : (nv <= 8 ? 3 : 1); }
#endif

// A plain tile's P V for several accumulators at once (rows and heads that all see the tile's values
// alike): o[a][0 .. D) += sum over the tile's keys j (in order) of w[a][j] * rows[j], for a < A, each
// row's values converted (load_kv: the cache's own rows, int8 or float, or a tile converted already)
// into registers once and met there by every accumulator. Each accumulator is pv_tile_n's, term for
// term; interleaving A of them (A * NV registers) keeps the FMA units busy where one accumulator's
// chain waits on its own latency. A key of weight 0 is not skipped here: it adds +-0 to a sum that is
// never -0 (it starts at +0, and x + -x is +0), which leaves every sum bit for bit as pv_tile_n's skip does.
#if CABINLM_ATTENTION_HALVES
template <int NV, int A, typename C>
void pv_many_n(const float* const* w, const C* rows, int64_t count, int64_t D, float* const* o) {
  vf8 acc[A][2 * NV];
  for (int a = 0; a < A; ++a)
    for (int c = 0; c < 2 * NV; ++c) acc[a][c] = load8(o[a] + c * kHalf);
  for (int64_t j = 0; j < count; ++j) {
    vf8 v[2 * NV];
    for (int c = 0; c < 2 * NV; ++c) v[c] = load8_kv(rows + j * D + c * kHalf);
    for (int a = 0; a < A; ++a) {
      const float wj = w[a][j];
      for (int c = 0; c < 2 * NV; ++c) acc[a][c] += wj * v[c];
    }
  }
  for (int a = 0; a < A; ++a)
    for (int c = 0; c < 2 * NV; ++c) store8(o[a] + c * kHalf, acc[a][c]);
}
#else
template <int NV, int A, typename C>
void pv_many_n(const float* const* w, const C* rows, int64_t count, int64_t D, float* const* o) {
  vf16 acc[A][NV];
  for (int a = 0; a < A; ++a)
    for (int c = 0; c < NV; ++c) acc[a][c] = load(o[a] + c * kLanes);
  for (int64_t j = 0; j < count; ++j) {
    vf16 v[NV];
    for (int c = 0; c < NV; ++c) v[c] = load_kv(rows + j * D + c * kLanes);
    for (int a = 0; a < A; ++a) {
      const float wj = w[a][j];
      for (int c = 0; c < NV; ++c) acc[a][c] += wj * v[c];
    }
  }
  for (int a = 0; a < A; ++a)
    for (int c = 0; c < NV; ++c) store(o[a] + c * kLanes, acc[a][c]);
}
#endif

template <int NV, typename C>
void pv_many_nv(const float* const* w, const C* rows, int64_t count, int64_t D, float* const* o, int64_t n) {
  constexpr int kMost = many_for(NV);
  for (int64_t a0 = 0; a0 < n; a0 += kMost) {
    const int64_t k = std::min<int64_t>(kMost, n - a0);
    switch (k) {
#define CABIN_MANY(K)                                                                \
  case K:                                                                            \
    if constexpr (K <= kMost) pv_many_n<NV, K, C>(w + a0, rows, count, D, o + a0);   \
    break;
      CABIN_MANY(1) CABIN_MANY(2) CABIN_MANY(3) CABIN_MANY(4) CABIN_MANY(5) CABIN_MANY(6)
#undef CABIN_MANY
    }
  }
}

// pv_tile for n accumulators over one plain tile's rows (w[a], o[a]: accumulator a's weights and
// sums), many_for(nv) accumulators a pass.
template <typename C>
inline void pv_many(int64_t nv, const float* const* w, const C* rows, int64_t count, int64_t D, float* const* o, int64_t n) {
  switch (nv) {
#define CABIN_PVM(N) \
  case N:            \
    return pv_many_nv<N, C>(w, rows, count, D, o, n);
    CABIN_PVM(1) CABIN_PVM(2) CABIN_PVM(3) CABIN_PVM(4) CABIN_PVM(5) CABIN_PVM(6) CABIN_PVM(7) CABIN_PVM(8)
    CABIN_PVM(9) CABIN_PVM(10) CABIN_PVM(11) CABIN_PVM(12) CABIN_PVM(13) CABIN_PVM(14) CABIN_PVM(15) CABIN_PVM(16)
#undef CABIN_PVM
  }
}

// Rows of the cache (rows * D elements from src, contiguous) converted to float into dst: D / 16
// vectors a row, the count known to the compiler (an unrolled loop per head_dim).
template <int NV, typename C>
void rows_to_float_n(const C* __restrict src, int64_t rows, float* __restrict dst) {
#if CABINLM_ATTENTION_HALVES
  for (int64_t j = 0; j < rows; ++j)
    for (int c = 0; c < 2 * NV; ++c) store8(dst + (j * 2 * NV + c) * kHalf, load8_kv(src + (j * 2 * NV + c) * kHalf));
#else
  for (int64_t j = 0; j < rows; ++j)
    for (int c = 0; c < NV; ++c) store(dst + (j * NV + c) * kLanes, load_kv(src + (j * NV + c) * kLanes));
#endif
}
template <typename C>
inline void rows_to_float(int64_t nv, const C* src, int64_t rows, float* dst) {
  switch (nv) {
#define CABIN_RTF(N) \
  case N:            \
    return rows_to_float_n<N, C>(src, rows, dst);
    CABIN_RTF(1) CABIN_RTF(2) CABIN_RTF(3) CABIN_RTF(4) CABIN_RTF(5) CABIN_RTF(6) CABIN_RTF(7) CABIN_RTF(8)
    CABIN_RTF(9) CABIN_RTF(10) CABIN_RTF(11) CABIN_RTF(12) CABIN_RTF(13) CABIN_RTF(14) CABIN_RTF(15) CABIN_RTF(16)
#undef CABIN_RTF
  }
}

template <typename C>
struct Problem {
  const float* qkv;
  C* keys;  // (Hkv, R, D) int8 codes or floats
  C* values;
  const float* cos;
  const float* sin;
  const int64_t* position_ids;
  const float* bias;
  const float* k_scale;
  const float* v_scale;
  float* out;
  int64_t n, F, T, R, H, Hkv, D, group, rope_rows, blocks;
  float scale;
  // The rows as one-token steps (inputs 11..15; without them K = 0, slots F, F+1, ... and every row
  // sees the same keys): X[i] the row's own position, codes below.
  const float* source = nullptr;   // this layer's (Hkv, P, D) un-rotated sink / pinned keys
  const float* src_cos = nullptr;  // (V, K, D / 2)
  const float* src_sin = nullptr;
  const int64_t* slots = nullptr;  // (n,) or null
  const int64_t* X = nullptr;      // (n,)
  C* step = nullptr;               // (V, Hkv, K, D): the sink / pinned keys as each version sees them
  int64_t P = 0, K = 0, V = 1;
  bool uniform = true;  // every row sees the same key at every position it sees (no slot table, V = 1)
  // Each unit rotates the step keys it reads (its kv head's, in its rows' versions) at its start,
  // instead of write_seat before any unit runs: where no two units read the same ones (one version per
  // row, or a single block of rows: a decode step).
  bool unit_step_keys = false;
};

template <typename C>
void rotate_step_keys(const Problem<C>& p, int64_t v, int64_t g);
template <typename C>
__attribute__((always_inline)) inline void fetch_step_sources(const Problem<C>& p, int64_t i0, int64_t i1, int64_t g);

// --- the order of memory reads --------------------------------------------------------------------
//
// Inside a decode step a unit's cached keys and values come from memory (the layers' weights stream
// through the caches between two attentions), in short runs: kv head g's keys rows 0 .. L-1, then its
// values, then the next unit's keys. A core's own prefetchers learn each run anew, so a unit asks for
// its rows kAhead rows before it converts them, along one stream that runs on from its keys into its
// values and from its values into the keys of the unit its thread most likely takes next (the first
// one not yet claimed). These are hints: they change no arithmetic, only when lines arrive.
constexpr int64_t kAhead = 64;

template <typename C>
struct Units;

// One unit's stream of rows, asked for ahead of their use: its rows but the dead ones (attend's hole),
// counted without them.
template <typename C>
struct ReadAhead {
  const C* keys;
  const C* values;
  int64_t rows, D;        // rows: the keys' (and the values') share of the stream, the hole left out
  int64_t hole_at, hole;  // the hole's first row and its length (0: none)
  const Units<C>* units;  // where the next unit is found (null: no next unit)
  // The next unit's keys, found when the stream first reaches them (by then the other threads have
  // claimed their next units, so the first one not yet claimed is most likely this thread's).
  bool resolved = false;
  const C* next_keys = nullptr;
  int64_t next_rows = 0;
  // Asks for stream positions from .. from+count-1: keys rows, then values rows, then the next unit's keys.
  void fetch(int64_t from, int64_t count);
  // The stream position of row j (not in the hole).
  int64_t at(int64_t j) const { return j < hole_at ? j : j - hole; }
  // Stream positions a .. b-1 of the keys' (or values') share, from `base`: the rows around the hole.
  __attribute__((always_inline)) void fetch_rows(const C* base, int64_t a, int64_t b) const;
};

// A bias at or below kMaskedBias weighs exactly 0 beside a row's own position seen with a bias above
// kSeenBias (0, as the runtime gives it): their scores lie further apart than 87 (exp_nonpositive's 0),
// whatever the products add.
constexpr float kMaskedBias = -1e29f;
constexpr float kSeenBias = -1e20f;

// What row i sees at position j, as a code: >= 0 a row of the key / value buffers (a cached token's
// slot, or F + m for chunk row m); kStepKey - v the sink / pinned key at j in version v (its value is
// the cache's, row j); kEmpty nothing (weight 0).
constexpr int32_t kEmpty = -1;
constexpr int32_t kStepKey = -2;

template <typename C>
inline int64_t version_of(const Problem<C>& p, int64_t i) { return p.V == 1 ? 0 : i; }

// The codes of rows i0 .. i0+B-1 over positions 0 .. L-1, into codes[b * L + j]:
//   j < F: the cache's (the first K: the step keys); j >= F: empty; then slots[m] = F + m for the
//   rows m < i before it (the latest wins), and X[i] = F + i, the row itself.
template <typename C>
void row_codes(const Problem<C>& p, int64_t i0, int64_t B, int64_t L, int32_t* codes) {
  for (int64_t b = 0; b < B; ++b) {
    const int64_t i = i0 + b;
    int32_t* c = codes + b * L;
    const int32_t step = static_cast<int32_t>(kStepKey - version_of(p, i));
    for (int64_t j = 0; j < L; ++j) c[j] = j < p.F ? (j < p.K ? step : static_cast<int32_t>(j)) : kEmpty;
    for (int64_t m = 0; m < i; ++m) c[p.slots[m]] = static_cast<int32_t>(p.F + m);
    c[p.X[i]] = static_cast<int32_t>(p.F + i);
  }
}

// The uniform case's code, without a table: j up to the row's own position, the first K step keys.
template <typename C>
inline int32_t uniform_code(const Problem<C>& p, int64_t i, int64_t j) {
  return j <= p.F + i ? (j < p.K ? kStepKey : static_cast<int32_t>(j)) : kEmpty;
}

template <typename C>
inline const C* key_row(const Problem<C>& p, int64_t g, int32_t code, int64_t j) {
  if (code >= 0) return p.keys + (g * p.R + code) * p.D;
  return p.step + (((kStepKey - code) * p.Hkv + g) * p.K + j) * p.D;
}
inline int32_t value_code(int32_t code, int64_t j) { return code >= 0 ? code : (code == kEmpty ? kEmpty : static_cast<int32_t>(j)); }

// Rows i0 .. i1-1 (at most kRowBlock) and kv head g: every query head of the group. Each row's
// arithmetic is the same sequence whatever block it is computed in: the keys at its positions 0..X[i]
// in position order, a position's score a function of (query, key, bias) alone.
template <typename C>
void attend(const Problem<C>& p, int64_t i0, int64_t i1, int64_t g, const Units<C>* units) {
  const int64_t D = p.D, V16 = D / kLanes, G = p.group, W = (p.H + 2 * p.Hkv) * D;
  const int64_t B = i1 - i0;
  int64_t Lmax = 0;  // positions any row of the block sees
  for (int64_t b = 0; b < B; ++b) Lmax = std::max(Lmax, p.X[i0 + b] + 1);
  const int64_t stride = (Lmax + kLanes - 1) / kLanes * kLanes;
  const float* ks = p.k_scale + g * D;
  const float* vs = p.v_scale + g * D;
  const C* V = p.values + g * p.R * D;
  fetch_step_sources(p, i0, i1, g);  // rotate_step_keys below reads them first (the unit before may have asked)

  thread_local std::vector<int32_t> table;
  if (!p.uniform) {
    table.resize(static_cast<size_t>(B * Lmax));
    row_codes(p, i0, B, Lmax, table.data());
  }
  auto code = [&](int64_t b, int64_t j) -> int32_t {
    return p.uniform ? uniform_code(p, i0 + b, j) : table[static_cast<size_t>(b * Lmax + j)];
  };
  // A plain tile: positions j0 .. j0+width-1 below F that every row of the block sees alike -- the
  // step keys of one version (V = 1) or the cache's rows, none a slot an earlier chunk row took (rows
  // as steps after the window turned over). Position j's code is then kStepKey (j < K) or j itself for
  // every row, so such a tile skips the codes: its keys are step_rows[j] / the cache's row j, its values
  // and bias the cache's and the bias's column j -- the same arithmetic on the same operands.
  thread_local std::vector<int64_t> taken;  // slots below F some row of the block sees a chunk row in
  taken.clear();
  if (!p.uniform)
    for (int64_t m = 0; m + 1 < i1; ++m)
      if (p.slots[m] < p.F) taken.push_back(p.slots[m]);
  auto plain_tile = [&](int64_t j0, int64_t width) {
    if (j0 + width > p.F || (j0 < p.K && p.V != 1)) return false;
    for (const int64_t s : taken)
      if (s >= j0 && s < j0 + width) return false;
    return true;
  };
  // The hole: positions h0 .. h1-1 no row of the block sees, skipped -- whole plain tiles of kTile
  // from the first after the step keys (the pinned slots a short system prompt leaves empty) whose bias
  // masks every position for every row (kMaskedBias), where each row sees its own position. Their keys
  // would score the bias, weigh exactly 0 and add exactly 0 to the softmax's sum and to every
  // accumulator (which start at +0 and so never hold -0): nothing changes but the work and the reads.
  const int64_t h0 = std::max<int64_t>((p.K + kTile - 1) / kTile * kTile, kTile);  // tile 0 always scored
  int64_t h1 = h0;
  bool own_visible = true;
  for (int64_t b = 0; b < B; ++b) own_visible = own_visible && p.bias[(i0 + b) * p.T + p.F + i0 + b] > kSeenBias;
  for (bool dead = own_visible; dead && h1 + kTile <= Lmax; h1 += dead ? kTile : 0) {
    dead = plain_tile(h1, kTile);
    for (int64_t b = 0; b < B && dead; ++b)
      for (int64_t l = 0; l < kTile && dead; l += kLanes) dead = all_at_most(load(p.bias + (i0 + b) * p.T + h1 + l), kMaskedBias);
  }
  ReadAhead<C> ahead{p.keys + g * p.R * D, V, Lmax - (h1 - h0), D, h0, h1 - h0, units};
  ahead.fetch(0, kAhead);  // the first rows at once (the unit before may have asked for them already)
  if (p.unit_step_keys)  // the step keys this unit reads: kv head g's, in its rows' versions (write_seat)
    for (int64_t v = version_of(p, i0), last = version_of(p, i1 - 1); v <= last; ++v) rotate_step_keys(p, v, g);
  const C* step_rows = p.K > 0 ? p.step + g * p.K * D : nullptr;  // version 0's step keys of this kv head

  alignas(64) float q[kRowBlock][kMaxGroup][kMaxHeadDim];
  for (int64_t b = 0; b < B; ++b) {
    const int64_t i = i0 + b, pos = p.position_ids[i];
    for (int64_t r = 0; r < G; ++r) {
      float rotated[kMaxHeadDim];
      rotate(p.qkv + i * W + (g * G + r) * D, p.cos + pos * (D / 2), p.sin + pos * (D / 2), D, rotated);
      for (int64_t d = 0; d < D; ++d) q[b][r][d] = rotated[d] * ks[d] * p.scale;  // the key scale folded in
    }
  }

  // Q K^T, 16 positions at a time: the keys most rows see there (`shared`, the first row's that sees
  // each position) converted to float once, then per row and head (qk_tile) each key's products
  // summed over 16 lanes and the lanes of 16 keys reduced together, one fixed tree for every key; a
  // row that sees another key at some position (a chunk row in a slot, its own version of a step
  // key) gets its own copy of the tile with those keys. scores[b][r][0 .. stride): row b's keys,
  // biased; positions it does not see -1e30 (weight 0).
  thread_local std::vector<float> scores;
  scores.resize(static_cast<size_t>(B * G * stride));
  alignas(64) float keys[kLanes * kMaxHeadDim];
  alignas(64) float own[kLanes * kMaxHeadDim];
  const C* K0 = p.keys + g * p.R * D;  // this kv head's cached keys, row after row
  for (int64_t j0 = 0; j0 < Lmax; j0 += kLanes) {
    if (j0 == h0) j0 = h1;  // over the hole (h1 < Lmax: it ends below F)
    ahead.fetch(ahead.at(j0) + kAhead, kLanes);  // keys kAhead rows on (then the values, which follow them)
    if (plain_tile(j0, kLanes)) {  // every row sees the same keys at j0 .. j0+15: the step keys, then the cache's
      if (j0 >= p.K) {  // the cache's rows j0 .. j0+15, contiguous
        rows_to_float(V16, K0 + j0 * D, kLanes, keys);
      } else {
        for (int64_t l = 0; l < kLanes; ++l) {
          const int64_t j = j0 + l;
          rows_to_float(V16, j < p.K ? step_rows + j * D : K0 + j * D, 1, keys + l * D);
        }
      }
      for (int64_t b = 0; b < B; ++b) {
        const vf16 bv = load(p.bias + (i0 + b) * p.T + j0);
        for (int64_t r = 0; r < G; ++r) store(scores.data() + (b * G + r) * stride + j0, qk_tile(V16, q[b][r], keys, D) + bv);
      }
      continue;
    }
    int32_t shared[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) {
      shared[l] = kEmpty;
      for (int64_t b = 0; b < B && j0 + l < Lmax; ++b)
        if ((shared[l] = code(b, j0 + l)) != kEmpty) break;
    }
    for (int64_t l = 0; l < kLanes; ++l)
      for (int64_t c = 0; c < V16; ++c)
        store(keys + l * D + c * kLanes,
              shared[l] != kEmpty ? load_kv(key_row(p, g, shared[l], j0 + l) + c * kLanes) : splat(0.0f));
    for (int64_t b = 0; b < B; ++b) {
      const int64_t i = i0 + b;
      alignas(64) float bias[kLanes];
      bool mine = false;  // this row sees another key than `shared` somewhere in the tile
      for (int64_t l = 0; l < kLanes; ++l) {
        const int32_t c = j0 + l < Lmax ? code(b, j0 + l) : kEmpty;
        bias[l] = c == kEmpty ? -1e30f : p.bias[i * p.T + (c >= 0 ? c : j0 + l)];
        mine |= c != kEmpty && c != shared[l];
      }
      const float* tile = keys;
      if (mine) {
        std::memcpy(own, keys, sizeof(float) * kLanes * D);
        for (int64_t l = 0; l < kLanes; ++l) {
          const int32_t c = j0 + l < Lmax ? code(b, j0 + l) : kEmpty;
          if (c != kEmpty && c != shared[l])
            for (int64_t k = 0; k < V16; ++k) store(own + l * D + k * kLanes, load_kv(key_row(p, g, c, j0 + l) + k * kLanes));
        }
        tile = own;
      }
      const vf16 bv = load(bias);
      for (int64_t r = 0; r < G; ++r) store(scores.data() + (b * G + r) * stride + j0, qk_tile(V16, q[b][r], tile, D) + bv);
    }
  }

  float inv_sum[kRowBlock][kMaxGroup];
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < G; ++r) {
      float* s = scores.data() + (b * G + r) * stride;
      const int64_t Ls = (p.X[i0 + b] + 1 + kLanes - 1) / kLanes * kLanes;  // this row's lanes
#if CABINLM_ATTENTION_HALVES  // the same lanes as two vectors of 8: each lane's own operations
      vf8 m_lo = load8(s), m_hi = load8(s + kHalf);  // the maximum over its lanes but the hole's (exact in any order)
      for (int64_t j = kLanes; j < Ls; j += kLanes) {
        if (j == h0) j = h1;  // h1 < Ls: every row sees F
        const vf8 x_lo = load8(s + j), x_hi = load8(s + j + kHalf);
        m_lo = x_lo > m_lo ? x_lo : m_lo;
        m_hi = x_hi > m_hi ? x_hi : m_hi;
      }
      const vf8 both = m_lo > m_hi ? m_lo : m_hi;
      float top = both[0];
      for (int l = 1; l < kHalf; ++l) top = both[l] > top ? both[l] : top;
      const vf8 mx = vf8{} + top;
      vf8 acc_lo = vf8{}, acc_hi = vf8{};
      for (int64_t j = 0; j < Ls; j += kLanes) {
        if (j == h0) j = h1;
        const vf8 e_lo = exp_nonpositive(load8(s + j) - mx), e_hi = exp_nonpositive(load8(s + j + kHalf) - mx);
        store8(s + j, e_lo);
        store8(s + j + kHalf, e_hi);
        acc_lo += e_lo;
        acc_hi += e_hi;
      }
      const vf8 a = acc_lo + acc_hi;  // hsum's tree: lanes m and m+8, then m and m+4, then m+2, m+1
      const vf4 f4 = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
      inv_sum[b][r] = 1.0f / ((f4[0] + f4[2]) + (f4[1] + f4[3]));
#else
      vf16 m = load(s);  // the maximum over its lanes but the hole's (exact in any order)
      for (int64_t j = kLanes; j < Ls; j += kLanes) {
        if (j == h0) j = h1;  // h1 < Ls: every row sees F
        const vf16 x = load(s + j);
        m = x > m ? x : m;
      }
      const vf16 mx = splat(hmax(m));
      vf16 acc = splat(0.0f);
      for (int64_t j = 0; j < Ls; j += kLanes) {
        if (j == h0) j = h1;
        const vf16 e = exp_nonpositive(load(s + j) - mx);
        store(s + j, e);
        acc += e;
      }
      inv_sum[b][r] = 1.0f / hsum(acc);
#endif
    }

  // P V, a tile of positions at a time: the values most rows see converted to float once (a row
  // that sees another value somewhere gets its own copy), each row and head's accumulators held in
  // registers over the tile (pv_tile); every accumulator still adds its keys' terms one position
  // after the other, in position order.
  alignas(64) float o[kRowBlock][kMaxGroup][kMaxHeadDim];
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < G; ++r) std::memset(o[b][r], 0, sizeof(float) * D);
  alignas(64) float tile[kTile * kMaxHeadDim];
  thread_local std::vector<float> own_values;
  float* sums[kRowBlock * kMaxGroup];  // accumulator b * G + r: row b's head r (pv_many)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < G; ++r) sums[b * G + r] = o[b][r];
  const float* weights[kRowBlock * kMaxGroup];
  for (int64_t j0 = 0; j0 < Lmax; j0 += kTile) {
    if (j0 == h0) j0 = h1;
    ahead.fetch(ahead.rows + ahead.at(j0) + kAhead, kTile);  // values kAhead rows on (then the next unit's keys)
    const int64_t count = std::min<int64_t>(kTile, Lmax - j0);
    if (plain_tile(j0, kTile)) {  // every row sees the cache's values j0 .. j0+31 as they are
      for (int64_t a = 0; a < B * G; ++a) weights[a] = scores.data() + a * stride + j0;
      if (B * G <= many_for(static_cast<int>(V16))) {  // one pass: each value converted as it is met
        pv_many(V16, weights, V + j0 * D, kTile, D, sums, B * G);
      } else {  // several passes: the values converted once, into the tile
        rows_to_float(V16, V + j0 * D, kTile, tile);
        pv_many(V16, weights, static_cast<const float*>(tile), kTile, D, sums, B * G);
      }
      continue;
    }
    int32_t shared[kTile];
    for (int64_t j = 0; j < count; ++j) {
      shared[j] = kEmpty;
      for (int64_t b = 0; b < B; ++b)
        if ((shared[j] = value_code(code(b, j0 + j), j0 + j)) != kEmpty) break;
      if (shared[j] != kEmpty)
        for (int64_t c = 0; c < V16; ++c) store(tile + j * D + c * kLanes, load_kv(V + shared[j] * D + c * kLanes));
    }
    for (int64_t b = 0; b < B; ++b) {
      const int64_t mine = std::min<int64_t>(count, p.X[i0 + b] + 1 - j0);  // this row's positions in the tile
      if (mine <= 0) continue;
      const float* t = tile;
      if (!p.uniform) {
        bool differs = false;
        for (int64_t j = 0; j < mine && !differs; ++j) {
          const int32_t c = value_code(code(b, j0 + j), j0 + j);
          differs = c != kEmpty && c != shared[j];
        }
        if (differs) {
          own_values.resize(static_cast<size_t>(kTile * D));
          float* w = own_values.data();
          for (int64_t j = 0; j < mine; ++j) {
            const int32_t c = value_code(code(b, j0 + j), j0 + j);
            if (c == kEmpty) continue;  // weight 0: never read
            if (c == shared[j]) {
              std::memcpy(w + j * D, tile + j * D, sizeof(float) * D);
            } else {
              for (int64_t k = 0; k < V16; ++k) store(w + j * D + k * kLanes, load_kv(V + c * D + k * kLanes));
            }
          }
          t = w;
        }
      }
      for (int64_t r = 0; r < G; ++r) pv_tile(V16, scores.data() + (b * G + r) * stride + j0, t, mine, D, o[b][r]);
    }
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < G; ++r) {
      float* out = p.out + (i0 + b) * p.H * D + (g * G + r) * D;
      for (int64_t d = 0; d < D; ++d) out[d] = o[b][r][d] * inv_sum[b][r] * vs[d];
    }
}

// The sink / pinned keys of version v and kv head g: rotated from key_source by that version's
// source_cos / source_sin and quantized exactly as write_rows quantizes a chunk's keys. Whichever
// thread does it, the same operations on the same inputs: the same codes.
template <typename C>
void rotate_step_keys(const Problem<C>& p, int64_t v, int64_t g) {
  const int64_t D = p.D;
  const float* ks = p.k_scale + g * D;
  float rotated[kMaxHeadDim];
  for (int64_t r = 0; r < p.K; ++r) {
    const int64_t t = (v * p.K + r) * (D / 2);
    rotate(p.source + (g * p.P + r) * D, p.src_cos + t, p.src_sin + t, D, rotated);
    C* k = p.step + ((v * p.Hkv + g) * p.K + r) * D;
    to_cache_row<C>(rotated, ks, D, k);
  }
}

template <typename C>
void step_keys_unit(void* data, size_t unit) {
  const Problem<C>& p = *static_cast<const Problem<C>*>(data);
  rotate_step_keys(p, static_cast<int64_t>(unit) / p.Hkv, static_cast<int64_t>(unit) % p.Hkv);
}

// The chunk's new keys (rotated) and values, quantized into cache rows F .. F+n-1.
template <typename C>
void write_rows(const Problem<C>& p) {
  const int64_t D = p.D, W = (p.H + 2 * p.Hkv) * D;
  float rotated[kMaxHeadDim];
  for (int64_t i = 0; i < p.n; ++i) {
    const float* row = p.qkv + i * W;
    const int64_t pos = p.position_ids[i];
    for (int64_t g = 0; g < p.Hkv; ++g) {
      const float* ks = p.k_scale + g * D;
      const float* vs = p.v_scale + g * D;
      rotate(row + (p.H + g) * D, p.cos + pos * (D / 2), p.sin + pos * (D / 2), D, rotated);
      C* k = p.keys + (g * p.R + p.F + i) * D;
      C* v = p.values + (g * p.R + p.F + i) * D;
      const float* vin = row + (p.H + p.Hkv + g) * D;
      to_cache_row<C>(rotated, ks, D, k);
      to_cache_row<C>(vin, vs, D, v);
    }
  }
}

// One parallel_for's units: seat s's (block of rows, kv head) pairs are units first[s] ..
// first[s+1]-1. Each call of the parallel_for's function claims the next unit in order (so the units
// run in order, and a unit can tell which one comes next: the first not yet claimed).
template <typename C>
struct Units {
  const Problem<C>* seats;
  const size_t* first;
  size_t count, total;  // seats, units
  std::atomic<size_t> next{0};

  struct Unit {
    const Problem<C>* p;
    int64_t i0, i1, g;
  };
  Unit at(size_t u) const {
    const size_t s = static_cast<size_t>(std::upper_bound(first, first + count, u) - first) - 1;
    const Problem<C>& p = seats[s];
    const int64_t local = static_cast<int64_t>(u - first[s]), block = local / p.Hkv;
    return {&p, block * kRowBlock, std::min(p.n, (block + 1) * kRowBlock), local % p.Hkv};
  }
};

// Every line of rows r0 .. r1-1 of `base` (contiguous), asked for in one pass. Always inlined, as is
// every function that asks for lines: GCC counts a prefetch as no side effect, so a function that only
// asks for lines and returns nothing is found pure (ipa-pure-const) and its calls dropped as dead code.
template <typename C>
__attribute__((always_inline)) inline void fetch_lines(const C* base, int64_t r0, int64_t r1, int64_t D) {
  constexpr uintptr_t kLine = 64;
  const uintptr_t end = reinterpret_cast<uintptr_t>(base + r1 * D);
  for (uintptr_t a = reinterpret_cast<uintptr_t>(base + r0 * D) & ~(kLine - 1); a < end; a += kLine)
    __builtin_prefetch(reinterpret_cast<const char*>(a));
}

template <typename C>
__attribute__((always_inline)) inline void ReadAhead<C>::fetch_rows(const C* base, int64_t a, int64_t b) const {
  if (a < std::min(b, hole_at)) fetch_lines(base, a, std::min(b, hole_at), D);
  if (b > hole_at) fetch_lines(base, std::max(a, hole_at) + hole, b + hole, D);
}

// What a unit that rotates its own step keys reads before anything else (rotate_step_keys): kv head
// g's un-rotated sink / pinned keys and its rows' versions of their rotation, a few kB that come from
// memory at every layer (the weights stream through the caches in between); asked for by the unit
// before it (ReadAhead) and again at its start (a thread's first unit).
template <typename C>
__attribute__((always_inline)) inline void fetch_step_sources(const Problem<C>& p, int64_t i0, int64_t i1, int64_t g) {
  if (!p.unit_step_keys) return;
  const int64_t h = p.D / 2;
  fetch_lines(p.source + g * p.P * p.D, 0, p.K, p.D);
  for (int64_t v = version_of(p, i0), last = version_of(p, i1 - 1); v <= last; ++v) {
    fetch_lines(p.src_cos + v * p.K * h, 0, p.K, h);
    fetch_lines(p.src_sin + v * p.K * h, 0, p.K, h);
  }
}

template <typename C>
void ReadAhead<C>::fetch(int64_t from, int64_t count) {
  const int64_t end = from + count;  // stream positions: keys rows, values rows, the next unit's keys rows
  if (from < rows) fetch_rows(keys, from, std::min(end, rows));
  if (end > rows && from < 2 * rows) fetch_rows(values, std::max(from, rows) - rows, std::min(end, 2 * rows) - rows);
  if (end <= 2 * rows) return;
  if (!resolved) {
    resolved = true;
    const size_t u = units == nullptr ? 0 : units->next.load(std::memory_order_relaxed);
    if (units != nullptr && u < units->total) {
      const typename Units<C>::Unit n = units->at(u);
      next_keys = n.p->keys + n.g * n.p->R * n.p->D;
      next_rows = n.p->X[n.i1 - 1] + 1;
      fetch_step_sources(*n.p, n.i0, n.i1, n.g);  // what that unit reads first
    }
  }
  const int64_t r0 = std::max(from, 2 * rows) - 2 * rows, r1 = std::min(end - 2 * rows, next_rows);
  if (r0 < r1) fetch_lines(next_keys, r0, r1, D);
}

template <typename C>
void attend_claimed(void* data, size_t) {
  Units<C>& w = *static_cast<Units<C>*>(data);
  const typename Units<C>::Unit u = w.at(w.next.fetch_add(1, std::memory_order_relaxed));
  attend(*u.p, u.i0, u.i1, u.g, &w);
}

// Inputs 11..15, where given: the slot table's view of the rows (the header's "rows as steps").
template <typename C>
OrtStatus* step_inputs(OrtKernelContext* ctx, size_t count, size_t base, Problem<C>& p, std::vector<int64_t>& X,
                       std::vector<C>& step) {
  X.resize(static_cast<size_t>(p.n));
  const char* const where = Names<C>::single;  // a std::string only on an error's path
  if (count <= 11) {  // the exported graph's chunk semantics: every row sees the cache and the rows before it
    for (int64_t i = 0; i < p.n; ++i) X[i] = p.F + i;
    p.X = X.data();
    return nullptr;
  }
  if (count != 16) return error(kInvalidArgument, std::string(where) + "takes 11 inputs or 16, got " + std::to_string(count));
  const OrtValue* in[5];
  for (size_t i = 0; i < 5; ++i) {
    CABIN_TRY(input(ctx, base + 10 + i, &in[i]));  // the single node's input 11 + i
    if (in[i] == nullptr) return error(kInvalidArgument, std::string(where) + "inputs 11..15 come together; input " + std::to_string(11 + i) + " is missing");
  }
  thread_local std::vector<int64_t> dsrc, dc, ds, dl, dslots;  // reused: no allocation per call
  CABIN_TRY(dims_of(in[0], &dsrc));
  CABIN_TRY(dims_of(in[1], &dc));
  CABIN_TRY(dims_of(in[2], &ds));
  CABIN_TRY(dims_of(in[3], &dl));
  CABIN_TRY(dims_of(in[4], &dslots));
  int64_t layer_count = dsrc.size() == 4 ? dsrc[1] / p.Hkv : 0;
  if (dsrc.size() != 4 || dsrc[0] != 1 || dsrc[1] % p.Hkv != 0 || dsrc[3] != p.D || dc.size() != 3 || dc != ds ||
      dc[2] * 2 != p.D || (dc[0] != 1 && dc[0] != p.n) || dl.size() > 1 || (dl.size() == 1 && dl[0] != 1) ||
      dslots.size() != 1 || dslots[0] != p.n)
    return error(kInvalidArgument, std::string(where) + "key_source " + shape_str(dsrc) + ", source_cos / sin " + shape_str(dc) + " / " +
                                       shape_str(ds) + ", layer " + shape_str(dl) + " or row_slots " + shape_str(dslots) +
                                       " are not (1, layers * kv_heads, rows, head_dim), two equal (1 or tokens, rows, head_dim / 2), "
                                       "one index and (tokens,)");
  p.P = dsrc[2];
  p.V = dc[0];
  p.K = dc[1];
  if (p.K > p.P || p.K > p.F)
    return error(kInvalidArgument, std::string(where) + std::to_string(p.K) + " sink / pinned rows to rotate, but key_source holds " +
                                       std::to_string(p.P) + " and " + std::to_string(p.F) + " slots are in use");
  const int64_t* layer = nullptr;
  const float* source = nullptr;
  CABIN_TRY(data_of(in[0], &source));
  CABIN_TRY(data_of(in[1], &p.src_cos));
  CABIN_TRY(data_of(in[2], &p.src_sin));
  CABIN_TRY(data_of(in[3], &layer));
  CABIN_TRY(data_of(in[4], &p.slots));
  if (*layer < 0 || *layer >= layer_count)
    return error(kInvalidArgument, std::string(where) + "layer " + std::to_string(*layer) + " is not one of key_source's " + std::to_string(layer_count));
  p.source = source + *layer * p.Hkv * p.P * p.D;
  // X[i] = max(F, 1 + slots[0 .. i-1]); every slot a position after the step keys, inside the buffers
  int64_t x = p.F;
  p.uniform = p.V == 1;
  for (int64_t i = 0; i < p.n; ++i) {
    X[i] = x;
    const int64_t s = p.slots[i];
    if (s < p.K || s >= p.R)
      return error(kInvalidArgument, std::string(where) + "row_slots[" + std::to_string(i) + "] = " + std::to_string(s) + " is not a slot after the " +
                                         std::to_string(p.K) + " sink / pinned rows and below " + std::to_string(p.R));
    p.uniform = p.uniform && s == p.F + i;
    x = std::max(x, s + 1);
  }
  p.X = X.data();
  step.resize(static_cast<size_t>(p.V * p.Hkv * p.K * p.D));
  p.step = step.data();
  return nullptr;
}

// One seat's problem: its rows of qkv (rows row0 .. row0 + n - 1 of the (1, rows, width) input),
// its other inputs at ctx indices base .. base + 14 (the single node's inputs 1 .. 15), its output
// rows of `out`. Checks every shape; runs nothing.
template <typename C>
OrtStatus* prepare(OrtKernelContext* ctx, const std::vector<int64_t>& dq, const float* qkv, int64_t n, int64_t row0,
                   size_t base, size_t count, float* out, Problem<C>& p, std::vector<int64_t>& X, std::vector<C>& step) {
  const OrtValue* in[11];
  thread_local std::vector<int64_t> dk, dv, dc, db, dp, dsk, dsv;  // reused: no allocation per call
  for (size_t i = 1; i < 11; ++i) CABIN_TRY(input(ctx, base + i - 1, &in[i]));
  CABIN_TRY(dims_of(in[1], &dk));
  CABIN_TRY(dims_of(in[2], &dv));
  CABIN_TRY(dims_of(in[5], &dc));
  CABIN_TRY(dims_of(in[7], &dp));
  CABIN_TRY(dims_of(in[8], &db));
  CABIN_TRY(dims_of(in[9], &dsk));
  CABIN_TRY(dims_of(in[10], &dsv));
  const char* const where = Names<C>::single;  // a std::string only on an error's path
  if (dq.size() != 3 || dq[0] != 1 || dk.size() != 4 || dk[0] != 1 || dk != dv)
    return error(kInvalidArgument, std::string(where) + "qkv " + shape_str(dq) + " and caches " + shape_str(dk) + " / " +
                                       shape_str(dv) + " are not (1, n, width) and two equal (1, kv_heads, rows, head_dim)");
  p = Problem<C>{};
  p.n = n;
  p.Hkv = dk[1];
  p.R = dk[2];
  p.D = dk[3];
  if (p.D % kLanes != 0 || p.D > kMaxHeadDim || dq[2] % p.D != 0)
    return error(kInvalidArgument, std::string(where) + "head_dim " + std::to_string(p.D) + " must be a multiple of 16 up to 256 dividing the qkv width");
  p.H = dq[2] / p.D - 2 * p.Hkv;
  if (p.H <= 0 || p.H % p.Hkv != 0 || p.H / p.Hkv > kMaxGroup)
    return error(kInvalidArgument, std::string(where) + "qkv width " + std::to_string(dq[2]) + " is not (heads + 2 kv_heads) head_dim with heads a multiple of kv_heads");
  p.group = p.H / p.Hkv;
  int32_t *seqlens = nullptr, *total = nullptr;
  CABIN_TRY(data_of(in[3], &seqlens));
  CABIN_TRY(data_of(in[4], &total));
  p.T = *total;
  p.F = p.T - p.n;
  if (p.F < 0 || p.T > p.R || *seqlens != p.T - 1)
    return error(kInvalidArgument, std::string(where) + "total_sequence_length " + std::to_string(p.T) + " and seqlens_k " +
                                       std::to_string(*seqlens) + " do not fit " + std::to_string(p.n) + " tokens in " +
                                       std::to_string(p.R) + " cache rows");
  if (dc.size() != 2 || dc[1] * 2 != p.D || dp.size() != 2 || dp[1] != p.n || db.size() != 4 || db[2] != p.n || db[3] != p.T ||
      dsk.size() != 1 || dsk[0] != p.Hkv * p.D || dsv != dsk)
    return error(kInvalidArgument, std::string(where) + "rope " + shape_str(dc) + ", position_ids " + shape_str(dp) + ", bias " + shape_str(db) +
                                       " or scales " + shape_str(dsk) + " do not match the chunk");
  p.rope_rows = dc[0];
  p.qkv = qkv + row0 * dq[2];  // dq: this seat's rows' shape
  CABIN_TRY(data_of(in[1], &p.keys));
  CABIN_TRY(data_of(in[2], &p.values));
  CABIN_TRY(data_of(in[5], &p.cos));
  CABIN_TRY(data_of(in[6], &p.sin));
  CABIN_TRY(data_of(in[7], &p.position_ids));
  CABIN_TRY(data_of(in[8], &p.bias));
  CABIN_TRY(data_of(in[9], &p.k_scale));
  CABIN_TRY(data_of(in[10], &p.v_scale));
  for (int64_t i = 0; i < p.n; ++i)
    if (p.position_ids[i] < 0 || p.position_ids[i] >= p.rope_rows)
      return error(kInvalidArgument, std::string(where) + "position id " + std::to_string(p.position_ids[i]) + " outside the rotation tables");
  p.scale = 1.0f / std::sqrt(static_cast<float>(p.D));
  CABIN_TRY(step_inputs(ctx, count, base, p, X, step));
  p.out = out == nullptr ? nullptr : out + row0 * p.H * p.D;
  p.blocks = (p.n + kRowBlock - 1) / kRowBlock;
  return nullptr;
}

// Before any row attends: the step keys, unless each unit rotates its own (one version per row, or one
// block of rows: no two units read the same step keys; a decode step's), else here (several blocks
// read version 0's; a parallel_for where there are many, on the calling thread otherwise); then the
// chunk's keys and values written into the cache.
template <typename C>
OrtStatus* write_seat(OrtKernelContext* ctx, Problem<C>& p) {
  p.unit_step_keys = p.K > 0 && (p.V == p.n || p.blocks == 1);
  if (p.K > 0 && !p.unit_step_keys) {
    const size_t units = static_cast<size_t>(p.V * p.Hkv);
    if (p.V * p.K <= 64) {
      for (size_t u = 0; u < units; ++u) step_keys_unit<C>(&p, u);
    } else {
      CABIN_TRY(parallel_for(ctx, step_keys_unit<C>, units, &p));
    }
  }
  write_rows(p);
  return nullptr;
}

template <typename C>
OrtStatus* compute(OrtKernelContext* ctx) {
  size_t count = 0;
  CABIN_TRY(input_count(ctx, &count));
  const OrtValue* qv = nullptr;
  std::vector<int64_t> dq;
  CABIN_TRY(input(ctx, 0, &qv));
  CABIN_TRY(dims_of(qv, &dq));
  if (dq.size() != 3) return error(kInvalidArgument, std::string(Names<C>::single) + "qkv " + shape_str(dq) + " is not (1, n, width)");
  const float* qkv = nullptr;
  CABIN_TRY(data_of(qv, &qkv));
  thread_local std::vector<int64_t> X;
  thread_local std::vector<C> step;
  Problem<C> p;
  CABIN_TRY(prepare(ctx, dq, qkv, dq[1], 0, 1, count, nullptr, p, X, step));
  OrtValue* out = nullptr;
  CABIN_TRY(output(ctx, 0, {1, p.n, p.H * p.D}, &out));
  CABIN_TRY(data_of(out, &p.out));
  CABIN_TRY(write_seat(ctx, p));
  const size_t first = 0;
  Units<C> units{&p, &first, 1, static_cast<size_t>(p.blocks * p.Hkv)};
  return parallel_for(ctx, attend_claimed<C>, units.total, &units);
}

// ai.cabinlm::Int8KVSeatsAttention: S seats' rows in one node (a batched graph's layer), each seat's
// rows over its own cache exactly as Int8KVAttention computes them alone:
//   inputs  0 qkv          float (1, rows, width)  the seats' rows one seat after another
//           1 seat_tokens  int64 (S,)              seat s's row count n_s (rows = their sum)
//           2 ..           variadic: S groups of 15, seat s's group Int8KVAttention's inputs 1 .. 15 (its
//                          caches, lengths, rotation rows, bias, scales, key_source, layer, row slots)
//   output  0              float (1, rows, H D)    seat s's rows where its qkv rows are
// (FloatKVSeatsAttention: the same over float32 caches, groups of FloatKVAttention's inputs.)
// Every (seat, block of rows, kv head) is one unit of one parallel_for, running the single node's
// attend() on the seat's own problem: each seat's output is bit for bit its own node's. A unit reads
// and writes only its seat's caches (every seat's chunk is written before any unit runs).
constexpr size_t kSeatInputs = 15;
template <typename C>
struct SeatsProblem {
  std::vector<Problem<C>> seats;
  std::vector<size_t> first;  // seat s's units start at first[s]
};

template <typename C>
OrtStatus* compute_seats(OrtKernelContext* ctx) {
  size_t count = 0;
  CABIN_TRY(input_count(ctx, &count));
  const char* const where = Names<C>::seats;
  if (count < 2 + kSeatInputs || (count - 2) % kSeatInputs != 0)
    return error(kInvalidArgument, std::string(where) + "takes qkv, seat_tokens and 15 inputs per seat, got " + std::to_string(count) + " inputs");
  const int64_t S = static_cast<int64_t>((count - 2) / kSeatInputs);
  const OrtValue *qv = nullptr, *cv = nullptr;
  thread_local std::vector<int64_t> dq, dc;
  CABIN_TRY(input(ctx, 0, &qv));
  CABIN_TRY(input(ctx, 1, &cv));
  CABIN_TRY(dims_of(qv, &dq));
  CABIN_TRY(dims_of(cv, &dc));
  const int64_t* counts = nullptr;
  CABIN_TRY(data_of(cv, &counts));
  int64_t rows = 0;
  bool counts_ok = dc.size() == 1 && dc[0] == S;
  for (int64_t s = 0; counts_ok && s < S; ++s) {
    counts_ok = counts[s] >= 0;
    rows += counts[s];
  }
  if (dq.size() != 3 || !counts_ok || dq[1] != rows)
    return error(kInvalidArgument, std::string(where) + "qkv " + shape_str(dq) + " and seat_tokens " + shape_str(dc) + " are not (1, rows, width) and " +
                                       std::to_string(S) + " row counts adding up to rows");
  const float* qkv = nullptr;
  CABIN_TRY(data_of(qv, &qkv));
  thread_local std::vector<std::vector<int64_t>> X;
  thread_local std::vector<std::vector<C>> step;
  thread_local SeatsProblem<C> sp;
  X.resize(static_cast<size_t>(S));
  step.resize(static_cast<size_t>(S));
  sp.seats.resize(static_cast<size_t>(S));
  sp.first.assign(static_cast<size_t>(S), 0);
  thread_local std::vector<int64_t> row0, ds;
  row0.assign(static_cast<size_t>(S), 0);
  for (int64_t s = 0, r = 0; s < S; r += counts[s], ++s) {
    row0[static_cast<size_t>(s)] = r;
    ds.assign({1, counts[s], dq[2]});
    CABIN_TRY(prepare(ctx, ds, qkv, counts[s], r, 2 + static_cast<size_t>(s) * kSeatInputs, 1 + kSeatInputs, nullptr,
                      sp.seats[static_cast<size_t>(s)], X[static_cast<size_t>(s)], step[static_cast<size_t>(s)]));
  }
  const Problem<C>& p0 = sp.seats[0];
  for (const Problem<C>& p : sp.seats)
    if (p.H != p0.H || p.D != p0.D)
      return error(kInvalidArgument, std::string(where) + "every seat's caches take the same heads and head_dim");
  OrtValue* out = nullptr;
  CABIN_TRY(output(ctx, 0, {1, dq[1], p0.H * p0.D}, &out));
  float* y = nullptr;
  CABIN_TRY(data_of(out, &y));
  size_t units = 0;
  for (int64_t s = 0; s < S; ++s) {
    Problem<C>& p = sp.seats[static_cast<size_t>(s)];
    p.out = y + row0[static_cast<size_t>(s)] * p.H * p.D;
    CABIN_TRY(write_seat(ctx, p));
    sp.first[static_cast<size_t>(s)] = units;
    units += static_cast<size_t>(p.blocks * p.Hkv);
  }
  if (units == 0) return nullptr;
  Units<C> claims{sp.seats.data(), sp.first.data(), static_cast<size_t>(S), units};
  return parallel_for(ctx, attend_claimed<C>, units, &claims);
}

struct Int8KVAttention {
  static constexpr const char* kName = "Int8KVAttention";
  static constexpr ElementType kInputTypes[16] = {kFloat, kInt8, kInt8, kInt32, kInt32, kFloat, kFloat, kInt64,
                                                  kFloat, kFloat, kFloat, kFloat, kFloat, kFloat, kInt64, kInt64};
  static constexpr size_t kRequiredInputs = 11;
  static OrtStatus* compute(OrtKernelContext* ctx) { return ::compute<int8_t>(ctx); }
};

struct Int8KVSeatsAttention {
  static constexpr const char* kName = "Int8KVSeatsAttention";
  // qkv, then the seats' groups as one variadic input of mixed types (ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED)
  static constexpr ElementType kInputTypes[3] = {kFloat, kInt64, kAnyType};
  static constexpr bool kVariadicTail = true;
  static OrtStatus* compute(OrtKernelContext* ctx) { return ::compute_seats<int8_t>(ctx); }
};

// ai.cabinlm::FloatKVAttention / FloatKVSeatsAttention: the same operators over a float32 cache (C =
// float: the chunk's rotated keys and values stored as they are, read back as they are), the same
// inputs in the same order, k_scale / v_scale ones. A fp32-KV fused build (a vision-language decoder
// among them) takes them, and with them rows as steps and batched graphs.
struct FloatKVAttention {
  static constexpr const char* kName = "FloatKVAttention";
  static constexpr ElementType kInputTypes[16] = {kFloat, kFloat, kFloat, kInt32, kInt32, kFloat, kFloat, kInt64,
                                                  kFloat, kFloat, kFloat, kFloat, kFloat, kFloat, kInt64, kInt64};
  static constexpr size_t kRequiredInputs = 11;
  static OrtStatus* compute(OrtKernelContext* ctx) { return ::compute<float>(ctx); }
};

struct FloatKVSeatsAttention {
  static constexpr const char* kName = "FloatKVSeatsAttention";
  static constexpr ElementType kInputTypes[3] = {kFloat, kInt64, kAnyType};
  static constexpr bool kVariadicTail = true;
  static OrtStatus* compute(OrtKernelContext* ctx) { return ::compute_seats<float>(ctx); }
};

}  // namespace

// The int8 conversion path compiled in (the rest is GCC vector extensions, lowered for the same ISA):
// "avx512", "avx2", "neon" or "generic"; tests under emulation assert "neon" (tests/test_arm.py).
extern "C" __attribute__((visibility("default"))) const char* cabinlm_attention_isa() { return CABINLM_ATTENTION_ISA; }

const cabinlm_ort::CustomOp* cabinlm_ort::int8_kv_attention_op() {
  static const CustomOp op = make_op<Int8KVAttention>();
  return &op;
}

const cabinlm_ort::CustomOp* cabinlm_ort::int8_kv_seats_attention_op() {
  static const CustomOp op = make_op<Int8KVSeatsAttention>();
  return &op;
}

namespace cabinlm_ort {  // declared in register.cc, which registers them
const CustomOp* float_kv_attention_op() {
  static const CustomOp op = make_op<FloatKVAttention>();
  return &op;
}

const CustomOp* float_kv_seats_attention_op() {
  static const CustomOp op = make_op<FloatKVSeatsAttention>();
  return &op;
}
}  // namespace cabinlm_ort
