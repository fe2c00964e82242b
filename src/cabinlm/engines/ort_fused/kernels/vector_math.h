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

// exp(x) for x <= 0, exactly 0 below -87 (a masked key): a Cephes-style polynomial on 2^n e^r.
inline vf16 exp_nonpositive(vf16 x) {
  const vi16 masked = x < splat(-87.0f);
  const vf16 xc = masked ? splat(-87.0f) : x;
  const vi16 ni = __builtin_convertvector(xc * 1.44269504088896341f - 0.5f, vi16);  // round(x log2 e), x <= 0
  const vf16 n = __builtin_convertvector(ni, vf16);
  vf16 r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vf16 scale = (vf16)((ni + 127) << 23);
  return masked ? splat(0.0f) : p * scale;
}

}  // namespace cabinlm_vec
