// Portable float vectors for cabinlm's kernels (GCC / Clang vector extensions: AVX-512 or AVX2 on
// x86, NEON on Arm), and the one transcendental function they need.

#pragma once

#include <cstdint>
#include <cstring>

namespace cabinlm_vec {

typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef int8_t vb16 __attribute__((vector_size(16)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

inline vf16 load(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf16 v) { std::memcpy(p, &v, sizeof v); }
inline vf16 splat(float x) { return vf16{} + x; }

typedef int32_t vi8 __attribute__((vector_size(32)));

// exp(x) for x <= 0, exactly 0 below -87 (a masked key): a Cephes-style polynomial on 2^n e^r. One
// template for 16 lanes (vf16, vi16) and 8 (vf8, vi8): each lane the same operations either way.
template <class F, class I>
inline F exp_nonpositive_lanes(F x) {
  const I masked = x < (F{} - 87.0f);
  const F xc = masked ? (F{} - 87.0f) : x;
  const I ni = __builtin_convertvector(xc * 1.44269504088896341f - 0.5f, I);  // round(x log2 e), x <= 0
  const F n = __builtin_convertvector(ni, F);
  F r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const F scale = (F)((ni + 127) << 23);
  return masked ? F{} : p * scale;
}
inline vf16 exp_nonpositive(vf16 x) { return exp_nonpositive_lanes<vf16, vi16>(x); }
inline vf8 exp_nonpositive(vf8 x) { return exp_nonpositive_lanes<vf8, vi8>(x); }

#define CABIN_IDX(...) __VA_ARGS__
// 16 vectors -> one: lane l the sum of the 16 lanes of vector l, by one tree for every vector (lanes
// m and m+8, then m and m+4 of those, then m and m+2, then m and m+1). Two-source shuffles leave
// the sums in bit-reversed order; int8_kv_attention.cc's qk_tile stores key l's
// products at v[kBitReversed[l]], lora_terms.cc's column terms alike.
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

// silu(gate) * up for one row of gate | up (2 K floats, K a multiple of 16), 16 lanes at a time:
// sigmoid from exp of -|g| only (no overflow), exp_nonpositive's polynomial. The one sequence both
// the down projection's kernel (BlockQ4SwiGLUMatMul) and its adapter term (LoraSwiGLUTerms) compute.
inline void swiglu_row(const float* gu, int64_t K, float* out) {
  for (int64_t k = 0; k < K; k += 16) {
    const vf16 g = load(gu + k), u = load(gu + K + k);
    const vi16 positive = g >= splat(0.0f);
    const vf16 e = exp_nonpositive(positive ? -g : g);
    const vf16 sigmoid = (positive ? splat(1.0f) : e) / (splat(1.0f) + e);
    store(out + k, g * sigmoid * u);
  }
}

}  // namespace cabinlm_vec
