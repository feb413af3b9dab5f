// <immintrin.h> for the emulated build of host_kernel_avx512.cpp: SIMDe's portable AVX-512 under the
// native names, plus the two intrinsics this SIMDe release lacks (plain loops, same results).
#pragma once
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cstdint>

#ifndef _mm512_cvtepu8_epi32
static inline simde__m512i _mm512_cvtepu8_epi32(simde__m128i a) {
  uint8_t b[16];
  int32_t o[16];
  simde_mm_storeu_si128(reinterpret_cast<simde__m128i*>(b), a);
  for (int i = 0; i < 16; ++i) o[i] = b[i];
  return simde_mm512_loadu_si512(o);
}
#endif
#ifndef _mm512_reduce_add_ps
static inline float _mm512_reduce_add_ps(simde__m512 a) {
  float f[16], s = 0.f;
  simde_mm512_storeu_ps(f, a);
  for (int i = 0; i < 16; ++i) s += f[i];
  return s;
}
#endif
