// Host routed-expert kernels: y[t, r] = sum_c W[r, c] * x[t, c] with W read in its stored format.
//
// The weight is decoded 8 or 32 columns at a time into AVX2 registers and multiplied there; no
// dequantized copy is ever written to memory, so an expert's bytes are read exactly once per step
// (a decode batch of T <= 16 tokens shares each decoded vector). Rows are split across torch's
// intra-op threads (at::parallel_for), which the runtime sets to this rank's share of the cores.
//
// Formats (the pack's bank arrays, manifests/README.md):
//   fp4: uint8 [R, C/2], two e2m1 codes per byte, element 2i in the low nibble; UE8M0 scale
//        [R, C/32]: value = e2m1 * 2^(s - 127) (DeepSeek-V4; OCP MX spec v1.0, e2m1 table).
//   fp8: float8_e4m3fn [R, C] with float32 scales [ceil(R/BR), ceil(C/BC)] per BRxBC block
//        (weight_scale_inv of DeepSeek-V3 / Mixtral-FP8 checkpoints; ragged edge blocks allowed).
//   bf16: [R, C], no scale.
// Accumulation is float32; each scale multiplies its block's partial dot product (exact
// power-of-two scales for fp4, so the result equals the dequantize-then-matmul reference within
// float32 rounding). The reference is shardsmith/runtime/layers/experts.py (expert_output).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SHARDSMITH_AVX2 1
#endif

namespace {

constexpr int kMaxTokens = 16;
const float kE2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

float fp8_e4m3_to_float(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 0x7;
  float v;
  if (exp == 0xF && man == 0x7) v = NAN;                       // e4m3fn: only S.1111.111 is NaN
  else if (exp == 0) v = std::ldexp(static_cast<float>(man), -9);  // subnormal: man/8 * 2^-6
  else v = std::ldexp(1.f + man / 8.f, exp - 7);
  return sign ? -v : v;
}

struct Fp8Lut {
  float v[256];
  Fp8Lut() { for (int i = 0; i < 256; ++i) v[i] = fp8_e4m3_to_float(static_cast<uint8_t>(i)); }
};
const Fp8Lut kFp8;

// 2^(s - 127) per UE8M0 byte, and half of it (the AVX2 path holds 2 * e2m1 as exact integers).
struct Ue8m0Lut {
  float one[256], half[256];
  Ue8m0Lut() {
    for (int i = 0; i < 256; ++i) { one[i] = std::ldexp(1.f, i - 127); half[i] = std::ldexp(.5f, i - 127); }
  }
};
const Ue8m0Lut kUe8m0;

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#ifdef SHARDSMITH_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// One FP4 row: out[t] = sum_c W[c] * x[t, c] over C columns (C % 32 == 0).
void fp4_row(const uint8_t* w, const uint8_t* s, const float* x, int64_t ldx, int T, int64_t C, float* out) {
  const int64_t groups = C / 32;
#ifdef SHARDSMITH_AVX2
  // 2 * e2m1 as int8 (exact integers -12..12); the 0.5 goes into the group scale.
  const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[kMaxTokens];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * 16));
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(b, low4));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), low4));
    const __m128i e0 = _mm_unpacklo_epi8(lo, hi);  // elements 0..15 in order
    const __m128i e1 = _mm_unpackhi_epi8(lo, hi);  // elements 16..31
    const __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e0));
    const __m256 v1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e0, 8)));
    const __m256 v2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e1));
    const __m256 v3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e1, 8)));
    const __m256 scale = _mm256_set1_ps(kUe8m0.half[s[g]]);
    for (int t = 0; t < T; ++t) {
      const float* xt = x + t * ldx + g * 32;
      __m256 d = _mm256_mul_ps(v0, _mm256_loadu_ps(xt));
      d = _mm256_fmadd_ps(v1, _mm256_loadu_ps(xt + 8), d);
      d = _mm256_fmadd_ps(v2, _mm256_loadu_ps(xt + 16), d);
      d = _mm256_fmadd_ps(v3, _mm256_loadu_ps(xt + 24), d);
      acc[t] = _mm256_fmadd_ps(d, scale, acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) out[t] = hsum(acc[t]);
#else
  for (int t = 0; t < T; ++t) out[t] = 0.f;
  float vals[32];
  for (int64_t g = 0; g < groups; ++g) {
    for (int i = 0; i < 16; ++i) {
      vals[2 * i] = kE2M1[w[g * 16 + i] & 0xF];
      vals[2 * i + 1] = kE2M1[w[g * 16 + i] >> 4];
    }
    const float scale = kUe8m0.one[s[g]];
    for (int t = 0; t < T; ++t) {
      const float* xt = x + t * ldx + g * 32;
      float d = 0.f;
      for (int i = 0; i < 32; ++i) d += vals[i] * xt[i];
      out[t] += d * scale;
    }
  }
#endif
}

// One FP8 (scales != nullptr, one per BC columns) or bf16 (scales == nullptr) row.
template <bool kFp8Fmt>
void dense_row(const void* wp, const float* scales, int64_t bc, const float* x, int64_t ldx, int T, int64_t C,
               float* out) {
  const uint8_t* w8 = static_cast<const uint8_t*>(wp);
  const uint16_t* w16 = static_cast<const uint16_t*>(wp);
  const int64_t block = kFp8Fmt ? bc : C;
  for (int t = 0; t < T; ++t) out[t] = 0.f;
  for (int64_t c0 = 0; c0 < C; c0 += block) {
    const int64_t c1 = std::min(C, c0 + block);
    const float scale = kFp8Fmt ? scales[c0 / bc] : 1.f;
    float part[kMaxTokens];
    int64_t c = c0;
#ifdef SHARDSMITH_AVX2
    __m256 acc[kMaxTokens];
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
    for (; c + 8 <= c1; c += 8) {
      __m256 v;
      if constexpr (kFp8Fmt) {
        const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w8 + c)));
        v = _mm256_i32gather_ps(kFp8.v, idx, 4);
      } else {
        const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w16 + c)));
        v = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
      }
      for (int t = 0; t < T; ++t) acc[t] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + t * ldx + c), acc[t]);
    }
    for (int t = 0; t < T; ++t) part[t] = hsum(acc[t]);
#else
    for (int t = 0; t < T; ++t) part[t] = 0.f;
#endif
    for (; c < c1; ++c) {
      const float v = kFp8Fmt ? kFp8.v[w8[c]] : bf16_to_float(w16[c]);
      for (int t = 0; t < T; ++t) part[t] += v * x[t * ldx + c];
    }
    for (int t = 0; t < T; ++t) out[t] += part[t] * scale;
  }
}

void check_x(const at::Tensor& x, int64_t C) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [T, C]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxTokens, "x has ", x.size(0), " tokens; this kernel takes 1..", kMaxTokens);
  TORCH_CHECK(x.size(1) == C, "x has ", x.size(1), " columns, the weight ", C);
}

// y [T, R] float32 = x [T, C] @ W^T for an FP4 weight [R, C/2] with UE8M0 scales [R, C/32].
at::Tensor fp4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s) {
  TORCH_CHECK(w.dim() == 2 && w.element_size() == 1 && w.stride(1) == 1, "fp4 weight must be [R, C/2] bytes, rows contiguous");
  TORCH_CHECK(s.dim() == 2 && s.element_size() == 1 && s.stride(1) == 1, "fp4 scale must be [R, C/32] bytes");
  const int64_t R = w.size(0), C = w.size(1) * 2;
  TORCH_CHECK(C % 32 == 0 && s.size(0) == R && s.size(1) == C / 32, "fp4 scale shape does not match the weight");
  check_x(x, C);
  const int T = static_cast<int>(x.size(0));
  at::Tensor y = at::empty({R, T}, x.options());  // row-major per weight row, transposed at the end
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const uint8_t* sp = static_cast<const uint8_t*>(s.data_ptr());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t lw = w.stride(0), ls = s.stride(0);
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fp4_row(wp + r * lw, sp + r * ls, xp, C, T, C, yp + r * T);
  });
  return y.t().contiguous();
}

// y [T, R] float32 = x [T, C] @ W^T for an FP8 e4m3 weight [R, C] with float32 block scales, or bf16.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                        int64_t br, int64_t bc) {
  TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1, "weight must be [R, C], rows contiguous");
  const int64_t R = w.size(0), C = w.size(1);
  check_x(x, C);
  const bool fp8 = scale.has_value();
  if (fp8) {
    TORCH_CHECK(w.element_size() == 1, "fp8 weight must be 1 byte per element");
    TORCH_CHECK(br > 0 && bc > 0, "fp8 block must be positive");
    const at::Tensor& s = *scale;
    TORCH_CHECK(s.dim() == 2 && s.scalar_type() == at::kFloat && s.stride(1) == 1, "fp8 scale must be float32 [R/BR, C/BC]");
    TORCH_CHECK(s.size(0) == (R + br - 1) / br && s.size(1) == (C + bc - 1) / bc, "fp8 scale shape does not match the weight");
  } else {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "dense weight must be bfloat16 (fp8 needs its scale)");
  }
  const int T = static_cast<int>(x.size(0));
  at::Tensor y = at::empty({R, T}, x.options());
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const float* sp = fp8 ? scale->data_ptr<float>() : nullptr;
  const int64_t ls = fp8 ? scale->stride(0) : 0, lw = w.stride(0) * w.element_size();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (fp8) dense_row<true>(wp + r * lw, sp + (r / br) * ls, bc, xp, C, T, C, yp + r * T);
      else dense_row<false>(wp + r * lw, nullptr, 0, xp, C, T, C, yp + r * T);
    }
  });
  return y.t().contiguous();
}

}  // namespace

TORCH_LIBRARY(shardsmith_host, m) {
  m.def("fp4_linear(Tensor x, Tensor w, Tensor s) -> Tensor", &fp4_linear);
  m.def("dense_linear(Tensor x, Tensor w, Tensor? scale, int br, int bc) -> Tensor", &dense_linear);
}
