// Launchers of the CUDA kernels of the fused clipped loss. Plain CUDA runtime types only, so the
// kernels compile with a bare `nvcc -c` (CI has nvcc but no CUDA torch); the ATen binding that
// registers them with the dispatcher is fused_loss_cuda.cpp.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace megatron_rl_ops {

enum class LogitsDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Per row t of logits [N, V] (contiguous): out_max[t] = max_v z, out_sum[t] = sum_v exp(z - max),
// out_target[t] = z[targets[t] - vocab_start] if that index is in [0, V), else 0.
cudaError_t launch_lse_stats(const void* logits, LogitsDtype dtype, const int64_t* targets, int64_t n_rows,
                             int64_t vocab, int64_t vocab_start, float* out_max, float* out_sum,
                             float* out_target, cudaStream_t stream);

// grad[t, v] = coef[t] * ((v == targets[t] - vocab_start) - exp(z[t, v] - lse[t])), in the logits
// dtype; `grad` may alias `logits` (in-place backward).
cudaError_t launch_logits_grad(const void* logits, LogitsDtype dtype, const int64_t* targets,
                               const float* lse, const float* coef, int64_t n_rows, int64_t vocab,
                               int64_t vocab_start, void* grad, cudaStream_t stream);

}  // namespace megatron_rl_ops
