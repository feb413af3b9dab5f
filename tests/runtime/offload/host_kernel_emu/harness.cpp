// Every vector path of the host expert kernel against the scalar one, on random stored matrices:
// FP4 (column counts 32..4096, odd group counts for the unrolled loops), FP8 (ragged blocks, a NaN
// code) and bf16 (odd column counts), 1..19 tokens (every tile size, several tiles). Built by
// tests/runtime/test_host_kernel_emulated.py with the AVX-512 file compiled against SIMDe, so the
// AVX-512 path is checked on machines without AVX-512. Each path's rows are also computed one per call
// and split at row 5, for the same bits. Prints each failure; exit status 1 if any.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "host_kernel.h"

namespace shardsmith_host {
Kernels emulated_avx512_kernels();
}
using namespace shardsmith_host;

namespace {

int failures = 0;

void compare(const char* path, const char* what, const std::vector<float>& got, const std::vector<float>& want) {
  double top = 0, err = 0;
  int nan_mismatch = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) || std::isnan(want[i])) {
      nan_mismatch += std::isnan(got[i]) != std::isnan(want[i]);
      continue;
    }
    top = std::max(top, static_cast<double>(std::fabs(want[i])));
    err = std::max(err, static_cast<double>(std::fabs(got[i] - want[i])));
  }
  if (err > 2e-5 * top || nan_mismatch) {
    ++failures;
    std::printf("FAIL %s %s: max error %g, max value %g, NaN mismatches %d\n", path, what, err, top, nan_mismatch);
  }
}

// The same rows computed one per call (row blocking off) and split at an odd row (as parallel_for's
// chunks may be) must give the same bits as all rows at once.
void same_bits(const char* path, const char* what, RowsFn f, const Matrix& m, const std::vector<float>& x, int T,
               int R, const std::vector<float>& got) {
  std::vector<float> one(T * R), split(T * R);
  g_row_blocking = false;
  f(m, {x.data(), T, one.data(), R}, 0, R);
  g_row_blocking = true;
  f(m, {x.data(), T, split.data(), R}, 0, 5);
  f(m, {x.data(), T, split.data(), R}, 5, R);
  for (const auto* v : {&one, &split})
    if (std::memcmp(v->data(), got.data(), got.size() * sizeof(float)) != 0) {
      ++failures;
      std::printf("FAIL %s %s: %s differs in its bits\n", path, what, v == &one ? "one row per call" : "split at row 5");
    }
}

}  // namespace

int main() {
  std::mt19937 rng(1);
  const Kernels scalar = scalar_kernels();
  struct Path { const char* name; Kernels k; };
  std::vector<Path> paths{{"avx512-emulated", emulated_avx512_kernels()}};
  __builtin_cpu_init();
  if (avx2_kernels().fp4 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    paths.push_back({"avx2", avx2_kernels()});
  auto value = [&] { return static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 500.f; };
  char what[96];
  int cases = 0;
  for (int C : {32, 64, 96, 128, 160, 4096}) {
    for (int T = 1; T <= 19; T += (T < 9 ? 1 : 5)) {
      const int R = 37;
      std::vector<uint8_t> w(R * C / 2), s(R * C / 32);
      for (auto& b : w) b = rng() & 0xFF;
      for (auto& b : s) b = 118 + rng() % 8;
      std::vector<float> x(T * C);
      for (auto& v : x) v = value();
      Matrix m;
      m.w = w.data(), m.lw = C / 2, m.s8 = s.data(), m.ls8 = C / 32, m.C = C;
      std::vector<float> want(T * R);
      scalar.fp4(m, {x.data(), T, want.data(), R}, 0, R);
      std::snprintf(what, sizeof what, "fp4 C=%d T=%d", C, T);
      for (const auto& p : paths) {
        std::vector<float> got(T * R);
        p.k.fp4(m, {x.data(), T, got.data(), R}, 0, R);
        compare(p.name, what, got, want);
        same_bits(p.name, what, p.k.fp4, m, x, T, R, got);
        ++cases;
      }
    }
  }
  for (int fp8 = 0; fp8 < 2; ++fp8) {
    for (int C : {7, 16, 200, 2048}) {
      for (int bc : {8, 16, 40, 48, 128}) {
        for (int T = 1; T <= 19; T += (T < 9 ? 1 : 5)) {
          const int R = 21, br = 8, el = fp8 ? 1 : 2;
          std::vector<uint8_t> w(R * C * el);
          for (auto& b : w) b = rng() & 0xFF;
          if (!fp8)  // finite bf16 of moderate size: the high byte keeps its sign, exponent near 0
            for (int i = 0; i < R * C; ++i) w[2 * i + 1] = (w[2 * i + 1] & 0x80) | (0x3C + rng() % 4);
          else
            for (auto& b : w) b = (b & 0x7F) == 0x7F ? 0 : b;
          if (fp8 && C == 200) w[5 * C + 17] = 0x7F;  // one NaN: row 5 only
          const int sr = (R + br - 1) / br, sc = (C + bc - 1) / bc;
          std::vector<float> scales(sr * sc);
          for (auto& v : scales) v = static_cast<float>(rng() % 1000 + 1) / 1e4f;
          std::vector<float> x(T * C);
          for (auto& v : x) v = value();
          Matrix m;
          m.w = w.data(), m.lw = C * el, m.C = C;
          if (fp8) m.sf = scales.data(), m.lsf = sc, m.br = br, m.bc = bc;
          std::vector<float> want(T * R);
          (fp8 ? scalar.fp8 : scalar.bf16)(m, {x.data(), T, want.data(), R}, 0, R);
          std::snprintf(what, sizeof what, "%s C=%d bc=%d T=%d", fp8 ? "fp8" : "bf16", C, bc, T);
          for (const auto& p : paths) {
            std::vector<float> got(T * R);
            (fp8 ? p.k.fp8 : p.k.bf16)(m, {x.data(), T, got.data(), R}, 0, R);
            compare(p.name, what, got, want);
            same_bits(p.name, what, fp8 ? p.k.fp8 : p.k.bf16, m, x, T, R, got);
            ++cases;
          }
        }
      }
    }
  }
  std::printf("%d cases, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}
