// AVX2 + FMA + F16C rows of the host expert kernel (see host_kernel.cpp and host_kernel.h).
//
// fp4:  16 bytes (32 codes) per step: low and high nibbles through a 16-entry int8 table of
//       2 * e2m1 (exact integers -12..12, pshufb), widened to float; x in the fp4 activation
//       layout (host_kernel.h), so each nibble set meets a contiguous run of x. The group's dot is multiplied by its UE8M0
//       scale times 0.5 (exact: powers of two).
// fp8:  16 bytes per step, e4m3 -> f16 by bit moves on 16-bit lanes (S.EEEE.MMM -> S.0EEEE.MMM0000000
//       is the same value times 2^-8, subnormals included; S.1111.111 becomes a NaN): the byte
//       sign-extended, shifted left by 7, the sign's copy in bit 14 cleared; two vcvtph2ps;
//       no table gather and no multiply by the scale: the block scales (times 2^8) are folded into a
//       per-thread copy of the activations once per row block (fp8_rows, host_kernel.h).
// bf16: 8 per step, shifted into the high half of a float.
// Up to kTile tokens share each decoded vector (fp8 and bf16: at 2-4 tokens two rows share each
// activation vector loaded); the accumulators are template-sized, so registers.

#include "host_kernel.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace shardsmith_host {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 widen(__m128i i8) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(i8)); }

template <int NT>
void fp4_row(const Matrix& m, const float* x, int64_t gstride, const uint8_t* w, const uint8_t* s, float* y,
             int64_t ldy) {
  const int64_t pf = prefetch_distance();
  const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  const int64_t groups = m.C / 32;
  for (int64_t g = 0; g < groups; ++g) {
    if ((g & 3) == 0) prefetch_ahead(w + g * 16, pf);  // once per 64-byte line (4 groups)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * 16));
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(b, low4));                     // even columns
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), low4));  // odd columns
    const __m256 v0 = widen(lo), v1 = widen(_mm_srli_si128(lo, 8)), v2 = widen(hi), v3 = widen(_mm_srli_si128(hi, 8));
    const __m256 sc = _mm256_set1_ps(.5f * ue8m0(s[g]));
    for (int t = 0; t < NT; ++t) {
      const float* xt = x + g * gstride + t * 32;
      __m256 d = _mm256_mul_ps(v0, _mm256_loadu_ps(xt));
      d = _mm256_fmadd_ps(v1, _mm256_loadu_ps(xt + 8), d);
      d = _mm256_fmadd_ps(v2, _mm256_loadu_ps(xt + 16), d);
      d = _mm256_fmadd_ps(v3, _mm256_loadu_ps(xt + 24), d);
      acc[t] = _mm256_fmadd_ps(d, sc, acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) y[t * ldy] = hsum(acc[t]);
}

// 8 e4m3 bytes -> 8 floats, each 2^-8 times its value.
inline __m256 fp8x8(const uint8_t* p) {
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));  // sign-extended
  const __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));  // S.0EEEE.MMM.0000000
  const __m128i nan = _mm_and_si128(_mm_cmpeq_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), _mm_set1_epi16(0x7F)),
                                    _mm_set1_epi16(0x7E00));
  return _mm256_cvtph_ps(_mm_or_si128(h, nan));
}

// 16 e4m3 bytes -> columns 0-7 and 8-15 as floats, 2^-8 of each value: fp8x8's moves on 16 lanes.
inline void fp8x16(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));  // sign-extended
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
  const __m256i nan = _mm256_and_si256(
      _mm256_cmpeq_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x7E00));
  const __m256i f = _mm256_or_si256(h, nan);
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(f));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(f, 1));
}

// NR fp8 rows of one scale block (row i at w + i * lw, output y + i) against NT tokens of pre-scaled
// activations xs[t * C + c] (fp8_rows, host_kernel.h); K independent accumulator chains per row and
// token hide the FMA latency when few tokens share a row. Each accumulator sees the same operations in
// the same order whatever NR is.
template <int NR, int NT>
void fp8_rows_nr(const uint8_t* w, int64_t lw, int64_t C, const float* xs, float* y, int64_t ldy) {
  const int64_t pf = prefetch_distance();
  constexpr int K = NT == 1 ? 4 : NT == 2 ? 2 : 1;
  constexpr int U = K == 4 ? 2 : 1;  // 16-column steps per iteration
  __m256 acc[K][NR][NT];
  float tail[NR][NT];
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t) {
      tail[i][t] = 0.f;
      for (int k = 0; k < K; ++k) acc[k][i][t] = _mm256_setzero_ps();
    }
  int64_t c = 0;
  for (; c + 16 * U <= C; c += 16 * U) {
    if ((c & 63) < 16 * U)  // once per 64-byte line of each row
      for (int i = 0; i < NR; ++i) prefetch_ahead(w + i * lw + c, pf);
    for (int u = 0; u < U; ++u) {
      __m256 lo[NR], hi[NR];
      for (int i = 0; i < NR; ++i) fp8x16(w + i * lw + c + 16 * u, lo[i], hi[i]);
      for (int t = 0; t < NT; ++t) {
        const float* x = xs + t * C + c + 16 * u;
        const __m256 xl = _mm256_loadu_ps(x), xh = _mm256_loadu_ps(x + 8);
        for (int i = 0; i < NR; ++i) {
          acc[(2 * u) % K][i][t] = _mm256_fmadd_ps(lo[i], xl, acc[(2 * u) % K][i][t]);
          acc[(2 * u + 1) % K][i][t] = _mm256_fmadd_ps(hi[i], xh, acc[(2 * u + 1) % K][i][t]);
        }
      }
    }
  }
  for (; c + 8 <= C; c += 8)
    for (int i = 0; i < NR; ++i) {
      const __m256 v = fp8x8(w + i * lw + c);
      for (int t = 0; t < NT; ++t) acc[0][i][t] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xs + t * C + c), acc[0][i][t]);
    }
  for (; c < C; ++c)
    for (int i = 0; i < NR; ++i) {
      const float v = fp8_e4m3(w[i * lw + c]) * (1.f / 256.f);
      for (int t = 0; t < NT; ++t) tail[i][t] = std::fma(v, xs[t * C + c], tail[i][t]);
    }
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t) {
      __m256 sum = acc[0][i][t];
      for (int k = 1; k < K; ++k) sum = _mm256_add_ps(sum, acc[k][i][t]);
      y[t * ldy + i] = hsum(sum) + tail[i][t];
    }
}

inline __m256 bf16x8(const uint8_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

template <int NR, int NT>
void bf16_rows(const Matrix& m, const float* x, const uint8_t* w, float* y, int64_t ldy) {
  __m256 acc[NR][NT];
  float tail[NR][NT];
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm256_setzero_ps(), tail[i][t] = 0.f;
  int64_t c = 0;
  for (; c + 8 <= m.C; c += 8) {
    __m256 v[NR];
    for (int i = 0; i < NR; ++i) v[i] = bf16x8(w + i * m.lw + 2 * c);
    for (int t = 0; t < NT; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * m.C + c);
      for (int i = 0; i < NR; ++i) acc[i][t] = _mm256_fmadd_ps(v[i], xv, acc[i][t]);
    }
  }
  for (; c < m.C; ++c)
    for (int i = 0; i < NR; ++i) {
      const float v = bf16(w + i * m.lw + 2 * c);
      for (int t = 0; t < NT; ++t) tail[i][t] = std::fma(v, x[t * m.C + c], tail[i][t]);
    }
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t) y[t * ldy + i] = hsum(acc[i][t]) + tail[i][t];
}

// Rows per call at NT tokens (16 ymm registers: NR * NT accumulators, times the chains, at most 8):
// at 2-4 tokens two rows share each activation load; fp4 keeps one (its per-group dot needs its own
// registers per row and token).
template <int NT>
constexpr int kRowsAt = NT >= 2 && NT <= 4 ? 2 : 1;

// Rows [r, r + n) against the token tile at t0 (host_kernel.h: rows).
template <int NT>
void fp4_tile(const Matrix& m, const Activations& a, int t0, int64_t r, int64_t n) {
  for (int64_t i = r; i < r + n; ++i)
    fp4_row<NT>(m, a.x + t0 * 32, int64_t{a.T} * 32, m.w + i * m.lw, m.s8 + i * m.ls8, a.y + t0 * a.ldy + i, a.ldy);
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
  constexpr int NR = kRowsAt<NT>;
  const bool blocked = row_blocking();
  int64_t i = 0;
  for (; blocked && i + NR <= n; i += NR) fp8_rows_nr<NR, NT>(w + i * lw, lw, C, xs, y + i, ldy);
  for (; i < n; ++i) fp8_rows_nr<1, NT>(w + i * lw, lw, C, xs, y + i, ldy);
}

constexpr TileFn kFp4[kTile + 1] = {nullptr, fp4_tile<1>, fp4_tile<2>, fp4_tile<3>, fp4_tile<4>,
                                    fp4_tile<5>, fp4_tile<6>, fp4_tile<7>, fp4_tile<8>};
constexpr Fp8TileFn kFp8[kTile + 1] = {nullptr, fp8_tile<1>, fp8_tile<2>, fp8_tile<3>, fp8_tile<4>,
                                       fp8_tile<5>, fp8_tile<6>, fp8_tile<7>, fp8_tile<8>};
constexpr TileFn kBf16[kTile + 1] = {nullptr, bf16_tile<1>, bf16_tile<2>, bf16_tile<3>, bf16_tile<4>,
                                     bf16_tile<5>, bf16_tile<6>, bf16_tile<7>, bf16_tile<8>};

}  // namespace

Kernels avx2_kernels() { return {rows<kFp4>, fp8_rows<kFp8>, rows<kBf16>}; }

}  // namespace shardsmith_host

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
namespace shardsmith_host {
Kernels avx2_kernels() { return {}; }
}  // namespace shardsmith_host
#endif
