// apex_lite::fused_adam_ on CUDA: one Adam / AdamW step (apex's FusedAdam; torch.optim.Adam,
// AdamW) over lists of parameters, in one multi-tensor-apply pass per dtype combination.
//
// Contract: csrc/ops.cpp; the per-element arithmetic and how it compares with the Python backend
// are in adam_step.cuh. Every block reads found_inf first and, when it is not 0, writes nothing;
// otherwise every steps[i] (empty parameters included) ends incremented by exactly 1, by the last
// block of its parameter. inv_scale, found_inf and the step counts are read on the device only: no
// host synchronisation, current stream. Launches: one fill (the block counters), the update
// passes, and one more only when a parameter is empty.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "adam_step.cuh"

namespace apex_lite {
namespace cuda {
namespace {

void fused_adam_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList model_params,
                     at::TensorList steps, const at::Tensor& inv_scale,
                     const at::Tensor& found_inf, double lr, double beta1, double beta2,
                     double eps, double weight_decay, bool adam_w_mode, bool bias_correction) {
  check_adam_family_args("fused_adam_", params, grads, exp_avgs, exp_avg_sqs, model_params, steps,
                         inv_scale, found_inf);
  if (params.empty()) {
    return;
  }
  const c10::cuda::CUDAGuard guard(found_inf.device());
  const at::Tensor blocks_done = at::zeros(
      {static_cast<int64_t>(params.size())},
      at::TensorOptions().dtype(at::kLong).device(found_inf.device()));
  const AdamArgs args = make_adam_args(found_inf, inv_scale, blocks_done, lr, beta1, beta2,
                                       1.0 - beta1, eps, weight_decay, adam_w_mode,
                                       bias_correction);
  launch_adam_stage<AdamStage::kApply>(params, grads, exp_avgs, exp_avg_sqs, steps, model_params,
                                       args);
  increment_steps_of_empty_params(params, steps, found_inf);
}

}  // namespace
}  // namespace cuda
}  // namespace apex_lite

TORCH_LIBRARY_IMPL(apex_lite, CUDA, m) {
  m.impl("fused_adam_", &apex_lite::cuda::fused_adam_cuda);
}
