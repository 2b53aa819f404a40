// apex_lite::fused_adagrad_ on CPU: one Adagrad step (apex's FusedAdagrad; torch.optim.Adagrad
// without lr_decay) over all parameters of a call.
//
// Contract (apex_lite/multi_tensor/_python.py is the reference, bit for bit): per element, in
// fp32, each line one rounding, hyper-parameters converted from double to fp32 once:
//   g = float(grad) * inv_scale
//   if weight_decay != 0 and not adagrad_w_mode:  g = g + weight_decay * p
//   h = h + g * g
//   update = g / (sqrt(h) + eps)                 (sqrt correctly rounded)
//   if weight_decay != 0 and adagrad_w_mode:      update = update + weight_decay * p
//   p = p - lr * update
// then params[i] = round(p), model_params[i] = round(p) (each to its own dtype, to nearest even)
// and steps[i] += 1 (the count torch's Adagrad keeps; the update does not read it). sums are
// fp32 and shaped like the parameter; dtypes, lists, found_inf and layouts as fused_adam_: when
// found_inf is not 0 nothing is written at all. One parallel pass over chunks spanning all
// tensors, after the plan's scan (PlannedCall).
#include "fused_optimizer_cpu.h"

#include <torch/library.h>

namespace apex_lite {
namespace cpu {
namespace {

struct AdagradConstants {
  float inv_scale;
  float lr;
  float eps;
  float weight_decay;
  bool decay_grad;    // weight_decay != 0 and not adagrad_w_mode
  bool decay_update;  // weight_decay != 0 and adagrad_w_mode
};

struct AdagradTensor {
  void* param;
  const void* grad;
  float* sum;
  void* model;  // nullptr: no model parameter
  float* count;
};

struct AdagradPlanner {
  using Entry = AdagradTensor;
  struct Cache {};

  AdagradTensor entry(const ParamData& d, Cache&) const {
    return AdagradTensor{d.param, d.grad, d.state[0], d.model, d.count};
  }
};

template <typename P, typename G, typename M>
struct AdagradStep {
  static void run(const AdagradConstants& constants, const AdagradTensor& t, int64_t begin,
                  int64_t n) {
    const AdagradConstants c = constants;  // a local copy: the stores below cannot alias it
    float* h = t.sum + begin;
    update_segment(element_ptr<P>(t.param, begin), element_ptr<G>(t.grad, begin),
                   element_ptr<M>(t.model, begin), n, [&](auto& p, auto g, int64_t j) {
                     using V = std::decay_t<decltype(p)>;
                     g = g * V(c.inv_scale);
                     if (c.decay_grad) g = g + V(c.weight_decay) * p;
                     const V h_new = load_state<V>(h + j) + g * g;
                     store_state(h + j, h_new);
                     V update = g / (sqrt_lanes(h_new) + V(c.eps));
                     if (c.decay_update) update = update + V(c.weight_decay) * p;
                     p = p - V(c.lr) * update;
                   });
  }
};

using AdagradStepFn = void (*)(const AdagradConstants&, const AdagradTensor&, int64_t, int64_t);

void fused_adagrad_(at::TensorList params, at::TensorList grads, at::TensorList sums,
                    at::TensorList model_params, at::TensorList steps,
                    const at::Tensor& inv_scale, const at::Tensor& found_inf, double lr,
                    double eps, double weight_decay, bool adagrad_w_mode) {
  const char* op = "fused_adagrad_";
  const PlannedCall<AdagradPlanner> call(
      op, StepLists{params, grads, model_params, {sums}, 1, steps, true}, inv_scale, found_inf,
      AdagradPlanner{}, [&] {
        check_step_args(op, params, grads, model_params, inv_scale, found_inf);
        check_state_list(op, "sums", sums, params);
        check_steps(op, steps, params);
      });
  if (read_scalar(found_inf) != 0.0f || params.empty()) return;

  AdagradConstants c;
  c.inv_scale = read_scalar(inv_scale);
  c.lr = static_cast<float>(lr);
  c.eps = static_cast<float>(eps);
  c.weight_decay = static_cast<float>(weight_decay);
  c.decay_grad = weight_decay != 0.0 && !adagrad_w_mode;
  c.decay_update = weight_decay != 0.0 && adagrad_w_mode;

  const std::vector<AdagradTensor>& tensors = call.entries();
  std::vector<AdagradStepFn> kernels(call.size());
  for (size_t i = 0; i < call.size(); ++i) {
    kernels[i] = step_kernel_for<AdagradStep>(call.types()[i]);
  }
  parallel_segments(call.offsets(), [&](int64_t t, int64_t begin, int64_t length) {
    kernels[t](c, tensors[t], begin, length);
  });
  for (const AdagradTensor& t : tensors) *t.count += 1.0f;
  call.write_back();
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_lite, CPU, m) { m.impl("fused_adagrad_", &fused_adagrad_); }

}  // namespace cpu
}  // namespace apex_lite
