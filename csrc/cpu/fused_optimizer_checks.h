// The rules of the CPU fused optimizer steps' tensors (fused_sgd.cpp, fused_adam.cpp,
// fused_lamb.cpp, fused_novograd.cpp, fused_adagrad.cpp) and the argument checks made of them.
// Each rule is one function over one tensor, used two ways: by the checks, which raise the op's
// error, and by PlannedCall's one scan over a call's lists (fused_optimizer_cpu.h), which only
// asks whether every tensor follows them.
#pragma once

#include "multi_tensor_cpu.h"
#include "../plain_tensor.h"

#include <cstddef>

namespace apex_lite {
namespace cpu {

// ---- the rules of a step's tensors --------------------------------------------------------
//
// Each rule is spelled once, here: a function over one tensor (its TensorImpl, whose fields the
// plan's scan reads) that returns whether the tensor follows it, and otherwise returns what
// fail(message parts...) returns. Both ways of checking a call use them: the checks below pass
// Raise, which throws the op's error, and run the rules in the op's order; PlannedCall's scan
// passes Refuse, which only answers false (no message is built), and runs the op's checks for
// the error when a tensor fails. The scan adds its own conditions (plain and contiguous tensors)
// for the tensors it plans without staging.

// fail for the checks: throws the op's error (a RuntimeError) with the message.
struct Raise {
  template <typename... Parts>
  bool operator()(const Parts&... parts) const {
    TORCH_CHECK(false, parts...);
    return false;
  }
};

// fail for the scan: the tensor breaks a rule (the checks will say which).
struct Refuse {
  template <typename... Parts>
  bool operator()(const Parts&...) const {
    return false;
  }
};

// On the CPU, as every tensor of a call (this is the CPU kernel).
template <typename Fail>
inline bool on_cpu(const char* op, const char* name, size_t i, const c10::TensorImpl& t,
                   Fail&& fail) {
  if (t.device().is_cpu()) return true;
  return fail("apex_lite::", op, ": ", name, "[", i, "] is on ", t.device(),
              " but this is the CPU kernel; all tensors of a call must be on one device");
}

// params, grads, model_params: float32, float16 or bfloat16, on the CPU (any strides: see
// ContiguousList).
template <typename Fail>
inline bool stepped_tensor_ok(const char* op, const char* name, size_t i,
                              const c10::TensorImpl& t, Fail&& fail) {
  const at::ScalarType dtype = c10::typeMetaToScalarType(t.dtype());
  if (!is_supported_dtype(dtype)) {
    return fail("apex_lite::", op, ": ", name, "[", i, "] has dtype ", dtype,
                "; only float32, float16 and bfloat16 are supported");
  }
  return on_cpu(op, name, i, t, fail);
}

// Optimizer state (momentum buffers, exp_avgs, exp_avg_sqs): float32 whatever the parameter's
// dtype, on the CPU.
template <typename Fail>
inline bool state_tensor_ok(const char* op, const char* name, size_t i, const c10::TensorImpl& t,
                            Fail&& fail) {
  const at::ScalarType dtype = c10::typeMetaToScalarType(t.dtype());
  if (dtype != at::kFloat) {
    return fail("apex_lite::", op, ": ", name, "[", i, "] has dtype ", dtype,
                "; optimizer state is float32 whatever the parameter's dtype (create it with "
                "torch.zeros_like(param, dtype=torch.float32))");
  }
  return on_cpu(op, name, i, t, fail);
}

// steps[i]: the parameter's step count, one float32 element on the CPU.
template <typename Fail>
inline bool step_count_ok(const char* op, size_t i, const c10::TensorImpl& t, Fail&& fail) {
  const at::ScalarType dtype = c10::typeMetaToScalarType(t.dtype());
  if (t.numel() == 1 && dtype == at::kFloat && t.device().is_cpu()) return true;
  return fail("apex_lite::", op, ": steps[", i,
              "] must be a 1-element float32 CPU tensor (the parameter's step count), got ",
              t.numel(), " elements of ", dtype, " on ", t.device());
}

// name[i] is shaped like params[i] (of sizes `param`).
template <typename Fail>
inline bool shaped_like_param(const char* op, const char* name, size_t i,
                              const c10::TensorImpl& t, at::IntArrayRef param, Fail&& fail) {
  if (plain::same_sizes(t.sizes(), param)) return true;
  return fail("apex_lite::", op, ": params[", i, "] has shape ", param, " but ", name, "[", i,
              "] has ", t.sizes());
}

// The lengths of a call's lists, for n parameters: one gradient, state tensor and (when size is
// the steps') step count per parameter (`fix` ends the message); model_params none or one per
// parameter.
template <typename Fail>
inline bool one_per_param(const char* op, const char* name, size_t size, size_t n,
                          const char* fix, Fail&& fail) {
  if (size == n) return true;
  return fail("apex_lite::", op, ": params has ", n, " tensors but ", name, " has ", size, fix);
}

template <typename Fail>
inline bool models_length_ok(const char* op, size_t size, size_t n, Fail&& fail) {
  if (size == 0 || size == n) return true;
  return fail("apex_lite::", op, ": model_params has ", size, " tensors but params has ", n,
              "; pass one model parameter per parameter, or none");
}

constexpr const char* kStepsFix = "; pass one step count per parameter";

// ---- argument checks ----------------------------------------------------------------------
// The rules above with Raise, list by list in the op's order: the first failure's error.

// One list of stepped tensors (params, grads, model_params).
inline void check_list(const char* op, const char* name, at::TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    stepped_tensor_ok(op, name, i, *tensors[i].unsafeGetTensorImpl(), Raise{});
  }
}

// b aligned with params (a): one tensor per parameter, shaped like it.
inline void check_same_sizes(const char* op, const char* name_a, at::TensorList a,
                             const char* name_b, at::TensorList b) {
  (void)name_a;  // always "params"
  one_per_param(op, name_b, b.size(), a.size(), "", Raise{});
  for (size_t i = 0; i < a.size(); ++i) {
    shaped_like_param(op, name_b, i, *b[i].unsafeGetTensorImpl(), a[i].sizes(), Raise{});
  }
}

// What every step takes: params and grads of fp32/fp16/bf16 on the CPU, pairwise equal shapes;
// model_params empty or one per parameter, shaped like it; inv_scale and found_inf.
inline void check_step_args(const char* op, at::TensorList params, at::TensorList grads,
                            at::TensorList model_params, const at::Tensor& inv_scale,
                            const at::Tensor& found_inf) {
  check_list(op, "params", params);
  check_list(op, "grads", grads);
  check_same_sizes(op, "params", params, "grads", grads);
  models_length_ok(op, model_params.size(), params.size(), Raise{});
  check_list(op, "model_params", model_params);
  if (!model_params.empty()) check_same_sizes(op, "params", params, "model_params", model_params);
  check_scalar_tensor(op, "inv_scale", inv_scale);
  check_found_inf(op, found_inf);
}

// A state list (momentum buffers, exp_avgs, exp_avg_sqs): one fp32 CPU tensor per parameter,
// shaped like it, whatever the parameter's dtype.
inline void check_state_list(const char* op, const char* name, at::TensorList state,
                             at::TensorList params) {
  check_same_sizes(op, "params", params, name, state);
  for (size_t i = 0; i < state.size(); ++i) {
    state_tensor_ok(op, name, i, *state[i].unsafeGetTensorImpl(), Raise{});
  }
}

// steps: one 1-element fp32 CPU tensor per parameter, its step count. (That each is the
// parameter's own, PlannedCall checks over the addresses it plans with.)
inline void check_steps(const char* op, at::TensorList steps, at::TensorList params) {
  one_per_param(op, "steps", steps.size(), params.size(), kStepsFix, Raise{});
  for (size_t i = 0; i < steps.size(); ++i) {
    step_count_ok(op, i, *steps[i].unsafeGetTensorImpl(), Raise{});
  }
}

}  // namespace cpu
}  // namespace apex_lite
