// AVX2 + FMA + F16C rows of the host expert kernel (see host_kernel.cpp and host_kernel.h).
//
// fp4:  16 bytes (32 codes) per step: low and high nibbles through a 16-entry int8 table of
//       2 * e2m1 (exact integers -12..12, pshufb), widened to float; x in the fp4 activation
//       layout (host_kernel.h), so each nibble set meets a contiguous run of x. The group's dot is multiplied by its UE8M0
//       scale times 0.5 (exact: powers of two).
// fp8:  8 bytes per step, e4m3 -> f16 by bit moves (S.EEEE.MMM -> S.0EEEE.MMM0000000 is the same
//       value times 2^-8, subnormals included; S.1111.111 becomes a NaN), vcvtph2ps, times the block
//       scale times 2^8. No table gather.
// bf16: 8 per step, shifted into the high half of a float.
// Up to kTile tokens share each decoded vector; the accumulators are template-sized, so registers.

#include "host_kernel.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>

#include <algorithm>

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
  const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  const int64_t groups = m.C / 32;
  for (int64_t g = 0; g < groups; ++g) {
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
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i s = _mm_slli_epi16(b, 7);                              // 0.S.EEEE.MMM.0000000
  const __m128i h = _mm_add_epi16(s, _mm_and_si128(s, _mm_set1_epi16(0x4000)));  // S moved up a bit
  const __m128i nan = _mm_and_si128(_mm_cmpeq_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), _mm_set1_epi16(0x7F)),
                                    _mm_set1_epi16(0x7E00));
  return _mm256_cvtph_ps(_mm_or_si128(h, nan));
}

inline __m256 bf16x8(const uint8_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

template <bool kFp8, int NT>
void dense_row(const Matrix& m, const float* x, const uint8_t* w, const float* scales, float* y, int64_t ldy) {
  constexpr int kEl = kFp8 ? 1 : 2;  // bytes per element
  __m256 acc[NT];
  float tail[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps(), tail[t] = 0.f;
  const int64_t block = kFp8 ? m.bc : m.C;
  for (int64_t c0 = 0; c0 < m.C; c0 += block) {
    const int64_t c1 = std::min(m.C, c0 + block);
    const float scale = kFp8 ? scales[c0 / m.bc] : 1.f;
    const __m256 sc = _mm256_set1_ps(scale * 256.f);  // fp8x8 returns 2^-8 of the value
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) {
      const __m256 v = kFp8 ? _mm256_mul_ps(fp8x8(w + c), sc) : bf16x8(w + kEl * c);
      for (int t = 0; t < NT; ++t) acc[t] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + t * m.C + c), acc[t]);
    }
    for (; c < c1; ++c) {
      const float v = kFp8 ? fp8_e4m3(w[c]) * scale : bf16(w + 2 * c);
      for (int t = 0; t < NT; ++t) tail[t] += v * x[t * m.C + c];
    }
  }
  for (int t = 0; t < NT; ++t) y[t * ldy] = hsum(acc[t]) + tail[t];
}

// Rows [r0, r1), tokens in tiles of at most kTile (each tile's row code instantiated for its size).
template <int NT>
void fp4_tile(const Matrix& m, const Activations& a, int t0, int64_t r) {
  fp4_row<NT>(m, a.x + t0 * 32, int64_t{a.T} * 32, m.w + r * m.lw, m.s8 + r * m.ls8, a.y + t0 * a.ldy + r, a.ldy);
}

template <bool kFp8, int NT>
void dense_tile(const Matrix& m, const Activations& a, int t0, int64_t r) {
  dense_row<kFp8, NT>(m, a.x + t0 * m.C, m.w + r * m.lw, kFp8 ? m.sf + (r / m.br) * m.lsf : nullptr,
                      a.y + t0 * a.ldy + r, a.ldy);
}

using TileFn = void (*)(const Matrix&, const Activations&, int, int64_t);

template <TileFn const* kTiles>
void rows(const Matrix& m, const Activations& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r)
    for (int t0 = 0; t0 < a.T; t0 += kTile) kTiles[std::min(kTile, a.T - t0)](m, a, t0, r);
}

constexpr TileFn kFp4[kTile + 1] = {nullptr, fp4_tile<1>, fp4_tile<2>, fp4_tile<3>, fp4_tile<4>,
                                    fp4_tile<5>, fp4_tile<6>, fp4_tile<7>, fp4_tile<8>};
constexpr TileFn kFp8[kTile + 1] = {nullptr, dense_tile<true, 1>, dense_tile<true, 2>, dense_tile<true, 3>,
                                    dense_tile<true, 4>, dense_tile<true, 5>, dense_tile<true, 6>,
                                    dense_tile<true, 7>, dense_tile<true, 8>};
constexpr TileFn kBf16[kTile + 1] = {nullptr, dense_tile<false, 1>, dense_tile<false, 2>, dense_tile<false, 3>,
                                     dense_tile<false, 4>, dense_tile<false, 5>, dense_tile<false, 6>,
                                     dense_tile<false, 7>, dense_tile<false, 8>};

}  // namespace

Kernels avx2_kernels() { return {rows<kFp4>, rows<kFp8>, rows<kBf16>}; }

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
