// Registers the CUDA kernels (fused_loss_kernels.cu) as the CUDA implementations of the
// `megatron_rl_ops` operators (schemas in ../ops_schema.cpp). Built only with a CUDA torch.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "fused_loss_kernels.h"

namespace megatron_rl_ops {
namespace {

LogitsDtype dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return LogitsDtype::kFloat32;
    case at::kBFloat16:
      return LogitsDtype::kBFloat16;
    case at::kHalf:
      return LogitsDtype::kFloat16;
    default:
      TORCH_CHECK(false, "fused loss CUDA kernels take float32/bfloat16/float16 logits, got ", t.scalar_type());
  }
}

void check_rows(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(logits.is_cuda() && targets.is_cuda(), "logits and targets must be CUDA tensors");
  TORCH_CHECK(logits.device() == targets.device(), "logits and targets must be on the same device");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be contiguous [tokens, vocab], got ",
              logits.sizes());
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0) && targets.scalar_type() == at::kLong &&
                  targets.is_contiguous(),
              "targets must be contiguous int64 [tokens]");
}

void check_token_vec(const at::Tensor& v, const at::Tensor& logits, const char* name) {
  TORCH_CHECK(v.device() == logits.device() && v.dim() == 1 && v.size(0) == logits.size(0) &&
                  v.scalar_type() == at::kFloat && v.is_contiguous(),
              name, " must be contiguous float32 [tokens] on the logits device");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lse_stats_cuda(const at::Tensor& logits,
                                                              const at::Tensor& targets,
                                                              int64_t vocab_start) {
  check_rows(logits, targets);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t n = logits.size(0), v = logits.size(1);
  auto opts = logits.options().dtype(at::kFloat);
  at::Tensor mx = at::empty({n}, opts), sm = at::empty({n}, opts), tg = at::empty({n}, opts);
  const cudaError_t err = launch_lse_stats(logits.data_ptr(), dtype_of(logits), targets.data_ptr<int64_t>(), n, v,
                                           vocab_start, mx.data_ptr<float>(), sm.data_ptr<float>(),
                                           tg.data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "lse_stats kernel failed: ", cudaGetErrorString(err));
  return {mx, sm, tg};
}

at::Tensor grad_into(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                     const at::Tensor& coef, int64_t vocab_start, at::Tensor grad) {
  check_rows(logits, targets);
  check_token_vec(lse, logits, "lse");
  check_token_vec(coef, logits, "coef");
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaError_t err = launch_logits_grad(logits.data_ptr(), dtype_of(logits), targets.data_ptr<int64_t>(),
                                             lse.data_ptr<float>(), coef.data_ptr<float>(), logits.size(0),
                                             logits.size(1), vocab_start, grad.data_ptr(),
                                             c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "logits_grad kernel failed: ", cudaGetErrorString(err));
  return grad;
}

at::Tensor logits_grad_cuda(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                            const at::Tensor& coef, int64_t vocab_start) {
  return grad_into(logits, targets, lse, coef, vocab_start, at::empty_like(logits));
}

at::Tensor& logits_grad_inplace_cuda(at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                                     const at::Tensor& coef, int64_t vocab_start) {
  grad_into(logits, targets, lse, coef, vocab_start, logits);
  return logits;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_rl_ops, CUDA, m) {
  m.impl("lse_stats", &lse_stats_cuda);
  m.impl("logits_grad", &logits_grad_cuda);
  m.impl("logits_grad_", &logits_grad_inplace_cuda);
}

}  // namespace megatron_rl_ops
