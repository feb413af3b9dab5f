// AVX-512 rows of the host expert kernel (see host_kernel.cpp and host_kernel.h); picked at run
// time where the CPU has AVX-512F and BW (plus the AVX2, FMA and F16C it builds on).
//
// fp4:  16 bytes (32 codes) per group: zero-extended to 16 dwords, whose low 4 bits (the low
//       nibbles) and, after a shift by 4, whose high nibbles index a 16-entry float table of e2m1
//       values already times the group's UE8M0 scale (vpermps: one instruction per 16 weights; the
//       scaled table is exact, the scale a power of two); x in the fp4 activation layout
//       (host_kernel.h), so a tile's tokens are at fixed offsets from one pointer.
// fp8:  32 bytes per step, e4m3 -> f16 by bit moves on 32 16-bit lanes (see host_kernel_avx2.cpp),
//       two vcvtph2ps to 32 floats (2^-8 of the values); no table gather and no multiply by the
//       scale: each thread multiplies the activations by the block scales (times 2^8) once per
//       128-row block (a T x C float buffer), so the inner loop is decode + FMA only.
// bf16: 16 per step, shifted into the high half of a float.
// Short token tiles keep 2-4 independent accumulator chains per token so the FMA latency is
// hidden; up to kTile tokens share each decoded vector, and at 2-8 tokens 2-4 rows share each
// activation vector loaded (kRowsAt), so the activations are not re-read from L2 for every row.

#include "host_kernel.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx2,fma,f16c")
#endif

namespace shardsmith_host {
namespace {

// Rows per call of a row function at NT tokens: every activation vector a step loads serves NR rows.
// At one token the activations (16 KiB for C = 4096) stay in L1 and one row at a time keeps the
// most independent chains; at 4-8 tokens they are 64-128 KiB, so each row re-reading them from L2
// set the time (FP4 at 8 tokens took 8x one token's time), and NR rows share each load: NR * NT
// accumulators (times the chains) fill at most 16 of the 32 zmm registers.
template <int NT>
constexpr int kRowsAt = NT == 1 ? 1 : NT <= 4 ? 4 : 2;

// 32 fp4 codes of NR rows (16 bytes each, row i at w + i * lw, its UE8M0 scale at s[i * ls]) against
// NT tokens (x + t * 32: 16 even columns, then 16 odd ones).
template <int NR, int NT>
inline void fp4_group(const uint8_t* w, int64_t lw, const uint8_t* s, int64_t ls, const float* x, __m512 lut,
                      __m512 (&acc)[NR][NT]) {
  __m512 lo[NR], hi[NR];
  for (int i = 0; i < NR; ++i) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i * lw)));
    const __m512 table = _mm512_mul_ps(lut, _mm512_set1_ps(ue8m0(s[i * ls])));
    lo[i] = _mm512_permutexvar_ps(idx, table);                         // even columns
    hi[i] = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);  // odd columns
  }
  for (int t = 0; t < NT; ++t) {
    const __m512 xl = _mm512_loadu_ps(x + t * 32), xh = _mm512_loadu_ps(x + t * 32 + 16);
    for (int i = 0; i < NR; ++i) {
      acc[i][t] = _mm512_fmadd_ps(lo[i], xl, acc[i][t]);
      acc[i][t] = _mm512_fmadd_ps(hi[i], xh, acc[i][t]);
    }
  }
}

// NR fp4 rows (row i: bytes w + i * lw, scales s + i * ls, output y + i) against NT tokens. U groups
// per step, each with its own accumulators, hide the FMA latency where few tokens share a row; each
// accumulator sees the same operations in the same order whatever NR is, so a row's result does not
// depend on the rows it was computed with.
template <int NR, int NT>
void fp4_rows(const Matrix& m, const float* x, int64_t gstride, const uint8_t* w, const uint8_t* s, float* y,
              int64_t ldy) {
  const int64_t pf = prefetch_distance();
  constexpr int U = NT == 1 ? 4 : NT == 2 ? 2 : 1;
  const __m512 lut = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
  __m512 acc[U][NR][NT];
  for (int u = 0; u < U; ++u)
    for (int i = 0; i < NR; ++i)
      for (int t = 0; t < NT; ++t) acc[u][i][t] = _mm512_setzero_ps();
  const int64_t groups = m.C / 32;
  int64_t g = 0;
  for (; g + U <= groups; g += U) {
    if ((g & 3) < U)  // once per 64-byte line (4 groups) of each row
      for (int i = 0; i < NR; ++i) prefetch_ahead(w + i * m.lw + g * 16, pf);
    for (int u = 0; u < U; ++u)
      fp4_group<NR, NT>(w + (g + u) * 16, m.lw, s + g + u, m.ls8, x + (g + u) * gstride, lut, acc[u]);
  }
  for (; g < groups; ++g) fp4_group<NR, NT>(w + g * 16, m.lw, s + g, m.ls8, x + g * gstride, lut, acc[0]);
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t) {
      __m512 sum = acc[0][i][t];
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[u][i][t]);
      y[t * ldy + i] = _mm512_reduce_add_ps(sum);
    }
}

// 16 e4m3 bytes -> 16 floats, each 2^-8 times its value.
inline __m512 fp8x16(const uint8_t* p) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));  // sign-extended
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));  // S.0EEEE.MMM.0000000
  const __m256i nan = _mm256_and_si256(
      _mm256_cmpeq_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x7E00));
  return _mm512_cvtph_ps(_mm256_or_si256(h, nan));
}

// 32 e4m3 bytes -> 32 floats in two halves (columns 0-15, 16-31), each 2^-8 times its value. The
// bytes are sign-extended to 16 bits, so after the shift by 7 the sign is already in bit 15 and its
// copy in bit 14 is cleared (S.S.EEEE.MMM.0000000 -> S.0EEEE.MMM.0000000, fp8x16's f16 pattern).
inline void fp8x32(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));  // sign-extended
  __m512i h = _mm512_and_si512(_mm512_slli_epi16(b, 7), _mm512_set1_epi16(static_cast<short>(0xBF80)));
  const __mmask32 nan = _mm512_cmpeq_epu16_mask(_mm512_and_si512(b, _mm512_set1_epi16(0x7F)), _mm512_set1_epi16(0x7F));
  h = _mm512_mask_mov_epi16(h, nan, _mm512_set1_epi16(0x7E00));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

// NR fp8 rows (row i at w + i * lw, output y + i) of one scale block against NT tokens of activations
// already times the block's column scales (and 2^8): xs[t * C + c] (fp8_rows in host_kernel.h). K
// chains per row and token: the 32 columns of a step go to K accumulators (K = 2: low and high
// halves apart; with one token, two steps per iteration make four chains).
template <int NT>
constexpr int kFp8Chains = NT == 1 ? 4 : NT <= 4 ? 2 : 1;

template <int NR, int NT>
void fp8_row(const uint8_t* w, int64_t lw, int64_t C, const float* xs, float* y, int64_t ldy) {
  const int64_t pf = prefetch_distance();
  constexpr int K = kFp8Chains<NT>;
  constexpr int U = K == 4 ? 2 : 1;  // 32-column steps per iteration
  __m512 acc[K][NR][NT];
  float tail[NR][NT];
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t) {
      tail[i][t] = 0.f;
      for (int k = 0; k < K; ++k) acc[k][i][t] = _mm512_setzero_ps();
    }
  int64_t c = 0;
  for (; c + 32 * U <= C; c += 32 * U) {
    if ((c & 63) < 32 * U)  // once per 64-byte line of each row
      for (int i = 0; i < NR; ++i) prefetch_ahead(w + i * lw + c, pf);
    for (int u = 0; u < U; ++u) {
      __m512 lo[NR], hi[NR];
      for (int i = 0; i < NR; ++i) fp8x32(w + i * lw + c + 32 * u, lo[i], hi[i]);
      for (int t = 0; t < NT; ++t) {
        const float* x = xs + t * C + c + 32 * u;
        const __m512 xl = _mm512_loadu_ps(x), xh = _mm512_loadu_ps(x + 16);
        for (int i = 0; i < NR; ++i) {
          acc[(2 * u) % K][i][t] = _mm512_fmadd_ps(lo[i], xl, acc[(2 * u) % K][i][t]);
          acc[(2 * u + 1) % K][i][t] = _mm512_fmadd_ps(hi[i], xh, acc[(2 * u + 1) % K][i][t]);
        }
      }
    }
  }
  for (; c + 16 <= C; c += 16)
    for (int i = 0; i < NR; ++i) {
      const __m512 v = fp8x16(w + i * lw + c);
      for (int t = 0; t < NT; ++t) acc[0][i][t] = _mm512_fmadd_ps(v, _mm512_loadu_ps(xs + t * C + c), acc[0][i][t]);
    }
  for (; c < C; ++c)
    for (int i = 0; i < NR; ++i) {
      const float v = fp8_e4m3(w[i * lw + c]) * (1.f / 256.f);
      for (int t = 0; t < NT; ++t) tail[i][t] = std::fma(v, xs[t * C + c], tail[i][t]);
    }
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t) {
      __m512 sum = acc[0][i][t];
      for (int k = 1; k < K; ++k) sum = _mm512_add_ps(sum, acc[k][i][t]);
      y[t * ldy + i] = _mm512_reduce_add_ps(sum) + tail[i][t];
    }
}

inline __m512 bf16x16(const uint8_t* p) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}

// NR bf16 rows (row i at w + i * lw, output y + i) against NT tokens, U chains per row and token.
template <int NR, int NT>
void bf16_rows(const Matrix& m, const float* x, const uint8_t* w, float* y, int64_t ldy) {
  constexpr int U = NT == 1 ? 4 : NT == 2 ? 2 : 1;  // 16-column steps per iteration, own accumulators each
  __m512 acc[U][NR][NT];
  float tail[NR][NT];
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t) {
      tail[i][t] = 0.f;
      for (int u = 0; u < U; ++u) acc[u][i][t] = _mm512_setzero_ps();
    }
  int64_t c = 0;
  for (; c + 16 * U <= m.C; c += 16 * U)
    for (int u = 0; u < U; ++u) {
      __m512 v[NR];
      for (int i = 0; i < NR; ++i) v[i] = bf16x16(w + i * m.lw + 2 * (c + 16 * u));
      for (int t = 0; t < NT; ++t) {
        const __m512 xv = _mm512_loadu_ps(x + t * m.C + c + 16 * u);
        for (int i = 0; i < NR; ++i) acc[u][i][t] = _mm512_fmadd_ps(v[i], xv, acc[u][i][t]);
      }
    }
  for (; c + 16 <= m.C; c += 16)
    for (int i = 0; i < NR; ++i) {
      const __m512 v = bf16x16(w + i * m.lw + 2 * c);
      for (int t = 0; t < NT; ++t) acc[0][i][t] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + t * m.C + c), acc[0][i][t]);
    }
  for (; c < m.C; ++c)
    for (int i = 0; i < NR; ++i) {
      const float v = bf16(w + i * m.lw + 2 * c);
      for (int t = 0; t < NT; ++t) tail[i][t] = std::fma(v, x[t * m.C + c], tail[i][t]);
    }
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t) {
      __m512 sum = acc[0][i][t];
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[u][i][t]);
      y[t * ldy + i] = _mm512_reduce_add_ps(sum) + tail[i][t];
    }
}

// Rows [r, r + n) against the token tile at t0 of NT tokens: kRowsAt<NT> rows per call, the rest one by one.
template <int NT>
void fp4_tile(const Matrix& m, const Activations& a, int t0, int64_t r, int64_t n) {
  constexpr int NR = kRowsAt<NT>;
  const float* x = a.x + t0 * 32;
  const int64_t gstride = int64_t{a.T} * 32;
  float* y = a.y + t0 * a.ldy;
  const bool blocked = row_blocking();
  int64_t i = 0;
  for (; blocked && i + NR <= n; i += NR)
    fp4_rows<NR, NT>(m, x, gstride, m.w + (r + i) * m.lw, m.s8 + (r + i) * m.ls8, y + r + i, a.ldy);
  for (; i < n; ++i) fp4_rows<1, NT>(m, x, gstride, m.w + (r + i) * m.lw, m.s8 + (r + i) * m.ls8, y + r + i, a.ldy);
}

template <int NT>
void bf16_tile(const Matrix& m, const Activations& a, int t0, int64_t r, int64_t n) {
  constexpr int NR = kRowsAt<NT>;
  const float* x = a.x + t0 * m.C;
  float* y = a.y + t0 * a.ldy;
  const bool blocked = row_blocking();
  int64_t i = 0;
  for (; blocked && i + NR <= n; i += NR) bf16_rows<NR, NT>(m, x, m.w + (r + i) * m.lw, y + r + i, a.ldy);
  for (; i < n; ++i) bf16_rows<1, NT>(m, x, m.w + (r + i) * m.lw, y + r + i, a.ldy);
}

template <int NT>
void fp8_tile(const uint8_t* w, int64_t lw, int64_t n, int64_t C, const float* xs, float* y, int64_t ldy) {
  constexpr int NR = NT == 1 ? 1 : NT == 2 ? 4 : 2;  // NR * NT * K <= 16 accumulators
  const bool blocked = row_blocking();
  int64_t i = 0;
  for (; blocked && i + NR <= n; i += NR) fp8_row<NR, NT>(w + i * lw, lw, C, xs, y + i, ldy);
  for (; i < n; ++i) fp8_row<1, NT>(w + i * lw, lw, C, xs, y + i, ldy);
}

constexpr TileFn kFp4[kTile + 1] = {nullptr, fp4_tile<1>, fp4_tile<2>, fp4_tile<3>, fp4_tile<4>,
                                    fp4_tile<5>, fp4_tile<6>, fp4_tile<7>, fp4_tile<8>};
constexpr TileFn kBf16[kTile + 1] = {nullptr, bf16_tile<1>, bf16_tile<2>, bf16_tile<3>, bf16_tile<4>,
                                     bf16_tile<5>, bf16_tile<6>, bf16_tile<7>, bf16_tile<8>};
constexpr Fp8TileFn kFp8[kTile + 1] = {nullptr, fp8_tile<1>, fp8_tile<2>, fp8_tile<3>, fp8_tile<4>,
                                       fp8_tile<5>, fp8_tile<6>, fp8_tile<7>, fp8_tile<8>};

}  // namespace

Kernels avx512_kernels() { return {rows<kFp4>, fp8_rows<kFp8>, rows<kBf16>}; }

}  // namespace shardsmith_host

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
namespace shardsmith_host {
Kernels avx512_kernels() { return {}; }
}  // namespace shardsmith_host
#endif
