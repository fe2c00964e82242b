// Switchable LoRA adapters' terms beside a fused projection: ai.cabinlm::LoraTerms, one node per
// fused matrix (q|k|v, o, gate|up, down) of a layer in place of two Gemms per targeted projection and
// seat, and the Split / Concat / Add around them (engines/ort_fused/adapter_graph.py).
//
//   inputs  0 y            float (..., N)    the fused matrix's output, x W^T (bias included)
//           1 x            float (..., K)    its input
//           2 columns      int64 (P,)        the first column in y of each targeted projection p
//           3 seat_tokens  int64 (S,)        each seat's row count, the rows stacked seat after seat;
//                                            (0,): every row is one seat's (S = 1, the one-seat graph)
//           4 ..           variadic, float   for seat s, for projection p: A (R, K), B (n_p, R)
//                                            (B already holds the adapter's scaling: the build folds it in)
//   output  0              float (..., N)    y, plus (x A^T) B^T of seat s's own A and B in columns
//                                            columns[p] .. columns[p] + n_p - 1 of each of seat s's rows
//
// ai.cabinlm::LoraSwiGLUTerms takes gate | up (..., 2 K) as x and computes the term over
// silu(gate) * up (vector_math.h's swiglu_row, the sequence BlockQ4SwiGLUMatMul runs inside): the
// down projection's term where the build computes its input inside the down projection's kernel.
//
// How it computes, per row: u = x A^T (R dot products of length K), then t = u B^T (n_p dot products
// of length R), each dot product by one fixed sequence (16 lanes of products added in order, then
// the lanes by a fixed tree, then the tail; 4 rows of A or 16 columns of B at a time, each with that
// sequence), and y + t where t is not 0. Where t is 0 the column keeps y itself: a seat without an
// adapter (A and B all zeros: u and t exactly 0) gets y bit for bit, -0.0 included, so its logits
// are the graph's without adapter nodes (graph.fused_model with adapters=False, which a build
// carries beside this one for seats without an adapter).
//
// Invariant the runtime relies on: a row's result is a function of that row and its seat's A and B
// alone, by the same code whatever the other rows: a seat's rows in a batched graph are the ones it
// gets alone, and row i of a chunk is its one-token step, bit for bit.
//
// One parallel_for per node (a node of one unit runs on the calling thread), a unit per (seat,
// projection, 768 columns): it computes u for each of its seat's rows itself (R x K multiply-adds,
// A read again from cache by a projection's other units) and then its columns' terms, so that a
// node needs no second pass and no unit waits for another; at SmolLM2's sizes a decode step's q|k|v
// node is 3 units, its gate|up node 4, its o and down nodes 1. Units never share an output, and a
// row's arithmetic is the same in any unit. Portable C++ (vector_math.h's GCC / Clang vectors):
// AVX-512, AVX2 or NEON as the library's -march gives them, the same sequence on each.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ort_api.h"
#include "vector_math.h"

namespace {

using namespace cabinlm_ort;
using namespace cabinlm_vec;

// Columns (rows of B) per unit (a multiple of 16): a unit reads R x 768 floats of B (48 KB at rank
// 16) and all of A, so that A's reads and x A^T, repeated by every unit of its projection, stay a
// fraction (measured at SmolLM2's sizes, one thread: 256 columns a unit cost about a quarter more).
constexpr int64_t kColumnsPerUnit = 768;
// The factors are asked for ahead of their use (hints only: no arithmetic changes, and a hint past an
// array's end never faults): each row of A 128 floats further on, B two groups of 16 rows further on.
// A decode step reads every factor once from memory, in runs of a few KB that the core's own
// prefetchers would otherwise learn anew each time.
constexpr int64_t kAheadFloats = 128;
constexpr int64_t kAheadGroups = 2;

// The 16 lanes' sum by reduce16's tree (lanes m and m + 8, then m and m + 4, m and m + 2, m and m + 1).
inline float lanes_sum(vf16 v) {
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// a . b over n floats: 16 lanes of products added in order over a's 16-float pieces, the lanes'
// sum (lanes_sum), then the tail's products one by one (std::fma: one rounding each on every CPU,
// where a * b + s would be contracted or not as the compiler sees fit). Every dot product here is
// this sequence, whether computed alone or several at a time (dots4, dots16).
inline float dot(const float* a, const float* b, int64_t n) {
  vf16 acc = splat(0.0f);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) acc += load(a + k) * load(b + k);
  float s = lanes_sum(acc);
  for (; k < n; ++k) s = std::fma(a[k], b[k], s);
  return s;
}

// x . w[g * stride] for g < 4: dot()'s sequence for each, their chains interleaved.
inline void dots4(const float* x, const float* w, int64_t stride, int64_t n, float* out) {
  vf16 acc[4] = {splat(0.0f), splat(0.0f), splat(0.0f), splat(0.0f)};
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const vf16 xv = load(x + k);
    for (int g = 0; g < 4; ++g) {
      __builtin_prefetch(w + g * stride + k + kAheadFloats, 0, 3);
      acc[g] += xv * load(w + g * stride + k);
    }
  }
  for (int g = 0; g < 4; ++g) {
    float s = lanes_sum(acc[g]);
    for (int64_t j = k; j < n; ++j) s = std::fma(x[j], w[g * stride + j], s);
    out[g] = s;
  }
}

// u . b[c * R] for the 16 columns c of a group: dot()'s sequence for each (the 16 lane sums by
// reduce16, the same tree as lanes_sum), 16 at a time. kR: R where it is known when compiled (16,
// 32, 64: the group's rows at fixed offsets), else 0; the sequence is the same either way.
template <int64_t kR>
inline vf16 dots16(const float* u, const float* b, int64_t R) {
  if constexpr (kR > 0) R = kR;
  vf16 acc[16];
  for (int c = 0; c < 16; ++c) acc[c] = splat(0.0f);
  for (int64_t at = 0; at < 16 * R; at += 16) __builtin_prefetch(b + kAheadGroups * 16 * R + at, 0, 3);  // later groups' rows
  int64_t r = 0;
  for (; r + 16 <= R; r += 16) {
    const vf16 uv = load(u + r);
    for (int c = 0; c < 16; ++c) acc[kBitReversed[c]] += uv * load(b + c * R + r);
  }
  const vf16 sums = reduce16(acc);
  if (r == R) return sums;
  float t[16];
  for (int c = 0; c < 16; ++c) {
    t[c] = sums[c];
    for (int64_t j = r; j < R; ++j) t[c] = std::fma(u[j], b[c * R + j], t[c]);
  }
  return load(t);
}

// Columns n0 .. n1 - 1 of y + u B^T for one row: groups of 16 from the projection's first column
// (dots16), then the rest one by one (dot), each column y itself where its term is 0.
template <int64_t kR>
inline void column_terms(const float* u, const float* b, int64_t R, int64_t n0, int64_t n1, const float* y, float* out) {
  int64_t n = n0;
  for (; n + 16 <= n1; n += 16) {
    const vf16 t = dots16<kR>(u, b + n * R, R), yv = load(y + n);
    const vi16 nonzero = t != splat(0.0f);
    store(out + n, nonzero ? yv + t : yv);
  }
  for (; n < n1; ++n) {
    const float t = dot(u, b + n * R, R);
    out[n] = t != 0.0f ? y[n] + t : y[n];
  }
}

struct Part {  // one seat's factors for one targeted projection
  const float* a = nullptr;  // (R, K)
  const float* b = nullptr;  // (n, R)
  int64_t column = 0, n = 0;
};

struct Unit {  // columns n0 .. n1 - 1 of part `part` (seat s P + p) for the seat's rows
  int64_t part = 0, n0 = 0, n1 = 0;
};

struct Problem {
  const float* x = nullptr;  // (M, K) the rows' inputs (LoraSwiGLUTerms: silu(gate) * up)
  const float* y = nullptr;  // (M, N)
  float* out = nullptr;      // (M, N)
  int64_t K = 0, N = 0, R = 0, P = 0;
  const int64_t* first = nullptr;  // seat s's rows: first[s] .. first[s] + rows[s] - 1
  const int64_t* rows = nullptr;
  const Part* parts = nullptr;  // seat s, projection p: parts[s P + p]
  const Unit* units = nullptr;
};

// One unit: for each of its seat's rows, u = x A^T (its own copy: units of a part share no buffer),
// then the unit's columns of t = u B^T into y's.
void unit_terms(void* data, size_t i) {
  const Problem& p = *static_cast<const Problem*>(data);
  const Unit& w = p.units[i];
  const Part& f = p.parts[w.part];
  const int64_t s = w.part / p.P;
  thread_local std::vector<float> uv;
  uv.resize(static_cast<size_t>(p.R));
  float* u = uv.data();
  for (int64_t g = 0; g < kAheadGroups; ++g)  // the unit's first groups of B, while u is computed
    for (int64_t at = 0; at < 16 * p.R; at += 16) __builtin_prefetch(f.b + (w.n0 + 16 * g) * p.R + at, 0, 3);
  for (int64_t m = p.first[s]; m < p.first[s] + p.rows[s]; ++m) {
    const float* x = p.x + m * p.K;
    int64_t r = 0;
    for (; r + 4 <= p.R; r += 4) dots4(x, f.a + r * p.K, p.K, p.K, u + r);
    for (; r < p.R; ++r) u[r] = dot(x, f.a + r * p.K, p.K);
    const float* y = p.y + m * p.N + f.column;
    float* out = p.out + m * p.N + f.column;
    switch (p.R) {  // the usual ranks' rows of B at offsets known when compiled
      case 16: column_terms<16>(u, f.b, p.R, w.n0, w.n1, y, out); break;
      case 32: column_terms<32>(u, f.b, p.R, w.n0, w.n1, y, out); break;
      case 64: column_terms<64>(u, f.b, p.R, w.n0, w.n1, y, out); break;
      default: column_terms<0>(u, f.b, p.R, w.n0, w.n1, y, out);
    }
  }
}

OrtStatus* compute(OrtKernelContext* ctx, bool swiglu) {
  const char* const where = swiglu ? "LoraSwiGLUTerms: " : "LoraTerms: ";
  size_t count = 0;
  CABIN_TRY(input_count(ctx, &count));
  const OrtValue *yv = nullptr, *xv = nullptr, *cv = nullptr, *sv = nullptr;
  thread_local std::vector<int64_t> dy, dx, dc, ds, da, db, first, rows;
  thread_local std::vector<Part> parts;
  thread_local std::vector<Unit> units;
  thread_local std::vector<float> act;
  CABIN_TRY(input(ctx, 0, &yv));
  CABIN_TRY(input(ctx, 1, &xv));
  CABIN_TRY(input(ctx, 2, &cv));
  CABIN_TRY(input(ctx, 3, &sv));
  CABIN_TRY(dims_of(yv, &dy));
  CABIN_TRY(dims_of(xv, &dx));
  CABIN_TRY(dims_of(cv, &dc));
  CABIN_TRY(dims_of(sv, &ds));
  const int64_t width = swiglu ? 2 : 1;
  int64_t M = 1;
  bool ok = !dy.empty() && dx.size() == dy.size() && dc.size() == 1 && dc[0] >= 1 && ds.size() == 1 &&
            dx.back() % width == 0 && (!swiglu || (dx.back() / width) % 16 == 0);
  for (size_t i = 0; ok && i + 1 < dy.size(); ++i) {
    ok = dx[i] == dy[i];
    M *= dy[i];
  }
  if (!ok)
    return error(kInvalidArgument, std::string(where) + "y " + shape_str(dy) + ", x " + shape_str(dx) + ", columns " +
                                       shape_str(dc) + " and seat_tokens " + shape_str(ds) + " are not (..., N), (..., " +
                                       (swiglu ? "2 K), K a multiple of 16" : "K)") + ", (P,) and (S,)");
  Problem p;
  p.K = dx.back() / width;
  p.N = dy.back();
  p.P = dc[0];
  const int64_t S = std::max<int64_t>(ds[0], 1);
  if (count != 4 + static_cast<size_t>(2 * S * p.P))
    return error(kInvalidArgument, std::string(where) + "takes y, x, columns, seat_tokens and an A and a B per seat and "
                                       "projection (" + std::to_string(4 + 2 * S * p.P) + " inputs), got " + std::to_string(count));
  const int64_t *columns = nullptr, *counts = nullptr;
  CABIN_TRY(data_of(cv, &columns));
  CABIN_TRY(data_of(sv, &counts));
  first.assign(S, 0);
  rows.assign(S, M);
  int64_t total = 0;
  for (int64_t s = 0; ds[0] > 0 && s < S; ++s) {
    if (counts[s] < 0) return error(kInvalidArgument, std::string(where) + "seat_tokens holds a negative row count");
    first[s] = total;
    rows[s] = counts[s];
    total += counts[s];
  }
  if (ds[0] > 0 && total != M)
    return error(kInvalidArgument, std::string(where) + "seat_tokens adds up to " + std::to_string(total) + " rows, y has " +
                                       std::to_string(M));
  parts.resize(static_cast<size_t>(S * p.P));
  for (int64_t i = 0; i < S * p.P; ++i) {
    const OrtValue *av = nullptr, *bv = nullptr;
    CABIN_TRY(input(ctx, 4 + 2 * i, &av));
    CABIN_TRY(input(ctx, 5 + 2 * i, &bv));
    CABIN_TRY(dims_of(av, &da));
    CABIN_TRY(dims_of(bv, &db));
    if (i == 0 && da.size() == 2) p.R = da[0];
    Part& f = parts[i];
    f.column = columns[i % p.P];
    f.n = db.size() == 2 ? db[0] : -1;
    if (da.size() != 2 || da[0] != p.R || da[1] != p.K || db.size() != 2 || db[1] != p.R || f.column < 0 ||
        f.column + f.n > p.N)
      return error(kInvalidArgument, std::string(where) + "seat " + std::to_string(i / p.P) + ", projection " +
                                         std::to_string(i % p.P) + ": A " + shape_str(da) + " and B " + shape_str(db) +
                                         " at column " + std::to_string(f.column) + " are not (R, " + std::to_string(p.K) +
                                         ") and (n, R) within y's " + std::to_string(p.N) + " columns");
    CABIN_TRY(data_of(av, &f.a));
    CABIN_TRY(data_of(bv, &f.b));
  }
  CABIN_TRY(data_of(yv, &p.y));
  CABIN_TRY(data_of(xv, &p.x));
  OrtValue* ov = nullptr;
  CABIN_TRY(output(ctx, 0, dy, &ov));
  CABIN_TRY(data_of(ov, &p.out));
  if (M == 0) return nullptr;
  std::memcpy(p.out, p.y, static_cast<size_t>(M * p.N) * sizeof(float));  // columns no projection adapts
  if (p.R == 0) return nullptr;

  if (swiglu) {
    act.resize(static_cast<size_t>(M * p.K));
    for (int64_t m = 0; m < M; ++m) swiglu_row(p.x + m * 2 * p.K, p.K, act.data() + m * p.K);
    p.x = act.data();
  }
  units.clear();
  for (int64_t sp = 0; sp < S * p.P; ++sp) {
    if (rows[sp / p.P] == 0) continue;  // a seat without rows in this run
    for (int64_t n0 = 0; n0 < parts[sp].n; n0 += kColumnsPerUnit) units.push_back({sp, n0, std::min(n0 + kColumnsPerUnit, parts[sp].n)});
  }
  p.first = first.data();
  p.rows = rows.data();
  p.parts = parts.data();
  p.units = units.data();
  if (units.size() == 1) {
    unit_terms(&p, 0);
    return nullptr;
  }
  return parallel_for(ctx, unit_terms, units.size(), &p);
}

struct LoraTerms {
  static constexpr const char* kName = "LoraTerms";
  static constexpr ElementType kInputTypes[5] = {kFloat, kFloat, kInt64, kInt64, kAnyType};
  static constexpr bool kVariadicTail = true;
  static OrtStatus* compute(OrtKernelContext* ctx) { return ::compute(ctx, false); }
};

struct LoraSwiGLUTerms {
  static constexpr const char* kName = "LoraSwiGLUTerms";
  static constexpr ElementType kInputTypes[5] = {kFloat, kFloat, kInt64, kInt64, kAnyType};
  static constexpr bool kVariadicTail = true;
  static OrtStatus* compute(OrtKernelContext* ctx) { return ::compute(ctx, true); }
};

}  // namespace

namespace cabinlm_ort {
const CustomOp* lora_terms_op() {
  static const CustomOp op = make_op<LoraTerms>();
  return &op;
}

const CustomOp* lora_swiglu_terms_op() {
  static const CustomOp op = make_op<LoraSwiGLUTerms>();
  return &op;
}
}  // namespace cabinlm_ort
