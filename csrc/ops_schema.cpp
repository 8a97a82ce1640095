// Operator schemas of the fused loss extension; the CPU and CUDA implementations register
// themselves under the same namespace (cpu/fused_loss_cpu.cpp, cuda/fused_loss_cuda.cpp).
#include <torch/library.h>

TORCH_LIBRARY(megatron_rl_ops, m) {
  m.def("lse_stats(Tensor logits, Tensor targets, int vocab_start) -> (Tensor, Tensor, Tensor)");
  m.def("logits_grad(Tensor logits, Tensor targets, Tensor lse, Tensor coef, int vocab_start) -> Tensor");
  m.def(
      "logits_grad_(Tensor(a!) logits, Tensor targets, Tensor lse, Tensor coef, int vocab_start) "
      "-> Tensor(a!)");
}
