// What the CUDA kernels of the fused optimizer steps (fused_sgd.cu, fused_adam.cu, fused_lamb.cu)
// share: the host-side argument checks, the block prologue that reads the 1-element device tensors
// (found_inf first), the dtype dispatch of (param, grad, model param), and the step counts.
//
// Contract (csrc/ops.cpp; apex_lite/multi_tensor/_python.py spells out the arithmetic): when
// found_inf is not 0 (NaN included) nothing is written at all; found_inf, inv_scale, grad_norm and
// the step counts are read on the device only, so no call synchronises with the host.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "multi_tensor_apply.cuh"

namespace apex_lite {
namespace cuda {

// ---- host-side checks ---------------------------------------------------------------------------

// A 1-element float32 tensor on the call's device (inv_scale, grad_norm).
inline void check_device_scalar(const char* op, const char* name, const at::Tensor& t,
                                const at::Device& device) {
  TORCH_CHECK(t.defined(), "apex_lite::", op, ": ", name, " is an undefined tensor");
  TORCH_CHECK(t.device() == device, "apex_lite::", op, ": ", name, " is on ", t.device(),
              " but found_inf is on ", device, "; pass it as a tensor on the parameters' device");
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, "apex_lite::", op, ": ", name,
              " must be a 1-element float32 tensor, got ", t.scalar_type(), " with ", t.numel(),
              " elements");
}

// What every optimizer step checks first: found_inf, inv_scale, and params and grads pairwise.
inline void check_step_args(const char* op, at::TensorList params, at::TensorList grads,
                            const at::Tensor& inv_scale, const at::Tensor& found_inf) {
  check_found_inf(op, found_inf);
  const at::Device device = found_inf.device();
  check_device_scalar(op, "inv_scale", inv_scale, device);
  check_same_shapes(op, "params", params, "grads", grads);
  check_tensor_list(op, "params", params, device);
  check_tensor_list(op, "grads", grads, device, params);
}

// Optimizer state (moments, momentum buffers): one float32 tensor per parameter, shaped like it.
inline void check_state_list(const char* op, const char* name, at::TensorList state,
                             at::TensorList params, const at::Device& device) {
  check_same_shapes(op, "params", params, name, state);
  check_tensor_list(op, name, state, device, params);
  for (size_t i = 0; i < state.size(); ++i) {
    TORCH_CHECK(state[i].scalar_type() == at::kFloat, "apex_lite::", op, ": ", name, "[", i,
                "] has dtype ", state[i].scalar_type(),
                "; optimizer state is float32, also for float16 and bfloat16 parameters");
  }
}

// model_params: empty, or one tensor per parameter (the half model parameter under O2).
inline void check_model_params(const char* op, at::TensorList model_params, at::TensorList params,
                               const at::Device& device) {
  if (model_params.empty()) {
    return;
  }
  TORCH_CHECK(model_params.size() == params.size(), "apex_lite::", op, ": model_params has ",
              model_params.size(), " tensors but params has ", params.size(),
              "; pass no model parameters or one per parameter");
  check_same_shapes(op, "params", params, "model_params", model_params);
  check_tensor_list(op, "model_params", model_params, device, params);
}

// steps: one 1-element float32 tensor per parameter, on the device, each its own element (the
// last block of a parameter increments it while no other block of that call reads it; a count
// shared by two parameters would be read by one while the other increments it): refused by
// checks::check_own_step_counts.
// counts_written false: the counts are read, never written (fused_lamb_mp_'s one count for every
// parameter), so sharing them is safe.
inline void check_steps(const char* op, at::TensorList steps, at::TensorList params,
                        const at::Device& device, bool counts_written = true) {
  TORCH_CHECK(steps.size() == params.size(), "apex_lite::", op, ": steps has ", steps.size(),
              " tensors but params has ", params.size(), "; pass one step count per parameter");
  for (size_t i = 0; i < steps.size(); ++i) {
    const at::Tensor& s = steps[i];
    TORCH_CHECK(s.defined(), "apex_lite::", op, ": steps[", i, "] is an undefined tensor");
    TORCH_CHECK(s.device() == device, "apex_lite::", op, ": steps[", i, "] is on ", s.device(),
                " but the call runs on ", device,
                "; keep step counts on the parameters' device (the CUDA kernel reads them there)");
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.numel() == 1, "apex_lite::", op, ": steps[",
                i, "] must be a 1-element float32 tensor, got ", s.scalar_type(), " with ",
                s.numel(), " elements");
  }
  if (!counts_written) return;
  checks::check_own_step_counts(op, steps.size(), device, [&](size_t i) {
    return reinterpret_cast<uintptr_t>(steps[i].const_data_ptr());
  });
}

// ---- dtype dispatch -----------------------------------------------------------------------------

// For each group of parameters with the same dtypes in `lists` (list 0 the params, list 1 the
// grads, list Depth - 1 the model params when HasModel; the other lists are float32 state), calls
// launch(indices, TypeTag<param_t>(), TypeTag<grad_t>(), TypeTag<model_t>()) with the group's
// storage types (model_t is float without model params, and unused). Empty parameters are in no
// group.
template <bool HasModel, size_t NumLists, typename Launch>
void for_each_dtype_group(const std::array<at::TensorList, NumLists>& lists, Launch&& launch) {
  constexpr int Depth = static_cast<int>(NumLists);
  for (const auto& group : group_by_dtypes<Depth>(lists)) {
    dispatch_dtype(group.dtypes[0], [&](auto param_tag) {
      dispatch_dtype(group.dtypes[1], [&](auto grad_tag) {
        if constexpr (HasModel) {
          dispatch_dtype(group.dtypes[Depth - 1], [&](auto model_tag) {
            launch(group.indices, param_tag, grad_tag, model_tag);
          });
        } else {
          launch(group.indices, param_tag, grad_tag, TypeTag<float>());
        }
      });
    });
  }
}

// ---- device side --------------------------------------------------------------------------------

// Thread 0 computes the block's scalars (compute() reads found_inf and the other 1-element device
// tensors) and shares them through shared memory, so that every thread of the block sees the same
// values and takes the same branch on them (a block that returns early returns as a whole, as the
// barriers of block_sum require). Every thread must call it, once per kernel.
template <typename Scalars, typename Compute>
__device__ __forceinline__ Scalars share_from_thread0(Compute&& compute) {
  __shared__ Scalars shared;
  if (threadIdx.x == 0) {
    shared = compute();
  }
  __syncthreads();
  return shared;
}

// found_inf "not 0" skips the step: NaN skips too, as in the Python backend.
__device__ __forceinline__ bool skips(const float* found_inf) { return *found_inf != 0.0f; }

// Step counts. Every block of tensor i reads steps[i] (thread 0, in its prologue); the block that
// finishes last among the num_chunks(numel) blocks of tensor i (blocks_done[i] counts them, zeroed
// by the host) writes steps[i] + 1. No block can read the incremented value: each block's read
// precedes its count (the fences order them across blocks), and the last count comes after all
// reads. Called by thread 0 after it has read the step; `step` is the value it read.
__device__ __forceinline__ void count_block_and_increment_step(unsigned long long* blocks_done,
                                                               int32_t tensor_id, int64_t numel,
                                                               float* step_ptr, float step) {
  __threadfence();
  const unsigned long long done = atomicAdd(&blocks_done[tensor_id], 1ull) + 1ull;
  if (done == static_cast<unsigned long long>(num_chunks(numel))) {
    __threadfence();
    *step_ptr = __fadd_rn(step, 1.0f);
  }
}

// The step counts of empty parameters (which no update block visits): steps[i] += 1 unless the
// step is skipped. Launched over a list of 1-element tensors: one block each.
struct IncrementStepOp {
  const float* found_inf;

  __device__ __forceinline__ void operator()(const ChunkRef<1>& ref) const {
    if (threadIdx.x == 0 && !skips(found_inf)) {
      float* step = static_cast<float*>(ref.base[0]);
      *step = __fadd_rn(*step, 1.0f);
    }
  }
};

// Increments the step counts of the empty tensors of `params` on the device, unless found_inf is
// set; nothing is launched when no parameter is empty.
inline void increment_steps_of_empty_params(at::TensorList params, at::TensorList steps,
                                            const at::Tensor& found_inf) {
  std::vector<int64_t> empty;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) {
      empty.push_back(static_cast<int64_t>(i));
    }
  }
  if (!empty.empty()) {
    multi_tensor_apply<1>(std::array<at::TensorList, 1>{steps}, empty,
                          IncrementStepOp{found_inf.data_ptr<float>()});
  }
}

}  // namespace cuda
}  // namespace apex_lite
