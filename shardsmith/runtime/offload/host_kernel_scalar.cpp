// Scalar rows of the host expert kernel and its decode tables (see host_kernel.cpp, host_kernel.h):
// plain C++ loops, the path of CPUs without AVX2 and the one the vector paths are checked against
// (tests/runtime/test_host_kernel*.py). x for fp4 is in the fp4 activation layout, as for every path.

#include "host_kernel.h"

#include <cmath>

namespace shardsmith_host {

namespace {

float e4m3_value(uint8_t b) {
  const int exp = (b >> 3) & 0xF, man = b & 0x7;
  float v;
  if (exp == 0xF && man == 0x7) v = NAN;                            // e4m3fn: only S.1111.111 is NaN
  else if (exp == 0) v = std::ldexp(static_cast<float>(man), -9);  // subnormal: man/8 * 2^-6
  else v = std::ldexp(1.f + man / 8.f, exp - 7);
  return (b >> 7) ? -v : v;
}

}  // namespace

Tables::Tables() {
  for (int i = 0; i < 256; ++i) {
    ue8m0[i] = i == 255 ? NAN : std::ldexp(1.f, i - 127);
    fp8[i] = e4m3_value(static_cast<uint8_t>(i));
  }
}
const Tables kTables;
std::atomic<int64_t> g_prefetch_bytes{0};
std::atomic<bool> g_row_blocking{true};

namespace {

const float kE2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

void fp4_rows_scalar(const Matrix& m, const Activations& a, int64_t r0, int64_t r1) {
  const int64_t groups = m.C / 32;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* w = m.w + r * m.lw;
    const uint8_t* s = m.s8 + r * m.ls8;
    for (int t = 0; t < a.T; ++t) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const float* x = a.x + (g * a.T + t) * 32;
        const float sc = ue8m0(s[g]);
        for (int i = 0; i < 16; ++i) {
          const uint8_t b = w[g * 16 + i];
          acc += kE2M1[b & 0xF] * sc * x[i] + kE2M1[b >> 4] * sc * x[16 + i];
        }
      }
      a.y[t * a.ldy + r] = acc;
    }
  }
}

template <bool kFp8>
void dense_rows_scalar(const Matrix& m, const Activations& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* w = m.w + r * m.lw;
    const float* sc = kFp8 ? m.sf + (r / m.br) * m.lsf : nullptr;
    for (int t = 0; t < a.T; ++t) {
      const float* x = a.x + t * m.C;
      float acc = 0.f;
      for (int64_t c = 0; c < m.C; ++c) {
        const float v = kFp8 ? fp8_e4m3(w[c]) * sc[c / m.bc] : bf16(w + 2 * c);
        acc += v * x[c];
      }
      a.y[t * a.ldy + r] = acc;
    }
  }
}

}  // namespace

Kernels scalar_kernels() { return {fp4_rows_scalar, dense_rows_scalar<true>, dense_rows_scalar<false>}; }

}  // namespace shardsmith_host

