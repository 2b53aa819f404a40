// torch.classes.apex_lite.HeldLists: the tensor lists of one fused optimizer update, held in C++
// between steps, so that a step passes no list through Python.
//
// Why: a call of a list op from Python converts every tensor of every list to an IValue and back
// (pybind's caster, reference counts, the GIL taken and dropped) and then runs the dispatcher's
// boxed autograd fallback over them. For AdamW O2 on 4000 parameters that is 24000 tensors and
// about 3 ms per step on this 2-core CPU (the checks and the gradients' gathering here: under
// 1 ms). apex_lite/optimizers/update.py builds one HeldLists per cached plan (the lists only
// change when the parameter set or the state does, and the plan is rebuilt then); each step it
// calls fused_adam_ or fused_sgd_ here with the scalars only. The gradients are read here, from
// the gradient sources' .grad (the half model parameters under O2, the parameters themselves
// standalone).
//
// The step calls the same registered op, through the dispatcher, as the list path does, so the
// same kernel (CPU or CUDA, by the tensors' device) with the same checks runs on the same
// tensors: results are bit for bit those of the list path. Below autograd, as the list path's
// fallback runs for these ops: it records nothing and bumps no version counter (the op has no
// autograd formula; the caller holds no_grad).
//
// A step returns false, having done nothing, when a gradient is not one this path takes: absent
// (the caller skips such parameters and needs lists without them), not a dense strided tensor,
// not contiguous (the CUDA path stages such tensors in Python), of another dtype than fp32, fp16
// or bf16, or on another device than its parameter. The caller then takes the list path, which
// handles or refuses it with its own message. The op's own errors (a parameter whose shape
// changed under its state, through .data) are raised before it writes anything, as on the list
// path.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "multi_tensor_checks.h"

#include <string>
#include <utility>
#include <vector>

namespace apex_lite {
namespace {

using Tensors = std::vector<at::Tensor>;

class HeldLists : public torch::CustomClassHolder {
 public:
  // params: what the op updates; grad_sources: whose .grad is each parameter's gradient
  // (aligned with params); model_params: empty or aligned with params; state: the op's state
  // lists in its order (Adam: exp_avgs, exp_avg_sqs, steps).
  HeldLists(Tensors params, Tensors grad_sources, Tensors model_params,
            std::vector<Tensors> state)
      : params_(std::move(params)),
        sources_(std::move(grad_sources)),
        models_(std::move(model_params)),
        state_(std::move(state)) {
    TORCH_CHECK(sources_.size() == params_.size(), "HeldLists: grad_sources has ",
                sources_.size(), " tensors but params has ", params_.size());
    TORCH_CHECK(models_.empty() || models_.size() == params_.size(),
                "HeldLists: model_params has ", models_.size(), " tensors but params has ",
                params_.size());
  }

  // One fused_sgd_ step (state: the momentum buffers, an empty list without momentum); false:
  // nothing done, see above.
  bool fused_sgd_(const at::Tensor& inv_scale, const at::Tensor& found_inf, double lr,
                  double momentum, double dampening, double weight_decay, bool nesterov,
                  bool wd_after_momentum, bool first_run) {
    expect_state_lists("fused_sgd_", 1, "the momentum buffers");
    static const auto op = typed_op<void(
        at::TensorList, at::TensorList, at::TensorList, at::TensorList, const at::Tensor&,
        const at::Tensor&, double, double, double, double, bool, bool, bool)>("fused_sgd_");
    return step_with_grads([&](const Tensors& grads) {
      op.call(params_, grads, state_[0], models_, inv_scale, found_inf, lr, momentum, dampening,
              weight_decay, nesterov, wd_after_momentum, first_run);
    });
  }

  // One fused_adam_ step (state: exp_avgs, exp_avg_sqs, steps); false: nothing done, see above.
  bool fused_adam_(const at::Tensor& inv_scale, const at::Tensor& found_inf, double lr,
                   double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
                   bool bias_correction) {
    expect_state_lists("fused_adam_", 3, "exp_avgs, exp_avg_sqs and steps");
    static const auto op = typed_op<void(
        at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
        at::TensorList, const at::Tensor&, const at::Tensor&, double, double, double, double,
        double, bool, bool)>("fused_adam_");
    return step_with_grads([&](const Tensors& grads) {
      op.call(params_, grads, state_[0], state_[1], models_, state_[2], inv_scale, found_inf, lr,
              beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction);
    });
  }

 private:
  // The registered op apex_lite::<name>, typed, for calls from C++.
  template <typename Signature>
  static c10::TypedOperatorHandle<Signature> typed_op(const char* name) {
    return c10::Dispatcher::singleton()
        .findSchemaOrThrow((std::string("apex_lite::") + name).c_str(), "")
        .typed<Signature>();
  }

  void expect_state_lists(const char* op, size_t count, const char* which) const {
    TORCH_CHECK(state_.size() == count, "HeldLists.", op, ": the lists were built with ",
                state_.size(), " state lists; its state lists are ", which);
  }

  // call(grads) below autograd, as the list path's fallback runs the op, once every gradient is
  // gathered; false, having done nothing, when one is not a gradient this path takes.
  template <typename Call>
  bool step_with_grads(Call&& call) const {
    Tensors grads;
    if (!gather_grads(grads)) return false;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    call(grads);
    return true;
  }

  // grads = each source's .grad, when every one is a gradient this path takes. Each .grad is
  // three dependent reads away (the source's TensorImpl, its AutogradMeta, the gradient's
  // TensorImpl), each likely out of cache after the backward: they are asked for kAhead,
  // 2 kAhead and 3 kAhead tensors ahead so the misses overlap.
  bool gather_grads(Tensors& grads) const {
    constexpr size_t kAhead = 8;
    const size_t n = sources_.size();
    grads.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      if (i + 3 * kAhead < n) __builtin_prefetch(sources_[i + 3 * kAhead].unsafeGetTensorImpl());
      if (i + 2 * kAhead < n) {
        __builtin_prefetch(sources_[i + 2 * kAhead].unsafeGetTensorImpl()->autograd_meta());
      }
      if (i + kAhead < n) __builtin_prefetch(sources_[i + kAhead].grad().unsafeGetTensorImpl());
      const at::Tensor& g = sources_[i].grad();
      if (!g.defined() || g.layout() != at::kStrided || !g.is_contiguous() ||
          !checks::is_supported_dtype(g.scalar_type()) || g.device() != params_[i].device()) {
        return false;
      }
      grads.push_back(g);
    }
    return true;
  }

  Tensors params_, sources_, models_;
  std::vector<Tensors> state_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(apex_lite, m) {
  m.class_<HeldLists>("HeldLists")
      .def(torch::init<Tensors, Tensors, Tensors, std::vector<Tensors>>())
      .def("fused_sgd_", &HeldLists::fused_sgd_)
      .def("fused_adam_", &HeldLists::fused_adam_);
}

}  // namespace apex_lite
