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
// Where the dispatcher would pick the device's kernel anyway (every held tensor and gradient a
// plain dense tensor of the device, no thread-local dispatch key such as a Python mode's or
// functionalization's, no profiler callbacks) the step goes straight to that kernel
// (redispatch): the dispatcher's own choice reads the key set of every tensor of every list, and
// after the previous pass those TensorImpls are out of cache (4000 parameters: 24000 misses in a
// row, about 0.25 ms on this 2-core CPU). The held tensors' keys are read when the lists are
// built; a held tensor that .data later turns into another device's still meets the kernel's
// device check.
//
// A step returns false, having done nothing, when a gradient is not one this path takes: absent
// (the caller skips such parameters and needs lists without them), not a dense strided tensor,
// not laid out as its parameter (checks::laid_out_as; the list path stages such tensors), of
// another dtype than fp32, fp16
// or bf16, or on another device than its parameter. The caller then takes the list path, which
// handles or refuses it with its own message. The op's own errors (a parameter whose shape
// changed under its state, through .data) are raised before it writes anything, as on the list
// path.
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "multi_tensor_checks.h"
#include "plain_tensor.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace apex_lite {
namespace {

using Tensors = std::vector<at::Tensor>;
// The keys of a tensor or key set that can choose an op's kernel below autograd.
using plain::kernel_keys;

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
    if (params_.empty()) return;
    device_ = params_[0].device();
    device_keys_ = kernel_keys(params_[0]);
    const auto plain_list = [&](const Tensors& list) {
      return std::all_of(list.begin(), list.end(),
                         [&](const at::Tensor& t) { return kernel_keys(t) == device_keys_; });
    };
    // A dense tensor's kernel keys are its backend's alone (a subclass adds Python's, say).
    plain_ = device_keys_ == c10::DispatchKeySet(device_keys_.highestPriorityTypeId()) &&
             plain_list(params_) && plain_list(models_) &&
             std::all_of(state_.begin(), state_.end(), plain_list);
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
    return step_with_grads([&](const Tensors& grads, std::optional<c10::DispatchKeySet> keys) {
      dispatch(op, keys, params_, grads, state_[0], models_, inv_scale, found_inf, lr, momentum,
               dampening, weight_decay, nesterov, wd_after_momentum, first_run);
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
    return step_with_grads([&](const Tensors& grads, std::optional<c10::DispatchKeySet> keys) {
      dispatch(op, keys, params_, grads, state_[0], state_[1], models_, state_[2], inv_scale,
               found_inf, lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction);
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

  // op(args...) with the keys the dispatcher would compute (see the file's comment), or through
  // the dispatcher when keys is empty.
  template <typename Signature, typename... Args>
  static void dispatch(const c10::TypedOperatorHandle<Signature>& op,
                       std::optional<c10::DispatchKeySet> keys, const Args&... args) {
    if (keys.has_value()) {
      op.redispatch(*keys, args...);
    } else {
      op.call(args...);
    }
  }

  // The key set to redispatch with when the dispatcher would choose the device's kernel itself
  // (plain_held tensors, plain_grads gradients, nothing added by thread-local keys, nobody
  // observing op calls); empty to go through the dispatcher. Called below autograd.
  std::optional<c10::DispatchKeySet> direct_keys(bool plain_grads) const {
    if (!plain_ || !plain_grads ||
        at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION).has_value()) {
      return std::nullopt;
    }
    const c10::impl::LocalDispatchKeySet local = c10::impl::tls_local_dispatch_key_set();
    if (kernel_keys((device_keys_ | local.included_) - local.excluded_) != device_keys_) {
      return std::nullopt;
    }
    return device_keys_;
  }

  // call(grads, keys) below autograd, as the list path's fallback runs the op, once every
  // gradient is gathered; false, having done nothing, when one is not a gradient this path
  // takes. The gradients' references are dropped on all threads (after the step's pass their
  // TensorImpls are out of cache again, and each drop is an atomic decrement of one of them).
  template <typename Call>
  bool step_with_grads(Call&& call) const {
    Tensors grads;
    bool plain_grads = true;
    if (!gather_grads(grads, plain_grads)) return false;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      call(grads, direct_keys(plain_grads));
    }
    at::parallel_for(0, static_cast<int64_t>(grads.size()), kGradGrain,
                     [&](int64_t begin, int64_t end) {
                       for (int64_t i = begin; i < end; ++i) grads[i] = at::Tensor();
                     });
    return true;
  }

  // Sources per task of the parallel gathering and dropping of the gradients.
  static constexpr int64_t kGradGrain = 256;

  // grads[i] = each source's .grad, when every one is a gradient this path takes; plain_grads
  // false when one has other kernel keys than the parameters'. On all threads, each over its
  // own range of sources. Each .grad is three dependent reads away (the source's TensorImpl, its
  // AutogradMeta, the gradient's TensorImpl), each likely out of cache after the backward: they
  // are asked for kAhead, 2 kAhead and 3 kAhead sources ahead so that the misses overlap, and
  // both cores' misses overlap too.
  bool gather_grads(Tensors& grads, bool& plain_grads) const {
    constexpr size_t kAhead = 8;
    const size_t n = sources_.size();
    grads.resize(n);
    std::atomic<bool> usable{true}, plain{true};
    at::parallel_for(0, static_cast<int64_t>(n), kGradGrain, [&](int64_t begin, int64_t end) {
      const size_t last = static_cast<size_t>(end);
      bool range_plain = true;
      for (size_t i = static_cast<size_t>(begin); i < last; ++i) {
        if (i + 3 * kAhead < last) {
          __builtin_prefetch(sources_[i + 3 * kAhead].unsafeGetTensorImpl());
        }
        if (i + 2 * kAhead < last) {
          __builtin_prefetch(sources_[i + 2 * kAhead].unsafeGetTensorImpl()->autograd_meta());
        }
        if (i + kAhead < last) {
          __builtin_prefetch(sources_[i + kAhead].grad().unsafeGetTensorImpl());
        }
        const at::Tensor& g = sources_[i].grad();
        if (!g.defined() || g.layout() != at::kStrided || !checks::laid_out_as(g, params_[i]) ||
            !checks::is_supported_dtype(g.scalar_type()) || g.device() != device_) {
          usable.store(false, std::memory_order_relaxed);
          return;
        }
        range_plain = range_plain && kernel_keys(g) == device_keys_;
        grads[i] = g;
      }
      if (!range_plain) plain.store(false, std::memory_order_relaxed);
    });
    plain_grads = plain.load();
    return usable.load();
  }

  Tensors params_, sources_, models_;
  std::vector<Tensors> state_;
  // The parameters' device (an update holds one device's lists; each gradient must be on it),
  // its kernel keys, and whether every held tensor had just those when the lists were built.
  c10::Device device_ = c10::Device(c10::kCPU);
  c10::DispatchKeySet device_keys_;
  bool plain_ = false;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(apex_lite, m) {
  m.class_<HeldLists>("HeldLists")
      .def(torch::init<Tensors, Tensors, Tensors, std::vector<Tensors>>())
      .def("fused_sgd_", &HeldLists::fused_sgd_)
      .def("fused_adam_", &HeldLists::fused_adam_);
}

}  // namespace apex_lite
