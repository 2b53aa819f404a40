// apex_lite::fused_lamb_ on CUDA: one LAMB step (apex's FusedLAMB) over lists of parameters; and
// apex_lite::fused_lamb_mp_ (apex's FusedMixedPrecisionLamb), the same step with lr and the count
// of the step being taken read on the device from 1-element tensors (the count is not written).
//
// Contract: csrc/ops.cpp; the per-element arithmetic is Adam's (adam_step.cuh) with the gradient
// divided by the clip divisor (grad_norm / max_grad_norm when max_grad_norm > 0 and grad_norm
// exceeds it, computed on the device from the grad_norm tensor) and beta3 = 1 - beta1 with
// grad_averaging, else 1. With the trust ratio (use_nvlamb, or weight_decay != 0) a tensor's update
// is p = p - ratio * u with ratio = lr * (||p|| / ||u||) when both fp32 norms are not 0, else lr;
// without it, ratio = lr and the step is one Adam-like pass.
//
// With the trust ratio, four launches on the current stream, no scratch the size of the params:
// 1. a fill: the block counters and each tensor's run of partial sums, zeroed;
// 2. stage 1 (multi-tensor-apply): m, v updated in place; each block writes the fp32 sums of
//    squares of p and of u over its chunk (u recomputed, never stored) to partials[global block],
//    and the block of a tensor's first chunk records where the tensor's run of partials starts;
// 3. one block per tensor sums its run in a fixed order and writes ||p|| and ||u|| (as l2norm.cu:
//    deterministic for given inputs);
// 4. stage 2 (multi-tensor-apply): u recomputed from the stored m, v and the unchanged p (the same
//    operations on the same values, so the same u as stage 1), p updated with the trust ratio;
//    the last block of each tensor increments its step count.
// Every kernel reads found_inf first and, when it is not 0, writes nothing (nothing at all is
// written by the op). inv_scale, found_inf, grad_norm and the step counts are read on the device
// only: no host synchronisation. The norms are accumulated in an order of their own, so they (and
// through the ratio p) can differ from the Python backend's in the last bits.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "adam_step.cuh"

namespace apex_lite {
namespace cuda {
namespace {

constexpr int kNormBlockSize = 256;

// Block t: norms[t] = ||p_t|| and norms[num_tensors + t] = ||u_t|| from the partial sums of
// squares partials[0 or 1][first_partial[t] + j], j < partial_count[t] (0 for an empty tensor).
__global__ void __launch_bounds__(kNormBlockSize)
    lamb_norms_kernel(const float* found_inf, const float* partials, int64_t num_partials,
                      const int64_t* first_partial, const int64_t* partial_count, float* norms,
                      int64_t num_tensors) {
  const bool skip = share_from_thread0<bool>([&] { return skips(found_inf); });
  if (skip) {
    return;
  }
  const int64_t tensor = blockIdx.x;
  const int64_t first = first_partial[tensor];
  const int64_t count = partial_count[tensor];
  float p_sum = 0.0f;
  float u_sum = 0.0f;
  for (int64_t j = threadIdx.x; j < count; j += blockDim.x) {
    p_sum = __fadd_rn(p_sum, partials[first + j]);
    u_sum = __fadd_rn(u_sum, partials[num_partials + first + j]);
  }
  p_sum = block_sum(p_sum);
  __syncthreads();  // block_sum's shared scratch is reused by the second sum
  u_sum = block_sum(u_sum);
  if (threadIdx.x == 0) {
    norms[tensor] = __fsqrt_rn(p_sum);
    norms[num_tensors + tensor] = __fsqrt_rn(u_sum);
  }
}

// The LAMB step of fused_lamb_ and fused_lamb_mp_: lr a number, or (lr_device non-null) read on
// the device; counts_given: steps hold the number of the step being taken, not written.
void lamb_cuda(const char* op, at::TensorList params, at::TensorList grads,
               at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList model_params,
               at::TensorList steps, const at::Tensor& inv_scale, const at::Tensor& found_inf,
               const at::Tensor& grad_norm, double lr, const float* lr_device, bool counts_given,
               double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
               bool bias_correction, bool grad_averaging, double max_grad_norm,
               bool use_nvlamb) {
  check_adam_family_args(op, params, grads, exp_avgs, exp_avg_sqs, model_params, steps,
                         inv_scale, found_inf);
  const at::Device device = found_inf.device();
  check_device_scalar(op, "grad_norm", grad_norm, device);
  if (params.empty()) {
    return;
  }
  const c10::cuda::CUDAGuard guard(device);
  const int64_t n = static_cast<int64_t>(params.size());
  TORCH_CHECK(n <= INT32_MAX, "apex_lite::", op, ": at most 2**31 - 1 parameters per call");
  const bool trust_ratio = use_nvlamb || weight_decay != 0.0;

  // Row 0: the block counters of the final stage; rows 1 and 2 (trust ratio only): each tensor's
  // first partial and partial count, zero for tensors without chunks.
  const at::Tensor counters = at::zeros({trust_ratio ? 3 : 1, n},
                                        at::TensorOptions().dtype(at::kLong).device(device));
  AdamArgs args = make_adam_args(found_inf, inv_scale, counters, lr, beta1, beta2,
                                 grad_averaging ? 1.0 - beta1 : 1.0, eps, weight_decay,
                                 adam_w_mode, bias_correction);
  args.lr_device = lr_device;
  args.counts_given = counts_given;
  if (max_grad_norm > 0.0) {
    args.clip = true;
    args.max_grad_norm = static_cast<float>(max_grad_norm);
    args.grad_norm = grad_norm.data_ptr<float>();
  }

  if (!trust_ratio) {
    launch_adam_stage<AdamStage::kApply>(params, grads, exp_avgs, exp_avg_sqs, steps,
                                         model_params, args);
    if (!counts_given) {
      increment_steps_of_empty_params(params, steps, found_inf);
    }
    return;
  }

  int64_t total_chunks = 0;
  for (const at::Tensor& p : params) {
    total_chunks += num_chunks(p.numel());
  }
  if (total_chunks > 0) {
    const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
    const at::Tensor partials = at::empty({2, total_chunks}, fp32);
    const at::Tensor norms = at::empty({2, n}, fp32);
    args.partials = partials.data_ptr<float>();
    args.num_partials = total_chunks;
    args.first_partial = counters.data_ptr<int64_t>() + n;
    args.partial_count = counters.data_ptr<int64_t>() + 2 * n;
    args.norms = norms.data_ptr<float>();
    args.num_tensors = n;

    const int64_t blocks = launch_adam_stage<AdamStage::kLambNorms>(
        params, grads, exp_avgs, exp_avg_sqs, steps, model_params, args);
    TORCH_CHECK(blocks == total_chunks, "apex_lite::", op, ": internal error, launched ", blocks,
                " blocks for ", total_chunks, " chunks");
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    lamb_norms_kernel<<<static_cast<unsigned int>(n), kNormBlockSize, 0, stream>>>(
        args.found_inf, args.partials, total_chunks, args.first_partial, args.partial_count,
        norms.data_ptr<float>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    launch_adam_stage<AdamStage::kLambApply>(params, grads, exp_avgs, exp_avg_sqs, steps,
                                             model_params, args);
  }
  if (!counts_given) {
    increment_steps_of_empty_params(params, steps, found_inf);
  }
}

void fused_lamb_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList model_params,
                     at::TensorList steps, const at::Tensor& inv_scale,
                     const at::Tensor& found_inf, const at::Tensor& grad_norm, double lr,
                     double beta1, double beta2, double eps, double weight_decay,
                     bool adam_w_mode, bool bias_correction, bool grad_averaging,
                     double max_grad_norm, bool use_nvlamb) {
  lamb_cuda("fused_lamb_", params, grads, exp_avgs, exp_avg_sqs, model_params, steps, inv_scale,
            found_inf, grad_norm, lr, nullptr, false, beta1, beta2, eps, weight_decay,
            adam_w_mode, bias_correction, grad_averaging, max_grad_norm, use_nvlamb);
}

// fused_lamb_mp_ (apex's FusedMixedPrecisionLamb): lr and the count of the step being taken read
// on the device, the count shared by every parameter (each parameter's step list entry is that
// tensor; no block writes it).
void fused_lamb_mp_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList model_params,
                        const at::Tensor& step, const at::Tensor& lr,
                        const at::Tensor& inv_scale, const at::Tensor& found_inf,
                        const at::Tensor& grad_norm, double beta1, double beta2, double eps,
                        double weight_decay, bool adam_w_mode, bool bias_correction,
                        bool grad_averaging, double max_grad_norm, bool use_nvlamb) {
  const char* op = "fused_lamb_mp_";
  check_found_inf(op, found_inf);
  check_device_scalar(op, "step", step, found_inf.device());
  check_device_scalar(op, "lr", lr, found_inf.device());
  const std::vector<at::Tensor> counts(params.size(), step);
  lamb_cuda(op, params, grads, exp_avgs, exp_avg_sqs, model_params, counts, inv_scale, found_inf,
            grad_norm, 0.0, lr.data_ptr<float>(), true, beta1, beta2, eps, weight_decay,
            adam_w_mode, bias_correction, grad_averaging, max_grad_norm, use_nvlamb);
}

}  // namespace
}  // namespace cuda
}  // namespace apex_lite

TORCH_LIBRARY_IMPL(apex_lite, CUDA, m) {
  m.impl("fused_lamb_", &apex_lite::cuda::fused_lamb_cuda);
  m.impl("fused_lamb_mp_", &apex_lite::cuda::fused_lamb_mp_cuda);
}
