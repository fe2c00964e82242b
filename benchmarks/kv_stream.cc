// How fast this machine's cores can stream the int8 keys and values a batched decode step's attention
// reads, with nothing else to do: SEATS seats x 30 layers x 3 kv heads, each kv head's ROWS keys rows of
// 64 bytes and then its ROWS values rows (SmolLM2-135M's caches as the fused cpu build lays them out), the
// (seat, kv head) units of a layer claimed in order from one counter by THREADS threads (OpenMP, its
// threads waiting actively between layers, as ONNX Runtime's spinning pool does), every row loaded into a
// register and summed; MODE 1 also asks for each row DIST rows ahead (prefetcht0), as the kernel's reads
// ahead do. A 96 MB buffer is read before every run, so the caches come from memory. Prints the mean and
// the best of 25 timed runs and the bytes a second.
//
//   g++ -O2 -march=native -fopenmp benchmarks/kv_stream.cc -o /tmp/kv_stream
//   OMP_WAIT_POLICY=active /tmp/kv_stream SEATS ROWS THREADS MODE DIST     (e.g. 4 1148 2 1 64)

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s SEATS ROWS THREADS MODE DIST\n", argv[0]);
    return 2;
  }
  const int S = std::atoi(argv[1]), rows = std::atoi(argv[2]), T = std::atoi(argv[3]), mode = std::atoi(argv[4]),
            dist = std::atoi(argv[5]);
  constexpr int L = 30, H = 3, D = 64, kSlots = 1212;  // 1148 slots + a 64-row chunk, as the build's buffers
  const size_t per = static_cast<size_t>(H) * kSlots * D;
  std::vector<int8_t*> K(S * L), V(S * L);
  for (int i = 0; i < S * L; ++i) {
    K[i] = static_cast<int8_t*>(std::aligned_alloc(64, per));
    V[i] = static_cast<int8_t*>(std::aligned_alloc(64, per));
    std::memset(K[i], 1, per);
    std::memset(V[i], 2, per);
  }
  std::vector<char> evict(96 << 20, 1);
  std::atomic<unsigned long> checksum{0};  // a sink for the loaded bytes (wraps)
  double best = 1e9, total = 0;
  const int runs = 30, warm = 5;
  for (int run = 0; run < runs; ++run) {
    volatile long sink = 0;
    for (size_t i = 0; i < evict.size(); i += 64) sink += evict[i];
    const auto t0 = std::chrono::steady_clock::now();
    for (int l = 0; l < L; ++l) {
      std::atomic<int> next{0};
#pragma omp parallel num_threads(T)
      {
        __m512i acc = _mm512_setzero_si512();
        for (int u; (u = next.fetch_add(1)) < S * H;) {
          const int s = u / H, g = u % H;
          const int8_t* k = K[s * L + l] + static_cast<size_t>(g) * kSlots * D;
          const int8_t* v = V[s * L + l] + static_cast<size_t>(g) * kSlots * D;
          for (const int8_t* a : {k, v})
            for (int r = 0; r < rows; ++r) {
              if (mode == 1) _mm_prefetch(reinterpret_cast<const char*>(a + (r + dist) * D), _MM_HINT_T0);
              acc = _mm512_add_epi32(acc, _mm512_load_si512(a + r * D));
            }
        }
        checksum += static_cast<unsigned>(_mm512_reduce_add_epi32(acc));  // used below: the loads stay
      }
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (run >= warm) {
      best = std::min(best, ms);
      total += ms;
    }
  }
  const double mean = total / (runs - warm), bytes = 2.0 * S * L * H * rows * D;
  std::printf("{\"seats\": %d, \"rows\": %d, \"threads\": %d, \"mode\": %d, \"dist\": %d, \"mean_ms\": %.3f, \"best_ms\": %.3f, "
              "\"gb_s\": %.1f, \"checksum\": %lu}\n", S, rows, T, mode, dist, mean, best, bytes / mean / 1e6, checksum.load());
  return 0;
}
