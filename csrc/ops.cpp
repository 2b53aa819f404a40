// The op schemas of apex_lite._C, in one place. Each device registers its kernels in its own
// file with TORCH_LIBRARY_IMPL(apex_lite, CPU|CUDA, m); Python registers the fake kernels.
//
// Contract shared by every kernel (apex_lite/multi_tensor/_python.py is the reference):
// arithmetic in fp32 whatever the storage dtype, rounded once to the output dtype; found_inf is
// a 1-element fp32 tensor on the tensors' device, set to 1 when an input element is inf or NaN,
// never written 0; no host synchronisation.
#include <torch/library.h>

TORCH_LIBRARY(apex_lite, m) {
  // tensors[i] *= scale
  m.def("scale_(Tensor(a!)[] tensors, float scale, Tensor(b!) found_inf) -> ()");
  // outputs[i] = inputs[i] * scale; outputs never alias inputs
  m.def("scale_out(Tensor[] inputs, Tensor(a!)[] outputs, float scale, Tensor(b!) found_inf) -> ()");
  // ys[i] = a * xs[i] + b * ys[i]; both xs and ys are checked
  m.def("axpby_(Tensor[] xs, Tensor(a!)[] ys, float a, float b, Tensor(b!) found_inf) -> ()");
  // outputs[i] = a * xs[i] + b * ys[i]; outputs alias neither
  m.def("axpby_out(Tensor[] xs, Tensor[] ys, Tensor(a!)[] outputs, float a, float b, "
        "Tensor(b!) found_inf) -> ()");
  // (total, per_tensor_norms): fp32 [1] and fp32 [len(tensors)] (or [0] when not per_tensor)
  m.def("l2norm(Tensor[] tensors, bool per_tensor) -> (Tensor, Tensor)");
  // bool [len(tensors)]: True where tensors[i] holds an inf or NaN
  m.def("nonfinite_flags(Tensor[] tensors) -> Tensor");

  // The fused optimizer steps (apex_lite/optimizers). Per parameter i: grads[i] * inv_scale is
  // the true gradient; params[i] (fp32, or fp16/bf16 when a half parameter is stepped without
  // master weights) is updated in fp32 and rounded once to its dtype; the state tensors are fp32
  // and shaped like params[i]; model_params is empty or holds one tensor per parameter (the half
  // model parameter under O2) that receives the updated value rounded once to its dtype.
  // inv_scale and found_inf are 1-element fp32 tensors on the parameters' device; when found_inf
  // is not 0 the op writes nothing at all (params, state, steps, model_params). Neither is ever
  // read on the host by a CUDA kernel. The per-element arithmetic is spelled out in
  // apex_lite/multi_tensor/_python.py, the reference.
  //
  // SGD (torch.optim.SGD, apex's FusedSGD): momentum_buffers is empty when momentum == 0;
  // first_run: the buffers are initialised to the gradient (torch's first step).
  m.def("fused_sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
        "Tensor(c!)[] model_params, Tensor inv_scale, Tensor found_inf, float lr, "
        "float momentum, float dampening, float weight_decay, bool nesterov, "
        "bool wd_after_momentum, bool first_run) -> ()");
  // Adam / AdamW (apex's FusedAdam; torch.optim.Adam, AdamW): steps[i] is the parameter's step
  // count, a 1-element fp32 tensor on the device, incremented before use.
  m.def("fused_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] model_params, Tensor(e!)[] steps, "
        "Tensor inv_scale, Tensor found_inf, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, bool adam_w_mode, bool bias_correction) -> ()");
  // LAMB (apex's FusedLAMB): grad_norm is the 1-element fp32 norm of all true gradients of the
  // optimizer (every group), which the caller computes; per-tensor trust ratios inside.
  m.def("fused_lamb_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] model_params, Tensor(e!)[] steps, "
        "Tensor inv_scale, Tensor found_inf, Tensor grad_norm, float lr, float beta1, "
        "float beta2, float eps, float weight_decay, bool adam_w_mode, bool bias_correction, "
        "bool grad_averaging, float max_grad_norm, bool use_nvlamb) -> ()");
  // ---- fused_lamb_mp_ (issue 27: apex's FusedMixedPrecisionLamb) ----
  // LAMB as fused_lamb_ with apex's FusedMixedPrecisionLamb's device-side lr and step: step is the
  // 1-element fp32 number of the step being taken (1 for the first), the same for every
  // parameter, which the caller increments (unless found_inf) and the op only reads; lr is a
  // 1-element fp32 tensor, read where the kernel runs. params are the fp32 masters of the half
  // model_params (or parameters stepped without masters, model_params empty).
  m.def("fused_lamb_mp_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] model_params, Tensor step, Tensor lr, "
        "Tensor inv_scale, Tensor found_inf, Tensor grad_norm, float beta1, float beta2, "
        "float eps, float weight_decay, bool adam_w_mode, bool bias_correction, "
        "bool grad_averaging, float max_grad_norm, bool use_nvlamb) -> ()");
  // ---- end fused_lamb_mp_ ----
}
