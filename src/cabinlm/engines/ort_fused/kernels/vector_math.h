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
