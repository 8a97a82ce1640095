// CUDA kernels of the fused clipped loss: one thread block per token row of logits.
//
// lse_stats: each thread keeps an online (max, sum-exp) pair over a strided slice of the row, read
// with 16-byte vector loads when the row allows it; pairs are merged with warp shuffles, then across
// warps in shared memory. One read of the logits, float32 accumulation.
// logits_grad: each thread writes coef * (onehot - exp(z - lse)) for its slice in the logits dtype;
// in place is safe because every element is read and written by the same thread.
#include "fused_loss_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace megatron_rl_ops {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

// 16 bytes of T, loaded/stored as one instruction.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

struct MaxSum {
  float m;
  float s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

__device__ __forceinline__ void add_value(MaxSum& acc, float x) {
  if (x > acc.m) {
    acc.s = (acc.m == -INFINITY ? 0.0f : acc.s * __expf(acc.m - x)) + 1.0f;
    acc.m = x;
  } else if (x != -INFINITY) {
    acc.s += __expf(x - acc.m);
  }
}

__device__ __forceinline__ MaxSum block_merge(MaxSum v) {
  __shared__ float sm[kWarps], ss[kWarps];
  for (int off = 16; off > 0; off >>= 1) {
    MaxSum o{__shfl_xor_sync(0xffffffffu, v.m, off), __shfl_xor_sync(0xffffffffu, v.s, off)};
    v = merge(v, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sm[warp] = v.m;
    ss[warp] = v.s;
  }
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? MaxSum{sm[lane], ss[lane]} : MaxSum{-INFINITY, 0.0f};
    for (int off = 16; off > 0; off >>= 1) {
      MaxSum o{__shfl_xor_sync(0xffffffffu, v.m, off), __shfl_xor_sync(0xffffffffu, v.s, off)};
      v = merge(v, o);
    }
  }
  return v;  // valid in thread 0
}

template <typename T>
__global__ void __launch_bounds__(kThreads) lse_stats_kernel(const T* __restrict__ logits,
                                                             const int64_t* __restrict__ targets,
                                                             int64_t vocab, int64_t vocab_start,
                                                             bool vec_ok, float* out_max, float* out_sum,
                                                             float* out_target) {
  const int64_t row = blockIdx.x;
  const T* z = logits + row * vocab;
  MaxSum acc{-INFINITY, 0.0f};
  if (vec_ok) {
    constexpr int kN = Pack<T>::kN;
    const Pack<T>* zp = reinterpret_cast<const Pack<T>*>(z);
    for (int64_t i = threadIdx.x; i < vocab / kN; i += kThreads) {
      const Pack<T> p = zp[i];
      float x[kN];
      float pm = -INFINITY;
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        x[k] = to_f(p.v[k]);
        pm = fmaxf(pm, x[k]);
      }
      if (pm == -INFINITY) continue;
      if (pm > acc.m) {  // rescale only when the running max grows (rare after the first packs)
        acc.s = acc.m == -INFINITY ? 0.0f : acc.s * __expf(acc.m - pm);
        acc.m = pm;
      }
#pragma unroll
      for (int k = 0; k < kN; ++k) acc.s += __expf(x[k] - acc.m);
    }
  } else {
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) add_value(acc, to_f(z[i]));
  }
  acc = block_merge(acc);
  if (threadIdx.x == 0) {
    const int64_t local = targets[row] - vocab_start;
    out_max[row] = acc.m;
    out_sum[row] = acc.s;
    out_target[row] = (local >= 0 && local < vocab) ? to_f(z[local]) : 0.0f;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) logits_grad_kernel(const T* logits, const int64_t* __restrict__ targets,
                                                               const float* __restrict__ lse,
                                                               const float* __restrict__ coef, int64_t vocab,
                                                               int64_t vocab_start, bool vec_ok, T* grad) {
  const int64_t row = blockIdx.x;
  const T* z = logits + row * vocab;
  T* g = grad + row * vocab;
  const float c = coef[row], l = lse[row];
  const int64_t local = targets[row] - vocab_start;  // may be outside [0, V): then never matched
  if (c == 0.0f) {  // masked or clipped token (uniform per block): zeros, no exps
    const T zero = from_f<T>(0.0f);
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) g[i] = zero;
    return;
  }
  if (vec_ok) {
    constexpr int kN = Pack<T>::kN;
    const Pack<T>* zp = reinterpret_cast<const Pack<T>*>(z);
    Pack<T>* gp = reinterpret_cast<Pack<T>*>(g);
    for (int64_t i = threadIdx.x; i < vocab / kN; i += kThreads) {
      const Pack<T> p = zp[i];
      Pack<T> out;
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const float onehot = (i * kN + k == local) ? 1.0f : 0.0f;
        out.v[k] = from_f<T>(c * (onehot - __expf(to_f(p.v[k]) - l)));
      }
      gp[i] = out;
    }
  } else {
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
      const float onehot = (i == local) ? 1.0f : 0.0f;
      g[i] = from_f<T>(c * (onehot - __expf(to_f(z[i]) - l)));
    }
  }
}

template <typename T>
bool vectorisable(const void* p, int64_t vocab) {
  return vocab % Pack<T>::kN == 0 && reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

template <typename T>
cudaError_t stats_t(const void* logits, const int64_t* targets, int64_t n, int64_t v, int64_t start,
                    float* mx, float* sm, float* tg, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const bool vec = vectorisable<T>(logits, v);
  lse_stats_kernel<T><<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
      static_cast<const T*>(logits), targets, v, start, vec, mx, sm, tg);
  return cudaGetLastError();
}

template <typename T>
cudaError_t grad_t(const void* logits, const int64_t* targets, const float* lse, const float* coef,
                   int64_t n, int64_t v, int64_t start, void* grad, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const bool vec = vectorisable<T>(logits, v) && vectorisable<T>(grad, v);
  logits_grad_kernel<T><<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
      static_cast<const T*>(logits), targets, lse, coef, v, start, vec, static_cast<T*>(grad));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_lse_stats(const void* logits, LogitsDtype dtype, const int64_t* targets, int64_t n_rows,
                             int64_t vocab, int64_t vocab_start, float* out_max, float* out_sum,
                             float* out_target, cudaStream_t stream) {
  if (n_rows > 0x7fffffff) return cudaErrorInvalidValue;
  switch (dtype) {
    case LogitsDtype::kFloat32:
      return stats_t<float>(logits, targets, n_rows, vocab, vocab_start, out_max, out_sum, out_target, stream);
    case LogitsDtype::kBFloat16:
      return stats_t<__nv_bfloat16>(logits, targets, n_rows, vocab, vocab_start, out_max, out_sum, out_target,
                                    stream);
    case LogitsDtype::kFloat16:
      return stats_t<__half>(logits, targets, n_rows, vocab, vocab_start, out_max, out_sum, out_target, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_logits_grad(const void* logits, LogitsDtype dtype, const int64_t* targets,
                               const float* lse, const float* coef, int64_t n_rows, int64_t vocab,
                               int64_t vocab_start, void* grad, cudaStream_t stream) {
  if (n_rows > 0x7fffffff) return cudaErrorInvalidValue;
  switch (dtype) {
    case LogitsDtype::kFloat32:
      return grad_t<float>(logits, targets, lse, coef, n_rows, vocab, vocab_start, grad, stream);
    case LogitsDtype::kBFloat16:
      return grad_t<__nv_bfloat16>(logits, targets, lse, coef, n_rows, vocab, vocab_start, grad, stream);
    case LogitsDtype::kFloat16:
      return grad_t<__half>(logits, targets, lse, coef, n_rows, vocab, vocab_start, grad, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace megatron_rl_ops
