// Shared by the host expert kernel's translation units (host_kernel.cpp and one per instruction set).
//
// A "rows" function computes y[t, r] = sum_c W[r, c] * x[t, c] for rows r in [r0, r1) of one stored
// matrix and every token t, reading W in its stored format. Each instruction set (scalar, AVX2 + FMA
// + F16C, AVX-512F) provides one per format; host_kernel.cpp picks a table at run time from what the
// CPU supports, so one build serves every x86-64 machine and the AVX-512 path can be compared with
// the AVX2 one on the same host.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace shardsmith_host {

// One stored matrix W [R, C] and the activations it multiplies.
//   fp4:  w = uint8 [R, C/2] (element 2i in the low nibble of byte i), s8 = UE8M0 [R, C/32];
//         x is *group-major and deinterleaved* (fp4_x_index): the 32 columns of group g for token
//         t start at x[(g * T + t) * 32], the 16 even columns first, then the 16 odd ones, so low
//         and high nibbles each meet a contiguous run and a tile's tokens sit at fixed offsets.
//   fp8:  w = e4m3fn [R, C], sf = float32 block scales [ceil(R/br), ceil(C/bc)] (row stride lsf).
//   bf16: w = bf16 [R, C], no scale.
struct Matrix {
  const uint8_t* w = nullptr;
  int64_t lw = 0;  // bytes between weight rows
  const uint8_t* s8 = nullptr;
  int64_t ls8 = 0;  // fp4: bytes between scale rows
  const float* sf = nullptr;
  int64_t lsf = 0, br = 1, bc = 1;  // fp8: elements between scale rows, block rows and columns
  int64_t C = 0;  // columns (elements)
};

// x [T, C] float32 (row stride C; fp4: the layout above), y[t * ldy + r] float32.
struct Activations {
  const float* x = nullptr;
  int T = 0;
  float* y = nullptr;
  int64_t ldy = 0;
};

using RowsFn = void (*)(const Matrix&, const Activations&, int64_t r0, int64_t r1);

struct Kernels {
  RowsFn fp4 = nullptr, fp8 = nullptr, bf16 = nullptr;
};

Kernels scalar_kernels();
Kernels avx2_kernels();    // all null where the compiler cannot target AVX2 + FMA + F16C
Kernels avx512_kernels();  // all null where the compiler cannot target AVX-512F

// Where column i of token t goes in an fp4 activation of T tokens (see Matrix).
inline int64_t fp4_x_index(int64_t t, int64_t i, int64_t T) {
  return ((i >> 5) * T + t) * 32 + ((i & 1) << 4) + ((i & 31) >> 1);
}

constexpr int kTile = 8;  // tokens sharing one decoded row (accumulators held in registers)

// Software prefetch distance, in bytes ahead of the weight bytes a row function is decoding (0: none;
// set_prefetch_bytes in host_kernel.cpp). A stored row is 1-4 KiB, so the L2 hardware streamer, which
// stops at each 4 KiB page, re-trains every row or two while a thread decodes; one prefetch per 64-byte
// line this far ahead keeps lines in flight across those edges (benchmarks/host_experts.py --prefetch).
// Read once per row function (a relaxed atomic: set_prefetch_bytes may run on another thread).
extern std::atomic<int64_t> g_prefetch_bytes;
inline int64_t prefetch_distance() { return g_prefetch_bytes.load(std::memory_order_relaxed); }
inline void prefetch_ahead(const uint8_t* p, int64_t distance) {
  if (distance > 0) __builtin_prefetch(p + distance, 0, 3);
}

// Whether the tile functions take several rows per call (their kRowsAt; the default) or one (the load
// pattern of the kernel before 2026-12-02, kept so benchmarks/host_experts.py --row-blocking can time
// both in one run). Every accumulator sees the same operations in the same order either way: the same
// bits. A relaxed atomic read once per tile call (set_row_blocking in host_kernel.cpp).
extern std::atomic<bool> g_row_blocking;
inline bool row_blocking() { return g_row_blocking.load(std::memory_order_relaxed); }

// Decode tables, filled before any kernel runs (host_kernel.cpp):
//   ue8m0[s] = 2^(s - 127), ue8m0[255] = NaN (OCP MX spec v1.0; as torch's float8_e8m0fnu -> float);
//   fp8[b] = the e4m3fn byte's value (S.EEEE.MMM, bias 7, subnormals; only S.1111.111 is NaN).
struct Tables {
  float ue8m0[256], fp8[256];
  Tables();
};
extern const Tables kTables;
inline float ue8m0(uint8_t s) { return kTables.ue8m0[s]; }
inline float fp8_e4m3(uint8_t b) { return kTables.fp8[b]; }
inline float bf16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Rows [r, r + n) of one matrix against the token tile t0 of kTiles' size (NT <= kTile tokens); each
// instruction set's tile functions take rows several at a time (their kRowsAt), so the activation
// vectors a step loads serve several rows.
using TileFn = void (*)(const Matrix& m, const Activations& a, int t0, int64_t r, int64_t n);

constexpr int64_t kRowChunk = 4;  // rows handed to the tile functions per call (a multiple of every kRowsAt)

// Rows [r0, r1) in chunks of kRowChunk rows, each chunk against every token tile before the next (past
// kTile tokens a chunk's weight bytes are still in L1 for the next tile).
template <TileFn const* kTiles>
void rows(const Matrix& m, const Activations& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; r += kRowChunk) {
    const int64_t n = r1 - r < kRowChunk ? r1 - r : kRowChunk;
    for (int t0 = 0; t0 < a.T; t0 += kTile) kTiles[a.T - t0 < kTile ? a.T - t0 : kTile](m, a, t0, r, n);
  }
}

// FP8 rows with the block scales folded into the activations (the AVX2 and AVX-512 paths): per
// 128-row block (m.br rows) each thread rebuilds xs[t * C + c] = x[t * C + c] * 2^8 * scale(block,
// c / bc) (the 2^8 because the vector decoders return 2^-8 of each value), so a row's inner loop is
// decode + FMA; kTiles[NT] computes n rows of one block (row i at w + i * lw, output y + i) against
// NT <= kTile tokens of xs.
using Fp8TileFn = void (*)(const uint8_t* w, int64_t lw, int64_t n, int64_t C, const float* xs, float* y,
                           int64_t ldy);

inline void fp8_scale_activations(const Matrix& m, const Activations& a, int64_t block, float* xs) {
  const float* sc = m.sf + block * m.lsf;
  for (int t = 0; t < a.T; ++t)
    for (int64_t c0 = 0; c0 < m.C; c0 += m.bc) {
      const float s = sc[c0 / m.bc] * 256.f;
      const int64_t c1 = c0 + m.bc < m.C ? c0 + m.bc : m.C;
      for (int64_t c = c0; c < c1; ++c) xs[t * m.C + c] = a.x[t * m.C + c] * s;
    }
}

template <Fp8TileFn const* kTiles>
void fp8_rows(const Matrix& m, const Activations& a, int64_t r0, int64_t r1) {
  std::vector<float> xs(static_cast<size_t>(a.T) * m.C);
  for (int64_t r = r0; r < r1;) {
    const int64_t block = r / m.br, end = (block + 1) * m.br < r1 ? (block + 1) * m.br : r1;
    fp8_scale_activations(m, a, block, xs.data());
    while (r < end) {
      const int64_t n = end - r < kRowChunk ? end - r : kRowChunk;
      for (int t0 = 0; t0 < a.T; t0 += kTile)
        kTiles[a.T - t0 < kTile ? a.T - t0 : kTile](m.w + r * m.lw, m.lw, n, m.C, xs.data() + t0 * m.C,
                                                     a.y + t0 * a.ldy + r, a.ldy);
      r += n;
    }
  }
}

}  // namespace shardsmith_host
