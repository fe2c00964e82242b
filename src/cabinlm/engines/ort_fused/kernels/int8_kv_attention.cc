// cabinlm's attention over an int8 KV cache: an ONNX Runtime custom operator, ai.cabinlm::Int8KVAttention.
//
// It takes the place of com.microsoft::GroupQueryAttention in the cpu build's fused decoder
// (builders/ort_fused.py), with the same inputs and meaning, for int8 KV with static per-channel
// scales. Why an own kernel: ONNX Runtime's quantized-cache path computes a chunk of tokens one row at
// a time with the cache de-quantized per row, which makes a prefill chunk over a full window about
// three times as slow as over a float32 cache (docs/benchmarks.md, section 11).
//
//   inputs   0 qkv                   float (1, n, (H + 2 Hkv) D)  the chunk's un-rotated q | k | v
//            1 key_cache             int8  (1, Hkv, R, D)  keys rotated at write time; rows F .. F+n-1 are
//            2 value_cache           int8  (1, Hkv, R, D)  written here, in place (F = total - n)
//            3 seqlens_k             int32 (1,)            F + n - 1
//            4 total_sequence_length int32 ()              F + n
//            5 rope_cos, 6 rope_sin  float (rows, D / 2)   the rotation of the row position_ids names
//            7 position_ids          int64 (1, n)
//            8 attention_bias        float (1, 1, n, F + n) additive (0, or -1e30 for a slot not to see)
//            9 k_scale, 10 v_scale   float (Hkv * D)       per channel: keys per rotation pair, values
//   output   0 attention             float (1, n, H D)
//
// Invariants the runtime relies on:
//  * the chunk's K/V are rotated (keys), divided by their scales, rounded half to even and saturated to
//    +-127 (the rounding of the sink / pinned keys' refresh graph), then written to rows F .. F+n-1 of
//    the caches before any row attends: row i attends over cache rows 0 .. F+i, its own included, read
//    back as int8, exactly as a one-token step would;
//  * a row's result is a function of that row's inputs alone, computed in one fixed order (a score
//    over the head dimension in 16 lanes reduced by one fixed tree, the softmax sum in 16 lanes, the
//    values added key after key): row i of a chunk is bit for bit the one-token step that sees the
//    same cache rows (speculative verification depends on it). How rows are grouped (blocks of 4
//    rows of one kv head, which share each key's conversion to float; tiles of 16 or 32 keys) changes
//    the work, never a row's arithmetic;
//  * a key whose biased score is below the row's maximum by more than 87 weighs exactly 0.
//
// Compiled by `cabinlm build` for the profile's CPU (kernels/compiler.py) into one library with the other
// kernels; it reaches the ONNX Runtime C API through ort_api.h.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
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

// rotate-half rotary embedding of one head (x: D values), into out
inline void rotate(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t h = D / 2;
  for (int64_t d = 0; d < h; ++d) {
    out[d] = x[d] * cos[d] - x[d + h] * sin[d];
    out[d + h] = x[d + h] * cos[d] + x[d] * sin[d];
  }
}

#define CABIN_IDX(...) __VA_ARGS__
// 16 vectors -> one: lane l the sum of the 16 lanes of vector l, by one tree for every vector (lanes
// m and m+8, then m and m+4 of those, then m and m+2, then m and m+1). Two-source shuffles leave
// the sums in bit-reversed order; qk_tile stores key l's products at v[kBitReversed[l]].
constexpr int kBitReversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
inline vf16 reduce16(const vf16* v) {
  vf16 t[8], u[4], w[2];
  for (int k = 0; k < 8; ++k)
    t[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], CABIN_IDX(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)) +
           __builtin_shufflevector(v[2 * k], v[2 * k + 1], CABIN_IDX(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31));
  for (int k = 0; k < 4; ++k)
    u[k] = __builtin_shufflevector(t[2 * k], t[2 * k + 1], CABIN_IDX(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)) +
           __builtin_shufflevector(t[2 * k], t[2 * k + 1], CABIN_IDX(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31));
  for (int k = 0; k < 2; ++k)
    w[k] = __builtin_shufflevector(u[2 * k], u[2 * k + 1], CABIN_IDX(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)) +
           __builtin_shufflevector(u[2 * k], u[2 * k + 1], CABIN_IDX(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31));
  return __builtin_shufflevector(w[0], w[1], CABIN_IDX(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)) +
         __builtin_shufflevector(w[0], w[1], CABIN_IDX(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31));
}

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

struct Problem {
  const float* qkv;
  int8_t* keys;
  int8_t* values;
  const float* cos;
  const float* sin;
  const int64_t* position_ids;
  const float* bias;
  const float* k_scale;
  const float* v_scale;
  float* out;
  int64_t n, F, T, R, H, Hkv, D, group, rope_rows, blocks;
  float scale;
};

// Rows i0 .. i1-1 (at most kRowBlock) and kv head g: every query head of the group. Each row's
// arithmetic is the same sequence whatever block it is computed in.
void attend(const Problem& p, int64_t i0, int64_t i1, int64_t g) {
  const int64_t D = p.D, V16 = D / kLanes, G = p.group, W = (p.H + 2 * p.Hkv) * D;
  const int64_t B = i1 - i0, Lmax = p.F + i1;  // row i attends keys 0 .. F+i
  const int64_t stride = (Lmax + kLanes - 1) / kLanes * kLanes;
  const float* ks = p.k_scale + g * D;
  const float* vs = p.v_scale + g * D;
  const int8_t* K = p.keys + g * p.R * D;
  const int8_t* V = p.values + g * p.R * D;

  alignas(64) float q[kRowBlock][kMaxGroup][kMaxHeadDim];
  for (int64_t b = 0; b < B; ++b) {
    const int64_t i = i0 + b, pos = p.position_ids[i];
    for (int64_t r = 0; r < G; ++r) {
      float rotated[kMaxHeadDim];
      rotate(p.qkv + i * W + (g * G + r) * D, p.cos + pos * (D / 2), p.sin + pos * (D / 2), D, rotated);
      for (int64_t d = 0; d < D; ++d) q[b][r][d] = rotated[d] * ks[d] * p.scale;  // the key scale folded in
    }
  }

  // Q K^T, 16 keys at a time: the tile's keys converted to float once for all rows and heads, then
  // per row and head (qk_tile) each key's products summed over 16 lanes and the lanes of 16 keys
  // reduced together, one fixed tree for every key. scores[b][r][0 .. stride): row b's keys, biased;
  // keys after the row's own (later chunk rows, the tile's tail) -1e30 (weight 0).
  thread_local std::vector<float> scores;
  scores.resize(static_cast<size_t>(B * G * stride));
  alignas(64) float keys[kLanes * kMaxHeadDim];
  for (int64_t j0 = 0; j0 < Lmax; j0 += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, Lmax - j0);
    for (int64_t l = 0; l < kLanes; ++l)
      for (int64_t c = 0; c < V16; ++c)
        store(keys + l * D + c * kLanes, l < count ? load_int8(K + (j0 + l) * D + c * kLanes) : splat(0.0f));
    for (int64_t b = 0; b < B; ++b) {
      const int64_t i = i0 + b, mine = p.F + i + 1 - j0;  // this row's keys in the tile (may be <= 0)
      alignas(64) float bias[kLanes];
      for (int64_t l = 0; l < kLanes; ++l) bias[l] = l < mine ? p.bias[i * p.T + j0 + l] : -1e30f;
      const vf16 bv = load(bias);
      for (int64_t r = 0; r < G; ++r) store(scores.data() + (b * G + r) * stride + j0, qk_tile(V16, q[b][r], keys, D) + bv);
    }
  }

  float inv_sum[kRowBlock][kMaxGroup];
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < G; ++r) {
      float* s = scores.data() + (b * G + r) * stride;
      const int64_t Ls = (p.F + i0 + b + 1 + kLanes - 1) / kLanes * kLanes;  // this row's lanes
      vf16 m = load(s);
      for (int64_t j = kLanes; j < Ls; j += kLanes) {
        const vf16 x = load(s + j);
        m = x > m ? x : m;
      }
      const vf16 mx = splat(hmax(m));
      vf16 acc = splat(0.0f);
      for (int64_t j = 0; j < Ls; j += kLanes) {
        const vf16 e = exp_nonpositive(load(s + j) - mx);
        store(s + j, e);
        acc += e;
      }
      inv_sum[b][r] = 1.0f / hsum(acc);
    }

  // P V, a tile of keys at a time: the tile's values converted to float once, each row and head's
  // accumulators held in registers over the tile (pv_tile); every accumulator still adds its keys'
  // terms one key after the other, in key order.
  alignas(64) float o[kRowBlock][kMaxGroup][kMaxHeadDim];
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < G; ++r) std::memset(o[b][r], 0, sizeof(float) * D);
  alignas(64) float tile[kTile * kMaxHeadDim];
  for (int64_t j0 = 0; j0 < Lmax; j0 += kTile) {
    const int64_t count = std::min<int64_t>(kTile, Lmax - j0);
    for (int64_t j = 0; j < count; ++j)
      for (int64_t c = 0; c < V16; ++c) store(tile + j * D + c * kLanes, load_int8(V + (j0 + j) * D + c * kLanes));
    for (int64_t b = 0; b < B; ++b) {
      const int64_t mine = std::min<int64_t>(count, p.F + i0 + b + 1 - j0);  // this row's keys in the tile
      if (mine <= 0) continue;
      for (int64_t r = 0; r < G; ++r) pv_tile(V16, scores.data() + (b * G + r) * stride + j0, tile, mine, D, o[b][r]);
    }
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < G; ++r) {
      float* out = p.out + (i0 + b) * p.H * D + (g * G + r) * D;
      for (int64_t d = 0; d < D; ++d) out[d] = o[b][r][d] * inv_sum[b][r] * vs[d];
    }
}

// The chunk's new keys (rotated) and values, quantized into cache rows F .. F+n-1.
void write_rows(const Problem& p) {
  const int64_t D = p.D, W = (p.H + 2 * p.Hkv) * D;
  float rotated[kMaxHeadDim];
  for (int64_t i = 0; i < p.n; ++i) {
    const float* row = p.qkv + i * W;
    const int64_t pos = p.position_ids[i];
    for (int64_t g = 0; g < p.Hkv; ++g) {
      const float* ks = p.k_scale + g * D;
      const float* vs = p.v_scale + g * D;
      rotate(row + (p.H + g) * D, p.cos + pos * (D / 2), p.sin + pos * (D / 2), D, rotated);
      int8_t* k = p.keys + (g * p.R + p.F + i) * D;
      int8_t* v = p.values + (g * p.R + p.F + i) * D;
      const float* vin = row + (p.H + p.Hkv + g) * D;
      for (int64_t d = 0; d < D; ++d) {
        k[d] = quantize(rotated[d] / ks[d]);
        v[d] = quantize(vin[d] / vs[d]);
      }
    }
  }
}

void attend_unit(void* data, size_t unit) {
  const Problem& p = *static_cast<const Problem*>(data);
  const int64_t u = static_cast<int64_t>(unit), block = u / p.Hkv, g = u % p.Hkv;
  const int64_t i0 = block * kRowBlock, i1 = std::min(p.n, i0 + kRowBlock);
  attend(p, i0, i1, g);
}

OrtStatus* compute(OrtKernelContext* ctx) {
  const OrtValue* in[11];
  std::vector<int64_t> dq, dk, dv, dc, db, dp, dsk, dsv;
  for (size_t i = 0; i < 11; ++i) CABIN_TRY(input(ctx, i, &in[i]));
  CABIN_TRY(dims_of(in[0], &dq));
  CABIN_TRY(dims_of(in[1], &dk));
  CABIN_TRY(dims_of(in[2], &dv));
  CABIN_TRY(dims_of(in[5], &dc));
  CABIN_TRY(dims_of(in[7], &dp));
  CABIN_TRY(dims_of(in[8], &db));
  CABIN_TRY(dims_of(in[9], &dsk));
  CABIN_TRY(dims_of(in[10], &dsv));
  const std::string where = "Int8KVAttention: ";
  if (dq.size() != 3 || dq[0] != 1 || dk.size() != 4 || dk[0] != 1 || dk != dv)
    return error(kInvalidArgument, where + "qkv " + shape_str(dq) + " and caches " + shape_str(dk) + " / " +
                                       shape_str(dv) + " are not (1, n, width) and two equal (1, kv_heads, rows, head_dim)");
  Problem p{};
  p.n = dq[1];
  p.Hkv = dk[1];
  p.R = dk[2];
  p.D = dk[3];
  if (p.D % kLanes != 0 || p.D > kMaxHeadDim || dq[2] % p.D != 0)
    return error(kInvalidArgument, where + "head_dim " + std::to_string(p.D) + " must be a multiple of 16 up to 256 dividing the qkv width");
  p.H = dq[2] / p.D - 2 * p.Hkv;
  if (p.H <= 0 || p.H % p.Hkv != 0 || p.H / p.Hkv > kMaxGroup)
    return error(kInvalidArgument, where + "qkv width " + std::to_string(dq[2]) + " is not (heads + 2 kv_heads) head_dim with heads a multiple of kv_heads");
  p.group = p.H / p.Hkv;
  int32_t *seqlens = nullptr, *total = nullptr;
  CABIN_TRY(data_of(in[3], &seqlens));
  CABIN_TRY(data_of(in[4], &total));
  p.T = *total;
  p.F = p.T - p.n;
  if (p.F < 0 || p.T > p.R || *seqlens != p.T - 1)
    return error(kInvalidArgument, where + "total_sequence_length " + std::to_string(p.T) + " and seqlens_k " +
                                       std::to_string(*seqlens) + " do not fit " + std::to_string(p.n) + " tokens in " +
                                       std::to_string(p.R) + " cache rows");
  if (dc.size() != 2 || dc[1] * 2 != p.D || dp.size() != 2 || dp[1] != p.n || db.size() != 4 || db[2] != p.n || db[3] != p.T ||
      dsk.size() != 1 || dsk[0] != p.Hkv * p.D || dsv != dsk)
    return error(kInvalidArgument, where + "rope " + shape_str(dc) + ", position_ids " + shape_str(dp) + ", bias " + shape_str(db) +
                                       " or scales " + shape_str(dsk) + " do not match the chunk");
  p.rope_rows = dc[0];
  CABIN_TRY(data_of(in[0], &p.qkv));
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
      return error(kInvalidArgument, where + "position id " + std::to_string(p.position_ids[i]) + " outside the rotation tables");
  p.scale = 1.0f / std::sqrt(static_cast<float>(p.D));
  OrtValue* out = nullptr;
  CABIN_TRY(output(ctx, 0, {1, p.n, p.H * p.D}, &out));
  CABIN_TRY(data_of(out, &p.out));

  write_rows(p);
  p.blocks = (p.n + kRowBlock - 1) / kRowBlock;
  const size_t units = static_cast<size_t>(p.blocks * p.Hkv);
  return parallel_for(ctx, attend_unit, units, &p);
}

struct Int8KVAttention {
  static constexpr const char* kName = "Int8KVAttention";
  static constexpr ElementType kInputTypes[11] = {kFloat, kInt8, kInt8, kInt32, kInt32, kFloat,
                                                  kFloat, kInt64, kFloat, kFloat, kFloat};
  static OrtStatus* compute(OrtKernelContext* ctx) { return ::compute(ctx); }
};

}  // namespace

const cabinlm_ort::CustomOp* cabinlm_ort::int8_kv_attention_op() {
  static const CustomOp op = make_op<Int8KVAttention>();
  return &op;
}
