// One core's peak rate of the two instructions cabinlm's cpu kernels are built on (x86 with AVX-512
// VNNI): vpdpbusd (BlockQ4MatMul / BlockQ8MatMul: 64 byte products a step) and the 16-lane float
// fused multiply-add (Int8KVAttention's Q K and P V), each on 12 independent accumulators held in
// registers (enough to hide either one's latency), nothing read from memory. What a kernel reaches
// against these is its efficiency (docs/benchmarks.md, section 20, stop 46).
//
//     g++ -O2 -march=native benchmarks/vector_peaks.cc -o /tmp/vector_peaks && /tmp/vector_peaks
//
// Prints one JSON line: billions of each a second on the core it runs on.

#include <immintrin.h>

#include <chrono>
#include <cstdio>

#define CABIN_12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

int main() {
  constexpr long kRounds = 100000000;
#define DECL_I(i) __m512i a##i = _mm512_set1_epi32(i);
  CABIN_12(DECL_I)
  const __m512i b = _mm512_set1_epi8(3), c = _mm512_set1_epi8(5);
  auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kRounds; ++n) {
#define DOT(i) a##i = _mm512_dpbusd_epi32(a##i, b, c);
    CABIN_12(DOT)
#define KEEP_I(i) __asm__ volatile("" : "+v"(a##i));  // no folding the chains away
    CABIN_12(KEEP_I)
  }
  const double dot_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m512i isum = a0;
#define SUM_I(i) isum = _mm512_add_epi32(isum, a##i);
  CABIN_12(SUM_I)

#define DECL_F(i) __m512 f##i = _mm512_set1_ps(static_cast<float>(i));
  CABIN_12(DECL_F)
  const __m512 m = _mm512_set1_ps(1.0f), z = _mm512_set1_ps(0.0f);
  t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kRounds; ++n) {
#define FMA(i) f##i = _mm512_fmadd_ps(f##i, m, z);
    CABIN_12(FMA)
#define KEEP_F(i) __asm__ volatile("" : "+v"(f##i));
    CABIN_12(KEEP_F)
  }
  const double fma_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m512 fsum = f0;
#define SUM_F(i) fsum = _mm512_add_ps(fsum, f##i);
  CABIN_12(SUM_F)

  std::printf("{\"vpdpbusd_per_s\": %.3e, \"fma16_per_s\": %.3e, \"byte_products_per_s\": %.3e, \"checksum\": %d}\n",
              12.0 * kRounds / dot_s, 12.0 * kRounds / fma_s, 64 * 12.0 * kRounds / dot_s,
              _mm512_reduce_add_epi32(isum) + static_cast<int>(_mm512_reduce_add_ps(fsum)));
  return 0;
}
