// CPU kernels of the fused token-normalised clipped loss (see megatron_rl/ops/fused_loss.py).
//
// Two ops over a [N, V] block of (possibly vocab-parallel) logits, registered with the dispatcher
// under the namespace `megatron_rl_ops` (schemas in ../ops_schema.cpp):
//   lse_stats(logits, targets, vocab_start) -> (row_max, row_sumexp, target_logit)   all float32 [N]
//     one pass over each row with a blocked online log-sum-exp; target_logit is 0 on rows whose
//     target lies outside [vocab_start, vocab_start + V) (another TP rank owns it).
//   logits_grad(logits, targets, lse, coef, vocab_start) -> grad        (and logits_grad_, in place)
//     grad[t, v] = coef[t] * (onehot(v == target_t) - exp(logits[t, v] - lse[t])), written in the
//     logits dtype, computed in float32 one block at a time (no float32 [N, V] tensor).
//
// Vectorisation: the hot loops are plain branch-free float loops with `omp simd` reductions and a
// polynomial exp (std::exp does not vectorise); GCC/Clang clone them for AVX-512/AVX2 and pick one
// at load time (target_clones), so one build is portable and fast.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(MEGATRON_RL_NO_CLONES)
#define MRL_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define MRL_CLONES
#endif

// float32, bfloat16 and float16 logits (the Python side sends float64 to its torch path).
#define MRL_DISPATCH(TYPE, NAME, ...)                      \
  AT_DISPATCH_SWITCH(TYPE, NAME,                           \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace megatron_rl_ops {
namespace {

constexpr int64_t kBlock = 1024;  // floats per block: 4 KiB stays in L1 between the passes

// exp(x) for x <= 0 (and up to ~88), ~2 ulp: Cody-Waite range reduction x = n ln2 + r and a degree-6
// polynomial on |r| <= ln2/2; branch-free so it vectorises. exp(-inf) and anything below -87 -> 0.
inline float fast_exp(float x) {
  const float xc = std::min(std::max(x, -87.0f), 88.0f);
  // Round to nearest via the 1.5 * 2^23 trick (no -ffast-math, so it is not folded away).
  const float t = xc * 1.44269504088896341f + 12582912.0f;
  const float n = t - 12582912.0f;
  float r = xc - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const float y = p * scale;
  return x < -87.0f ? 0.0f : y;
}

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half v) { return static_cast<float>(v); }

inline void from_float(float f, float* out) { *out = f; }
inline void from_float(float f, c10::BFloat16* out) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  // Round to nearest even; NaN stays a quiet NaN.
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  out->x = static_cast<uint16_t>(std::isnan(f) ? 0x7FC0u : rounded);
}
inline void from_float(float f, c10::Half* out) { *out = c10::Half(f); }

MRL_CLONES float block_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

MRL_CLONES float block_sum_exp(const float* x, int64_t n, float shift) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += fast_exp(x[i] - shift);
  return s;
}

// out[i] = -coef * exp(x[i] - lse)
MRL_CLONES void block_neg_softmax(const float* x, int64_t n, float lse, float coef, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = -coef * fast_exp(x[i] - lse);
}

template <typename T>
inline const float* load_block(const T* src, int64_t n, float* buf) {
  for (int64_t i = 0; i < n; ++i) buf[i] = to_float(src[i]);
  return buf;
}
template <>
inline const float* load_block<float>(const float* src, int64_t, float*) {
  return src;
}

template <typename T>
void stats_rows(const T* logits, const int64_t* targets, int64_t N, int64_t V, int64_t vocab_start,
                float* out_max, float* out_sum, float* out_target) {
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(V, 1));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float buf[kBlock];
    for (int64_t t = begin; t < end; ++t) {
      const T* row = logits + t * V;
      float m = -std::numeric_limits<float>::infinity();
      float s = 0.0f;
      for (int64_t start = 0; start < V; start += kBlock) {
        const int64_t n = std::min(kBlock, V - start);
        const float* x = load_block(row + start, n, buf);
        const float bm = block_max(x, n);
        if (bm > m) {  // online rescale: sum_{seen} exp(z - m_old) * exp(m_old - m_new)
          s = (m == -std::numeric_limits<float>::infinity()) ? 0.0f : s * std::exp(m - bm);
          m = bm;
        }
        if (m != -std::numeric_limits<float>::infinity()) s += block_sum_exp(x, n, m);
      }
      const int64_t local = targets[t] - vocab_start;
      out_max[t] = m;
      out_sum[t] = s;
      out_target[t] = (local >= 0 && local < V) ? to_float(row[local]) : 0.0f;
    }
  });
}

template <typename T>
void grad_rows(const T* logits, const int64_t* targets, const float* lse, const float* coef,
               int64_t N, int64_t V, int64_t vocab_start, T* grad) {
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(V, 1));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float buf[kBlock];
    float out[kBlock];
    for (int64_t t = begin; t < end; ++t) {
      const T* row = logits + t * V;
      T* grow = grad + t * V;
      const float c = coef[t];
      const float l = lse[t];
      const int64_t local = targets[t] - vocab_start;
      const bool owns = local >= 0 && local < V;
      // Read the target logit before the row may be overwritten (in-place variant).
      const float z_target = owns ? to_float(row[local]) : 0.0f;
      if (c == 0.0f) {  // masked or clipped token: zero gradient, skip the exps
        T zero;
        from_float(0.0f, &zero);
        std::fill(grow, grow + V, zero);
        continue;
      }
      for (int64_t start = 0; start < V; start += kBlock) {
        const int64_t n = std::min(kBlock, V - start);
        const float* x = load_block(row + start, n, buf);
        block_neg_softmax(x, n, l, c, out);
        for (int64_t i = 0; i < n; ++i) from_float(out[i], grow + start + i);
      }
      if (owns) from_float(c * (1.0f - std::exp(z_target - l)), grow + local);
    }
  });
}

void check_rows(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(logits.dim() == 2, "logits must be [tokens, vocab], got ", logits.sizes());
  TORCH_CHECK(logits.is_contiguous(), "logits must be contiguous");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0),
              "targets must be [tokens] matching logits, got ", targets.sizes());
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.is_contiguous(),
              "targets must be contiguous int64");
}

void check_token_vec(const at::Tensor& v, int64_t N, const char* name) {
  TORCH_CHECK(v.dim() == 1 && v.size(0) == N && v.scalar_type() == at::kFloat && v.is_contiguous(),
              name, " must be contiguous float32 [", N, "], got ", v.sizes(), " ", v.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lse_stats_cpu(const at::Tensor& logits,
                                                             const at::Tensor& targets,
                                                             int64_t vocab_start) {
  check_rows(logits, targets);
  const int64_t N = logits.size(0), V = logits.size(1);
  auto opts = logits.options().dtype(at::kFloat);
  at::Tensor row_max = at::empty({N}, opts), row_sum = at::empty({N}, opts),
             target_logit = at::empty({N}, opts);
  MRL_DISPATCH(logits.scalar_type(), "lse_stats_cpu", [&] {
    stats_rows<scalar_t>(logits.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(), N, V, vocab_start,
                         row_max.data_ptr<float>(), row_sum.data_ptr<float>(),
                         target_logit.data_ptr<float>());
  });
  return {row_max, row_sum, target_logit};
}

at::Tensor grad_into(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                     const at::Tensor& coef, int64_t vocab_start, at::Tensor grad) {
  check_rows(logits, targets);
  const int64_t N = logits.size(0), V = logits.size(1);
  check_token_vec(lse, N, "lse");
  check_token_vec(coef, N, "coef");
  MRL_DISPATCH(logits.scalar_type(), "logits_grad_cpu", [&] {
    grad_rows<scalar_t>(logits.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(), lse.data_ptr<float>(),
                        coef.data_ptr<float>(), N, V, vocab_start, grad.data_ptr<scalar_t>());
  });
  return grad;
}

at::Tensor logits_grad_cpu(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                           const at::Tensor& coef, int64_t vocab_start) {
  return grad_into(logits, targets, lse, coef, vocab_start, at::empty_like(logits));
}

at::Tensor& logits_grad_inplace_cpu(at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                                    const at::Tensor& coef, int64_t vocab_start) {
  grad_into(logits, targets, lse, coef, vocab_start, logits);
  return logits;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_rl_ops, CPU, m) {
  m.impl("lse_stats", &lse_stats_cpu);
  m.impl("logits_grad", &logits_grad_cpu);
  m.impl("logits_grad_", &logits_grad_inplace_cpu);
}

}  // namespace megatron_rl_ops
