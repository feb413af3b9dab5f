// Host routed-expert kernels: y[t, r] = sum_c W[r, c] * x[t, c] with W read in its stored format, and
// a layer's routed experts (gate_up, SwiGLU, down) in one call.
//
// The weight is decoded in registers and multiplied there; no dequantized copy is written to
// memory, so an expert's bytes are read once per step, and up to kTile tokens share every decoded
// vector (more tokens: the row is decoded again per tile, from cache). Rows are split across
// torch's intra-op threads (at::parallel_for), which the runtime sets to this rank's share of the
// cores. The instruction set is chosen per call from those this CPU supports (isas()): scalar C++
// (host_kernel_scalar.cpp, also the decode tables), AVX2 + FMA + F16C (host_kernel_avx2.cpp),
// AVX-512F (host_kernel_avx512.cpp); the build needs no -march flag, each file targets its own set
// by pragma. This file holds the torch operators: checks, dispatch, threads, SwiGLU.
//
// Formats (the pack's bank arrays, manifests/README.md):
//   fp4: uint8 [R, C/2], two e2m1 codes per byte, element 2i in the low nibble; UE8M0 scale
//        [R, C/32]: value = e2m1 * 2^(s - 127) (DeepSeek-V4; OCP MX spec v1.0, e2m1 table).
//   fp8: float8_e4m3fn [R, C] with float32 scales [ceil(R/BR), ceil(C/BC)] per BRxBC block
//        (weight_scale_inv of DeepSeek-V3 / Mixtral-FP8 checkpoints; ragged edge blocks allowed).
//   bf16: [R, C], no scale.
// Accumulation is float32; every weight is multiplied by its scale before the product, as the
// dequantize-then-matmul reference does, so results equal it within float32 rounding. The
// reference is shardsmith/runtime/layers/experts.py (expert_output).

#include "host_kernel.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using namespace shardsmith_host;

bool cpu_has(const char* feature) {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
  __builtin_cpu_init();
  if (!std::strcmp(feature, "avx2")) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                                            __builtin_cpu_supports("f16c");
  if (!std::strcmp(feature, "avx512"))
    return cpu_has("avx2") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#endif
  (void)feature;
  return false;
}

// The instruction sets this build and this CPU both support, worst first: "scalar,avx2,avx512".
std::vector<std::string> supported() {
  std::vector<std::string> out{"scalar"};
  if (avx2_kernels().fp4 && cpu_has("avx2")) out.push_back("avx2");
  if (avx512_kernels().fp4 && cpu_has("avx512")) out.push_back("avx512");
  return out;
}

// Error messages are built as one std::string with std::to_string, never formatted through c10::str's
// ostringstream: on the GPU host (torch 2.11 built by gcc-toolset-13, the extension by Ubuntu's g++
// 13.3 against the system libstdc++) a TORCH_CHECK that formatted a number killed the process with
// SIGSEGV while one made of strings only was caught (benchmarks/gpu/host_kernel_diag.py, 2026-12-01).
std::string num(int64_t v) { return std::to_string(v); }

std::string dims(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.size(i));
  return out + "]";
}

// Sets the rows' software prefetch distance (host_kernel.h: g_prefetch_bytes), returns the one before.
int64_t set_prefetch_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && bytes <= (int64_t{1} << 20), "prefetch distance must be 0 .. 1 MiB, got " + num(bytes));
  return g_prefetch_bytes.exchange(bytes);
}

int64_t prefetch_bytes() { return prefetch_distance(); }

// Sets whether the row functions take several rows per call (host_kernel.h: g_row_blocking), returns the
// setting before.
bool set_row_blocking(bool on) { return g_row_blocking.exchange(on); }

std::string isas() {
  std::string out;
  for (const auto& s : supported()) out += (out.empty() ? "" : ",") + s;
  return out;
}

Kernels kernels_for(const std::string& isa) {
  static const std::vector<std::string> ok = supported();
  const std::string want = isa.empty() ? ok.back() : isa;
  bool found = false;
  for (const auto& s : ok) found |= s == want;
  TORCH_CHECK(found, "instruction set '" + want + "' is not available here; this build and CPU support " + isas());
  if (want == "avx512") return avx512_kernels();
  if (want == "avx2") return avx2_kernels();
  return scalar_kernels();
}

// This extension's parallel regions (at::parallel_for is inlined here) run on the OpenMP runtime it
// was linked with. Where that is not torch's own (a wheel that bundles a renamed libgomp, the host
// g++'s libgomp.so.1 loaded beside it), torch.set_num_threads never reaches it and every region
// would take all the cores; each operator therefore sets this thread's team size to torch's count.
void sync_threads() {
#ifdef _OPENMP
  const int n = at::get_num_threads();
  if (omp_get_max_threads() != n) omp_set_num_threads(n);
#endif
}

// One matrix's rows [0, rows) with its activations; several run in one parallel region.
struct Segment {
  Matrix m;
  Activations a;
  int64_t rows;
};

void run(RowsFn fn, const std::vector<Segment>& segs) {
  int64_t total = 0;
  for (const auto& s : segs) total += s.rows;
  at::parallel_for(0, total, 8, [&](int64_t b, int64_t e) {
    int64_t base = 0;
    for (const auto& s : segs) {
      const int64_t lo = std::max(b, base), hi = std::min(e, base + s.rows);
      if (lo < hi) fn(s.m, s.a, lo - base, hi - base);
      base += s.rows;
    }
  });
}

// x [T, C] in the fp4 activation layout (host_kernel.h, fp4_x_index), written to dst [T * C].
void fp4_activations(const float* src, int64_t T, int64_t C, float* dst) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < C; ++i) dst[fp4_x_index(t, i, T)] = src[t * C + i];
}

at::Tensor fp4_activations(const at::Tensor& x) {
  at::Tensor out = at::empty_like(x);
  fp4_activations(x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<float>());
  return out;
}

void check_x(const at::Tensor& x, int64_t C) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [T, C]");
  TORCH_CHECK(x.size(0) >= 1, "x has no tokens");
  TORCH_CHECK(x.size(1) == C, "x has " + num(x.size(1)) + " columns, the weight " + num(C));
}

const uint8_t* bytes(const at::Tensor& t) { return static_cast<const uint8_t*>(t.data_ptr()); }

Matrix fp4_matrix(const at::Tensor& w, const at::Tensor& s) {
  TORCH_CHECK(w.dim() == 2 && w.element_size() == 1 && w.stride(1) == 1, "fp4 weight must be [R, C/2] bytes, rows contiguous");
  TORCH_CHECK(s.dim() == 2 && s.element_size() == 1 && s.stride(1) == 1, "fp4 scale must be [R, C/32] bytes");
  const int64_t R = w.size(0), C = w.size(1) * 2;
  TORCH_CHECK(C % 32 == 0 && s.size(0) == R && s.size(1) == C / 32,
              "fp4 scale " + dims(s) + " does not match the weight " + dims(w));
  Matrix m;
  m.w = bytes(w), m.lw = w.stride(0), m.s8 = bytes(s), m.ls8 = s.stride(0), m.C = C;
  return m;
}

Matrix dense_matrix(const at::Tensor& w, const c10::optional<at::Tensor>& scale, int64_t br, int64_t bc) {
  TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1, "weight must be [R, C], rows contiguous");
  Matrix m;
  m.w = bytes(w), m.lw = w.stride(0) * w.element_size(), m.C = w.size(1);
  if (scale.has_value()) {
    TORCH_CHECK(w.element_size() == 1, "fp8 weight must be 1 byte per element");
    TORCH_CHECK(br > 0 && bc > 0, "fp8 block must be positive, got " + num(br) + "x" + num(bc));
    const at::Tensor& s = *scale;
    TORCH_CHECK(s.dim() == 2 && s.scalar_type() == at::kFloat && s.stride(1) == 1, "fp8 scale must be float32 [R/BR, C/BC]");
    TORCH_CHECK(s.size(0) == (w.size(0) + br - 1) / br && s.size(1) == (m.C + bc - 1) / bc,
                "fp8 scale " + dims(s) + " does not match the weight " + dims(w) + " in " + num(br) + "x" + num(bc) + " blocks");
    m.sf = s.data_ptr<float>(), m.lsf = s.stride(0), m.br = br, m.bc = bc;
  } else {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "dense weight must be bfloat16 (fp8 needs its scale)");
  }
  return m;
}

at::Tensor linear(const at::Tensor& x, const Matrix& m, int64_t R, RowsFn fn) {
  at::Tensor y = at::empty({x.size(0), R}, x.options());
  run(fn, {{m, {x.data_ptr<float>(), static_cast<int>(x.size(0)), y.data_ptr<float>(), R}, R}});
  return y;
}

// y [T, R] float32 = x [T, C] @ W^T for an FP4 weight [R, C/2] with UE8M0 scales [R, C/32].
at::Tensor fp4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, const std::string& isa) {
  sync_threads();
  const Matrix m = fp4_matrix(w, s);
  check_x(x, m.C);
  return linear(fp4_activations(x), m, w.size(0), kernels_for(isa).fp4);
}

// y [T, R] float32 = x [T, C] @ W^T for an FP8 e4m3 weight [R, C] with float32 block scales, or bf16.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                        int64_t br, int64_t bc, const std::string& isa) {
  sync_threads();
  const Matrix m = dense_matrix(w, scale, br, bc);
  check_x(x, m.C);
  const Kernels k = kernels_for(isa);
  return linear(x, m, w.size(0), scale.has_value() ? k.fp8 : k.bf16);
}

// Routed experts of one layer in one call: y [N, D] float32, where expert e's tokens are the
// rows[e] consecutive rows of x [N, D] starting at sum(rows[:e]), and each is down(act(gate x, up x))
// with act = silu(min(g, L)) * clamp(u, -L, L) (L = limit > 0) or silu(g) * u. gate_up holds the
// gate rows, then the up rows (fp8: their scale rows stacked the same way, each half starting a new
// block); with `interleaved` (fp4 only) row 2j is gate channel j and row 2j+1 up channel j. gate_up_bias
// (none, or one float32 [2*I] per expert, in gate_up's row order) is added to the projections before the
// clamps; alpha > 0 takes gpt-oss's act = (clamp(u, -L, L) + 1) * g * sigmoid(alpha * g), g = min(g, L).
// Every expert's gate_up rows share one parallel region, their SwiGLU one, their down rows
// one: a layer pays the threads' wake-up and barriers once, not once per expert.
at::Tensor experts(const at::Tensor& x, c10::IntArrayRef rows, at::TensorList gu, at::TensorList gus, at::TensorList dn,
                   at::TensorList dns, const std::string& fmt, int64_t br, int64_t bc, double limit,
                   at::TensorList gub, double alpha, bool interleaved, const std::string& isa) {
  sync_threads();
  TORCH_CHECK(fmt == "fp4" || fmt == "fp8" || fmt == "bf16", "format must be fp4, fp8 or bf16, got " + fmt);
  const bool fp4 = fmt == "fp4";
  const int64_t E = static_cast<int64_t>(gu.size());
  TORCH_CHECK(E >= 1 && static_cast<int64_t>(rows.size()) == E && static_cast<int64_t>(dn.size()) == E,
              "experts: rows, gate_up and down must have one entry per expert");
  const int64_t S = fmt == "bf16" ? 0 : E;
  TORCH_CHECK(static_cast<int64_t>(gus.size()) == S && static_cast<int64_t>(dns.size()) == S,
              "experts: fp4 and fp8 take one scale per weight, bf16 none");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [N, D]");
  TORCH_CHECK(gub.empty() || static_cast<int64_t>(gub.size()) == E, "experts: gate_up_bias takes none or one per expert");
  TORCH_CHECK(!interleaved || fp4, "experts: interleaved gate/up rows are fp4 only");
  TORCH_CHECK(gu[0].dim() == 2 && gu[0].size(0) % 2 == 0, "gate_up must be [2*I, ...], got " + dims(gu[0]));
  const Kernels k = kernels_for(isa);
  const RowsFn fn = fp4 ? k.fp4 : fmt == "fp8" ? k.fp8 : k.bf16;
  const int64_t I = gu[0].size(0) / 2, N = x.size(0), D = x.size(1);
  std::vector<int64_t> first(E + 1, 0);  // expert e's rows are [first[e], first[e + 1])
  std::vector<const float*> bias(E, nullptr);
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(rows[e] >= 1, "expert " + num(e) + " of this call has no tokens");
    TORCH_CHECK(gu[e].dim() == 2 && gu[e].size(0) == 2 * I, "gate_up " + num(e) + " is " + dims(gu[e]) + ", expert 0's " + dims(gu[0]));
    if (!gub.empty()) {
      TORCH_CHECK(gub[e].dim() == 1 && gub[e].size(0) == 2 * I && gub[e].scalar_type() == at::kFloat && gub[e].is_contiguous(),
                  "gate_up_bias " + num(e) + " must be contiguous float32 [2*I], got " + dims(gub[e]));
      bias[e] = gub[e].data_ptr<float>();
    }
    first[e + 1] = first[e] + rows[e];
  }
  TORCH_CHECK(first[E] == N, "rows add up to " + num(first[E]) + ", x has " + num(N));
  at::Tensor h = at::empty({N, 2 * I}, x.options());  // gate | up, per token row
  at::Tensor xin = fp4 ? at::empty_like(x) : x;       // fp4: each expert's rows in the fp4 activation layout
  float* hp = h.data_ptr<float>();
  std::vector<Segment> gate_up, down;
  at::Tensor act = at::empty({N, I}, x.options());
  at::Tensor y = at::empty({N, D}, x.options());
  float* ap = act.data_ptr<float>();
  for (int64_t e = 0; e < E; ++e) {
    const int T = static_cast<int>(rows[e]);
    const int64_t o = first[e];
    float* he = hp + o * 2 * I;
    Matrix dm;
    if (fp4) {
      const Matrix m = fp4_matrix(gu[e], gus[e]);
      TORCH_CHECK(m.C == D, "gate_up " + num(e) + " takes " + num(m.C) + " columns, x has " + num(D));
      fp4_activations(x.data_ptr<float>() + o * D, T, D, xin.data_ptr<float>() + o * D);
      gate_up.push_back({m, {xin.data_ptr<float>() + o * D, T, he, 2 * I}, 2 * I});
      dm = fp4_matrix(dn[e], dns[e]);
    } else {
      c10::optional<at::Tensor> gs, us;
      if (S) {
        const int64_t sr = gus[e].size(0) / 2;
        gs = gus[e].narrow(0, 0, sr), us = gus[e].narrow(0, sr, sr);
      }
      const Matrix gate = dense_matrix(gu[e].narrow(0, 0, I), gs, br, bc), up = dense_matrix(gu[e].narrow(0, I, I), us, br, bc);
      TORCH_CHECK(gate.C == D, "gate_up " + num(e) + " takes " + num(gate.C) + " columns, x has " + num(D));
      gate_up.push_back({gate, {x.data_ptr<float>() + o * D, T, he, 2 * I}, I});
      gate_up.push_back({up, {x.data_ptr<float>() + o * D, T, he + I, 2 * I}, I});
      dm = dense_matrix(dn[e], S ? c10::optional<at::Tensor>(dns[e]) : c10::nullopt, br, bc);
    }
    TORCH_CHECK(dm.C == I && dn[e].size(0) == D, "down " + num(e) + " is " + dims(dn[e]) + ", gate_up " + dims(gu[e]));
    down.push_back({dm, {ap + o * I, T, y.data_ptr<float>() + o * D, D}, D});
  }
  run(fn, gate_up);
  const float L = static_cast<float>(limit), A = static_cast<float>(alpha);
  at::parallel_for(0, I, 256, [&](int64_t i0, int64_t i1) {  // a serial expf over I_r = 2048 costs ~20 us
    for (int64_t e = 0; e < E; ++e) {
      const int64_t o = first[e], T = rows[e];
      const float* b = bias[e];
      for (int64_t t = 0; t < T; ++t) {
        const float* hr = hp + (o + t) * 2 * I;
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t gi = interleaved ? 2 * i : i, ui = interleaved ? 2 * i + 1 : I + i;
          float g = hr[gi], u = hr[ui];
          if (b) g += b[gi], u += b[ui];
          if (L > 0.f) g = std::min(g, L), u = std::min(std::max(u, -L), L);
          const float a = A > 0.f ? (u + 1.f) * (g / (1.f + std::exp(-g * A))) : g / (1.f + std::exp(-g)) * u;
          ap[o * I + (fp4 ? fp4_x_index(t, i, T) : t * I + i)] = a;
        }
      }
    }
  });
  run(fn, down);
  return y;
}

}  // namespace

TORCH_LIBRARY(shardsmith_host, m) {
  m.def("isas() -> str", &isas);
  m.def("set_prefetch_bytes(int bytes) -> int", &set_prefetch_bytes);
  m.def("prefetch_bytes() -> int", &prefetch_bytes);
  m.def("set_row_blocking(bool on) -> bool", &set_row_blocking);
  m.def("fp4_linear(Tensor x, Tensor w, Tensor s, str isa) -> Tensor", &fp4_linear);
  m.def("dense_linear(Tensor x, Tensor w, Tensor? scale, int br, int bc, str isa) -> Tensor", &dense_linear);
  m.def("experts(Tensor x, int[] rows, Tensor[] gate_up, Tensor[] gate_up_scale, Tensor[] down, Tensor[] down_scale, "
        "str fmt, int br, int bc, float limit, Tensor[] gate_up_bias, float alpha, bool interleaved, str isa) -> Tensor",
        &experts);
}
