// apex_lite::fused_adam_ on CPU: one Adam / AdamW step over all parameters of a call.
//
// Contract (apex_lite/multi_tensor/_python.py is the reference, bit for bit): per element, in
// fp32, each line one rounding, hyper-parameters converted from double to fp32 once:
//   g = float(grad) * inv_scale
//   if weight_decay != 0 and not adam_w_mode:  g = g + weight_decay * p
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + ((1 - beta2) * g) * g
//   update = (m * r1) / (sqrt(v) * r2 + eps)    (sqrt correctly rounded; rounded in the order
//                                                m * r1, sqrt(v), * r2, + eps, /)
//   if weight_decay != 0 and adam_w_mode:      update = update + weight_decay * p
//   p = p - lr * update
// then params[i] = round(p) and model_params[i] = round(p), each rounded once to its own dtype
// (to nearest even), and steps[i] += 1. r1 = 1 / (1 - beta1**count) and
// r2 = 1 / sqrt(1 - beta2**count), each in double with count = steps[i] + 1, then rounded once to
// fp32; 1 without bias_correction (reciprocals: one division per element rather than three).
// params and model_params are fp32/fp16/bf16 (p = float(param): a half parameter without master
// weights is updated in fp32 and rounded once), grads fp32/fp16/bf16 in any combination;
// exp_avgs and exp_avg_sqs fp32 and shaped like the parameter; model_params empty or one per
// parameter; steps, inv_scale and found_inf 1-element fp32 CPU tensors, read on the host. When
// found_inf is not 0 nothing is written at all. The caller checks the gradients for inf and NaN;
// this op flags nothing. CPU tensors of any strides (non-contiguous ones are staged through
// contiguous copies and written back), possibly empty; 64-bit sizes and offsets. The tensors'
// metadata is read in one parallel scan (AdamCall, a PlannedCall), then one at::parallel_for
// over chunks spanning all tensors steps them.
#include "fused_optimizer_cpu.h"

#include <torch/library.h>

namespace apex_lite {
namespace cpu {
namespace {

void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, at::TensorList model_params, at::TensorList steps,
                 const at::Tensor& inv_scale, const at::Tensor& found_inf, double lr, double beta1,
                 double beta2, double eps, double weight_decay, bool adam_w_mode,
                 bool bias_correction) {
  const AdamCall call("fused_adam_", params, grads, exp_avgs, exp_avg_sqs, model_params, steps,
                      inv_scale, found_inf, beta1, beta2, bias_correction,
                      static_cast<float>(lr));
  if (read_scalar(found_inf) != 0.0f || params.empty()) return;

  const AdamConstants c =
      adam_constants(inv_scale, beta1, 1.0 - beta1, beta2, eps, weight_decay, adam_w_mode);
  call.count_step();
  adam_step_pass(c, call);
  call.write_back();
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_lite, CPU, m) { m.impl("fused_adam_", &fused_adam_); }

}  // namespace cpu
}  // namespace apex_lite
