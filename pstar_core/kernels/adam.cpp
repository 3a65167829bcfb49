// Chunk AdamW kernel and grad squared-norm for pstar_core (CPU).
//
// Owns the single-pass fused AdamW update over the segments of a flat chunk:
// reads grad (fp32/bf16/fp16), master/exp_avg/exp_avg_sq (fp32), writes the three fp32
// buffers back and casts the new master into param_out (fp32/bf16/fp16), which may be the
// very same buffer as grad. Compiled JIT by pstar_core/kernels/adam.py (flags and why are
// listed there: -O3 -march=native -fopenmp -ffp-contract=off -fno-math-errno ...); the inner
// loops are plain C++ written so GCC/Clang auto-vectorize them (dtype conversions are
// branch-free bit manipulation), threads come from torch's OpenMP runtime and thread count.

// Narrow headers instead of <torch/extension.h>: halves the JIT compile time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Kind : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

template <int K>
struct Storage {
  using type = uint16_t;
};
template <>
struct Storage<kF32> {
  using type = float;
};

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// fp16 -> fp32, exact (same algorithm as c10::detail::fp16_ieee_to_fp32_value, branch-free
// so it vectorizes).
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_to_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_to_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t mag = two_w < (1u << 27) ? f32_to_bits(denormalized) : f32_to_bits(normalized);
  return bits_to_f32(sign | mag);
}

// fp32 -> fp16 round-to-nearest-even (c10::detail::fp16_ieee_from_fp32_value): bitwise equal
// to torch's .to(torch.float16), NaN included (sign | 0x7E00). Relies on default FP rounding
// and on -ffp-contract=off (no FMA folding of the rounding addition).
inline uint16_t f32_to_f16(float f) {
  const float base0 = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f32_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  const float base = bits_to_f32((bias >> 1) + 0x07800000u) + base0;
  const uint32_t bits = f32_to_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float bf16_to_f32(uint16_t b) { return bits_to_f32(static_cast<uint32_t>(b) << 16); }

// fp32 -> bf16 round-to-nearest-even. NaN maps to 0xFFFF, which is what torch's vectorized
// CPU .to(torch.bfloat16) produces, so param_out stays bitwise equal to master.to(bf16).
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_to_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFu : rounded);
}

template <int K>
inline float load_f32(typename Storage<K>::type x) {
  if constexpr (K == kF32) {
    return x;
  } else if constexpr (K == kBF16) {
    return bf16_to_f32(x);
  } else {
    return f16_to_f32(x);
  }
}

template <int K>
inline typename Storage<K>::type store_cast(float f) {
  if constexpr (K == kF32) {
    return f;
  } else if constexpr (K == kBF16) {
    return f32_to_bf16(f);
  } else {
    return f32_to_f16(f);
  }
}

// Per-segment constants, all fp32 like torch's CPU kernels use for fp32 tensors.
struct Hyper {
  float decay;     // 1 - lr * weight_decay
  float w1;        // 1 - beta1 (lerp weight)
  float beta2;
  float omb2;      // 1 - beta2
  float inv_bc2s;  // 1 / sqrt(1 - beta2^step)
  float eps;
  float neg_step;  // -lr / (1 - beta1^step)
  float gscale;
};

// One element of AdamW; returns nothing, updates p/m/v in registers.
inline void adam_elem(float g, float& p, float& m, float& v, const Hyper& h) {
  g = g * h.gscale;
  p = p * h.decay;
  // torch's lerp for weight < 0.5: self + weight * (end - self), done as an FMA in its
  // vectorized kernel; fmaf keeps us on the same rounding.
  m = std::fma(h.w1, g - m, m);
  v = v * h.beta2 + (h.omb2 * g) * g;
  // sqrt(v) * (1/bc2_sqrt) instead of a second division: division/sqrt throughput is what
  // limits this loop on 16-lane vectors, one ulp of denominator is irrelevant.
  const float denom = std::sqrt(v) * h.inv_bc2s + h.eps;
  p = p + h.neg_step * (m / denom);
}

// grad and param_out are distinct, non-overlapping buffers.
template <int GK, int PK>
void adam_span(float* __restrict__ p, float* __restrict__ m, float* __restrict__ v,
               const typename Storage<GK>::type* __restrict__ g,
               typename Storage<PK>::type* __restrict__ out, int64_t n, const Hyper h) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    adam_elem(load_f32<GK>(g[i]), pi, mi, vi, h);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    out[i] = store_cast<PK>(pi);
  }
}

// grad and param_out are the same buffer: element i reads its grad, then overwrites it.
// A single pointer makes the distance-0 dependence visible to the vectorizer.
template <int K>
void adam_span_inplace(float* __restrict__ p, float* __restrict__ m, float* __restrict__ v,
                       typename Storage<K>::type* __restrict__ io, int64_t n, const Hyper h) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    adam_elem(load_f32<K>(io[i]), pi, mi, vi, h);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    io[i] = store_cast<K>(pi);
  }
}

template <int K>
double sq_span(const typename Storage<K>::type* __restrict__ g, int64_t n) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) {
    const double x = static_cast<double>(load_f32<K>(g[i]));
    acc += x * x;
  }
  return acc;
}

struct Piece {
  int64_t seg;
  int64_t begin;  // absolute element index into the chunk
  int64_t end;
};

// Work pieces small enough to balance two threads on a noisy machine (dynamic schedule),
// large enough (~1.8 MB of traffic for fp32 states) that scheduling cost is nil.
constexpr int64_t kPiece = 1 << 16;
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = 1 << 15;

// (offset, numel) spans; bounds and overlaps are validated in Python before the call.
using Span = std::pair<int64_t, int64_t>;
// (offset, numel, step, lr, weight_decay), i.e. an AdamSegment. Taking the Python tuples
// directly avoids building tensors per call, which cost more than the kernel for small chunks.
using Segment = std::tuple<int64_t, int64_t, int64_t, double, double>;

std::vector<Piece> make_pieces(const std::vector<Span>& spans, int64_t* total) {
  std::vector<Piece> pieces;
  *total = 0;
  for (size_t s = 0; s < spans.size(); ++s) {
    const int64_t off = spans[s].first, len = spans[s].second;
    *total += len;
    for (int64_t b = off; b < off + len; b += kPiece) {
      pieces.push_back({static_cast<int64_t>(s), b, std::min(b + kPiece, off + len)});
    }
  }
  return pieces;
}

int kind_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return kF32;
    case at::kBFloat16:
      return kBF16;
    case at::kHalf:
      return kF16;
    default:
      TORCH_CHECK(false, "pstar adam: unsupported dtype ", t.scalar_type());
  }
  return -1;
}

template <int GK, int PK>
void run_adam(float* p, float* m, float* v, void* g_raw, void* out_raw, bool inplace,
              const std::vector<Piece>& pieces, const std::vector<Hyper>& hyper,
              bool parallel) {
  using GT = typename Storage<GK>::type;
  using PT = typename Storage<PK>::type;
  auto* g = static_cast<GT*>(g_raw);
  auto* out = static_cast<PT*>(out_raw);
  const int64_t np = static_cast<int64_t>(pieces.size());
  const int nt = at::get_num_threads();
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (parallel)
  for (int64_t k = 0; k < np; ++k) {
    const Piece& pc = pieces[k];
    const int64_t b = pc.begin, n = pc.end - pc.begin;
    if constexpr (GK == PK) {
      if (inplace) {
        adam_span_inplace<GK>(p + b, m + b, v + b, g + b, n, hyper[pc.seg]);
        continue;
      }
    }
    adam_span<GK, PK>(p + b, m + b, v + b, g + b, out + b, n, hyper[pc.seg]);
  }
}

void check_vec(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), "pstar adam: ", name, " must be on CPU");
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "pstar adam: ", name,
              " must be 1-D contiguous");
  TORCH_CHECK(t.numel() == numel, "pstar adam: ", name, " has wrong numel");
}

}  // namespace

void adamw(at::Tensor master, at::Tensor exp_avg, at::Tensor exp_avg_sq, at::Tensor grad,
           at::Tensor param_out, const std::vector<Segment>& segments, double beta1,
           double beta2, double eps, double grad_scale) {
  const int64_t numel = master.numel();
  check_vec(master, "master", numel);
  check_vec(exp_avg, "exp_avg", numel);
  check_vec(exp_avg_sq, "exp_avg_sq", numel);
  check_vec(grad, "grad", numel);
  check_vec(param_out, "param_out", numel);
  TORCH_CHECK(master.scalar_type() == at::kFloat && exp_avg.scalar_type() == at::kFloat &&
                  exp_avg_sq.scalar_type() == at::kFloat,
              "pstar adam: master/exp_avg/exp_avg_sq must be float32");
  const size_t nseg = segments.size();
  std::vector<Span> spans(nseg);
  std::vector<Hyper> hyper(nseg);
  for (size_t s = 0; s < nseg; ++s) {
    const auto& [offset, count, step, lr, wd] = segments[s];
    spans[s] = {offset, count};
    // Same double-precision host math as torch.optim.adam._single_tensor_adam (Python's
    // float ** is C pow, so these are bit-identical to the Python fallback's constants).
    const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
    Hyper& h = hyper[s];
    h.decay = static_cast<float>(1.0 - lr * wd);
    h.neg_step = static_cast<float>(-(lr / bc1));
    h.inv_bc2s = static_cast<float>(1.0 / std::pow(bc2, 0.5));
    h.w1 = static_cast<float>(1.0 - beta1);
    h.beta2 = static_cast<float>(beta2);
    h.omb2 = static_cast<float>(1.0 - beta2);
    h.eps = static_cast<float>(eps);
    h.gscale = static_cast<float>(grad_scale);
  }
  int64_t total = 0;
  const std::vector<Piece> pieces = make_pieces(spans, &total);
  const bool parallel = total >= kParallelMin && pieces.size() > 1;

  const int gk = kind_of(grad), pk = kind_of(param_out);
  const bool inplace = grad.data_ptr() == param_out.data_ptr();
  TORCH_CHECK(!inplace || gk == pk, "pstar adam: aliased grad/param_out need the same dtype");
  float* p = master.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  void* g = grad.data_ptr();
  void* o = param_out.data_ptr();

#define PSTAR_ADAM_CASE(G, P)                                                   \
  if (gk == G && pk == P) {                                                     \
    run_adam<G, P>(p, m, v, g, o, inplace, pieces, hyper, parallel);           \
    return;                                                                      \
  }
  PSTAR_ADAM_CASE(kF32, kF32)
  PSTAR_ADAM_CASE(kF32, kBF16)
  PSTAR_ADAM_CASE(kF32, kF16)
  PSTAR_ADAM_CASE(kBF16, kF32)
  PSTAR_ADAM_CASE(kBF16, kBF16)
  PSTAR_ADAM_CASE(kBF16, kF16)
  PSTAR_ADAM_CASE(kF16, kF32)
  PSTAR_ADAM_CASE(kF16, kBF16)
  PSTAR_ADAM_CASE(kF16, kF16)
#undef PSTAR_ADAM_CASE
}

template <int K>
double run_sq(const void* g_raw, const std::vector<Piece>& pieces, bool parallel) {
  const auto* g = static_cast<const typename Storage<K>::type*>(g_raw);
  const int64_t np = static_cast<int64_t>(pieces.size());
  const int nt = at::get_num_threads();
  double acc = 0.0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) reduction(+ : acc) if (parallel)
  for (int64_t k = 0; k < np; ++k) {
    acc += sq_span<K>(g + pieces[k].begin, pieces[k].end - pieces[k].begin);
  }
  return acc;
}

double grad_sq_norm(at::Tensor grad, const std::vector<Segment>& segments) {
  TORCH_CHECK(grad.device().is_cpu() && grad.dim() == 1 && grad.is_contiguous(),
              "pstar grad_sq_norm: grad must be 1-D contiguous CPU");
  std::vector<Span> spans;
  spans.reserve(segments.size());
  for (const auto& seg : segments) {
    spans.emplace_back(std::get<0>(seg), std::get<1>(seg));
  }
  int64_t total = 0;
  const std::vector<Piece> pieces = make_pieces(spans, &total);
  const bool parallel = total >= kParallelMin && pieces.size() > 1;
  switch (kind_of(grad)) {
    case kF32:
      return run_sq<kF32>(grad.data_ptr(), pieces, parallel);
    case kBF16:
      return run_sq<kBF16>(grad.data_ptr(), pieces, parallel);
    default:
      return run_sq<kF16>(grad.data_ptr(), pieces, parallel);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  // The GIL is released: the kernel touches only tensor memory, and the engine may run
  // other Python threads (prefetch, communication) meanwhile.
  mod.def("adamw", &adamw, py::call_guard<py::gil_scoped_release>());
  mod.def("grad_sq_norm", &grad_sq_norm, py::call_guard<py::gil_scoped_release>());
}
