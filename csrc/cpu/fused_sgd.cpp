// apex_lite::fused_sgd_ on CPU: one SGD step (torch.optim.SGD, apex's FusedSGD) over all
// parameters of a call.
//
// Contract (apex_lite/multi_tensor/_python.py is the reference, bit for bit): per element, in
// fp32, each line one rounding, hyper-parameters converted from double to fp32 once:
//   g = float(grad) * inv_scale
//   if weight_decay != 0 and not wd_after_momentum:  g = g + weight_decay * p
//   if momentum != 0:
//       buf = g                                          (first_run: the buffer is not read)
//       buf = momentum * buf + (1 - dampening) * g       (otherwise; 1 - dampening in double)
//       g = g + momentum * buf  (nesterov)  or  g = buf
//   if weight_decay != 0 and wd_after_momentum:      g = g + weight_decay * p
//   p = p - lr * g
// then params[i] = round(p) and model_params[i] = round(p), each rounded once to its own dtype
// (to nearest even). params and model_params are fp32/fp16/bf16 (p = float(param): a half
// parameter without master weights is updated in fp32 and rounded once), grads fp32/fp16/bf16
// in any combination; momentum_buffers fp32 and shaped like the parameter, one per parameter
// when momentum != 0 (with momentum 0 they may be empty and are not touched); model_params empty
// or one per parameter; inv_scale and found_inf 1-element fp32 CPU tensors, read on the host.
// When found_inf is not 0 nothing is written at all. The caller checks the gradients for inf and
// NaN; this op flags nothing. CPU tensors of any strides (non-contiguous ones are staged through
// contiguous copies and written back), possibly empty; 64-bit sizes and offsets. The tensors'
// metadata is read in one parallel scan (PlannedCall), then one at::parallel_for over chunks
// spanning all tensors steps them.
#include "fused_optimizer_cpu.h"

#include <torch/library.h>

namespace apex_lite {
namespace cpu {
namespace {

struct SgdConstants {
  float inv_scale;
  float lr;
  float momentum;
  float dampening_complement;  // 1 - dampening, in double then fp32
  float weight_decay;
  bool decay_before;  // weight_decay != 0 and not wd_after_momentum
  bool decay_after;   // weight_decay != 0 and wd_after_momentum
  bool use_momentum;
  bool first_run;
  bool nesterov;
};

struct SgdTensor {
  void* param;
  const void* grad;
  float* buffer;  // nullptr without momentum
  void* model;    // nullptr: no model parameter
};

// The step direction from float(grad) g; updates the momentum buffer at buffer[j].
template <typename V>
inline V sgd_direction(const SgdConstants& c, const V& p, V g, float* buffer, int64_t j) {
  g = g * V(c.inv_scale);
  if (c.decay_before) g = g + V(c.weight_decay) * p;
  if (c.use_momentum) {
    const V buf = c.first_run ? g
                              : V(c.momentum) * load_state<V>(buffer + j) +
                                    V(c.dampening_complement) * g;
    store_state(buffer + j, buf);
    g = c.nesterov ? g + V(c.momentum) * buf : buf;
  }
  if (c.decay_after) g = g + V(c.weight_decay) * p;
  return g;
}

template <typename P, typename G, typename M>
struct SgdStep {
  static void run(const SgdConstants& constants, const SgdTensor& t, int64_t begin, int64_t n) {
    const SgdConstants c = constants;  // a local copy: the stores below cannot alias it
    float* buffer = c.use_momentum ? t.buffer + begin : nullptr;
    update_segment(element_ptr<P>(t.param, begin), element_ptr<G>(t.grad, begin),
                   element_ptr<M>(t.model, begin), n, [&](auto& p, auto g, int64_t j) {
                     using V = std::decay_t<decltype(p)>;
                     const V direction = sgd_direction(c, p, g, buffer, j);
                     p = p - V(c.lr) * direction;
                   });
  }
};

using SgdStepFn = void (*)(const SgdConstants&, const SgdTensor&, int64_t, int64_t);

// The plan entries of fused_sgd_: the momentum buffer when the step uses one.
struct SgdPlanner {
  using Entry = SgdTensor;
  struct Cache {};

  bool use_momentum;

  SgdTensor entry(const ParamData& d, Cache&) const {
    return SgdTensor{d.param, d.grad, use_momentum ? d.state[0] : nullptr, d.model};
  }
};

void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList buffers,
                at::TensorList model_params, const at::Tensor& inv_scale,
                const at::Tensor& found_inf, double lr, double momentum, double dampening,
                double weight_decay, bool nesterov, bool wd_after_momentum, bool first_run) {
  const char* op = "fused_sgd_";
  const bool use_momentum = momentum != 0.0;
  const bool buffers_missing = use_momentum && buffers.empty() && !params.empty();
  const PlannedCall<SgdPlanner> call(
      op, StepLists{params, grads, model_params, {buffers}, buffers.empty() ? 0u : 1u},
      inv_scale, found_inf, SgdPlanner{use_momentum},
      [&] {
        check_step_args(op, params, grads, model_params, inv_scale, found_inf);
        TORCH_CHECK(!buffers_missing, "apex_lite::", op, ": momentum is ", momentum,
                    " but momentum_buffers is empty; pass one float32 buffer per parameter");
        if (!buffers.empty()) check_state_list(op, "momentum_buffers", buffers, params);
      },
      /*scan=*/!buffers_missing);
  if (read_scalar(found_inf) != 0.0f || params.empty()) return;

  SgdConstants c;
  c.inv_scale = read_scalar(inv_scale);
  c.lr = static_cast<float>(lr);
  c.momentum = static_cast<float>(momentum);
  c.dampening_complement = static_cast<float>(1.0 - dampening);
  c.weight_decay = static_cast<float>(weight_decay);
  c.decay_before = weight_decay != 0.0 && !wd_after_momentum;
  c.decay_after = weight_decay != 0.0 && wd_after_momentum;
  c.use_momentum = use_momentum;
  c.first_run = first_run;
  c.nesterov = nesterov;

  const std::vector<SgdTensor>& tensors = call.entries();
  std::vector<SgdStepFn> kernels(call.size());
  for (size_t i = 0; i < call.size(); ++i) kernels[i] = step_kernel_for<SgdStep>(call.types()[i]);
  parallel_segments(call.offsets(), [&](int64_t t, int64_t begin, int64_t length) {
    kernels[t](c, tensors[t], begin, length);
  });
  call.write_back();
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_lite, CPU, m) { m.impl("fused_sgd_", &fused_sgd_); }

}  // namespace cpu
}  // namespace apex_lite
