// The Adam family on CUDA, shared by fused_adam.cu and fused_lamb.cu: the per-element arithmetic,
// the multi-tensor functor of each stage, its launcher and the argument checks.
//
// Per element, in fp32, each line one correctly rounded operation (no fused multiply-add, whatever
// -fmad says; __f*_rn), hyper-parameters converted from double to fp32 once on the host:
//   g = float(grad) * inv_scale
//   g = g / clip                                  (LAMB with max_grad_norm > 0: clip = grad_norm /
//                                                  max_grad_norm when grad_norm > max_grad_norm,
//                                                  else 1; computed per block on the device)
//   g = g + weight_decay * p                      (weight_decay != 0, not adam_w_mode)
//   m = beta1 * m + beta3 * g                     (beta3 = 1 - beta1, or 1 for LAMB without
//                                                  grad_averaging; in double, then fp32)
//   v = beta2 * v + ((1 - beta2) * g) * g
//   u = (m * inv_bc1) / (sqrt(v) * inv_sqrt_bc2 + eps)     (rounded in that order)
//   u = u + weight_decay * p                      (weight_decay != 0, adam_w_mode)
//   p = p - ratio * u                             (ratio = lr; LAMB's trust ratio, fused_lamb.cu)
// inv_bc1 = 1 / (1 - beta1**(step + 1)), inv_sqrt_bc2 = 1 / sqrt(1 - beta2**(step + 1)), computed
// in double from the parameter's step count read on the device, then rounded once to fp32 (1
// without bias_correction): reciprocals, so that an element costs one division rather than three.
// p is the fp32 value of the parameter (fp32, or fp16/bf16 without master weights), stored rounded
// once to its dtype, and to the model parameter's dtype when model_params is given; m, v are fp32.
//
// Against the Python backend on the CPU: m and v agree bit for bit. p should too: the backend
// takes its square roots correctly rounded (_sqrt_fp32), as __fsqrt_rn does; what remains is
// CUDA's double pow, which may differ from the host's in the last bit of the double (rarely
// visible after rounding to fp32). Not yet run on a GPU: the CUDA test keeps a tolerance on p.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>

#include "optimizer_step.cuh"

namespace apex_lite {
namespace cuda {

// kApply: the moments and the parameter in one pass (Adam; LAMB without trust ratio).
// kLambNorms: LAMB stage 1, the moments, and per-chunk sums of squares of p and u (never stored).
// kLambApply: LAMB stage 2, u recomputed from the stored m, v and the unchanged p, p updated with
//             the trust ratio.
enum class AdamStage { kApply, kLambNorms, kLambApply };

// List order of the Adam family's multi-tensor-apply; kStepList holds 1-element tensors (the step
// counts, see multi_tensor_apply), kModelList is present only with model parameters.
constexpr int kParamList = 0;
constexpr int kGradList = 1;
constexpr int kExpAvgList = 2;
constexpr int kExpAvgSqList = 3;
constexpr int kStepList = 4;
constexpr int kModelList = 5;

struct AdamArgs {
  const float* found_inf;
  const float* inv_scale;
  float lr;
  const float* lr_device;  // non-null: lr read from the device there (fused_lamb_mp_)
  // The step counts hold the number of the step being taken, which the caller increments, and
  // are not written (fused_lamb_mp_); false: the number of steps taken, incremented by the op.
  bool counts_given;
  float beta1;
  float beta2;
  float beta3;
  float one_minus_beta2;  // computed in double
  float eps;
  float weight_decay;
  double beta1_double;    // the bias corrections are computed in double
  double beta2_double;
  bool bias_correction;
  bool decay_grad;        // weight_decay != 0 and not adam_w_mode
  bool decay_update;      // weight_decay != 0 and adam_w_mode
  // LAMB's gradient clipping (clip false: none).
  bool clip;
  float max_grad_norm;
  const float* grad_norm;
  // Final stage (kApply, kLambApply): per tensor, the blocks that have read its step count.
  unsigned long long* blocks_done;
  // LAMB: partial sums of squares [2][num_partials] (p, then u) indexed by global block; each
  // tensor's run of them (first_partial, partial_count [num_tensors]); the per-tensor norms
  // [2][num_tensors] (||p||, then ||u||), read by kLambApply.
  float* partials;
  int64_t num_partials;
  int64_t* first_partial;
  int64_t* partial_count;
  const float* norms;
  int64_t num_tensors;
};

struct AdamBlockScalars {
  float inv_scale;
  float clip;    // the divisor of g (LAMB)
  float inv_bc1;
  float inv_sqrt_bc2;
  float step;    // steps[i] as read (before this step's increment, unless counts_given)
  float ratio;   // the factor of u in the parameter update
  bool skip;
};

// Thread 0 reads found_inf first, then, unless the step is skipped, inv_scale, the step count, the
// gradient norm and the per-tensor norms it needs, and derives the block's scalars.
template <AdamStage Stage>
__device__ __forceinline__ AdamBlockScalars adam_block_scalars(const AdamArgs& a,
                                                               const float* step,
                                                               int32_t tensor_id) {
  return share_from_thread0<AdamBlockScalars>([&] {
    AdamBlockScalars s{};
    s.skip = skips(a.found_inf);
    if (s.skip) {
      return s;
    }
    s.inv_scale = *a.inv_scale;
    s.clip = 1.0f;
    if (Stage != AdamStage::kLambApply && a.clip) {
      const float norm = *a.grad_norm;
      if (norm > a.max_grad_norm) {
        s.clip = __fdiv_rn(norm, a.max_grad_norm);
      }
    }
    s.step = *step;
    s.inv_bc1 = 1.0f;
    s.inv_sqrt_bc2 = 1.0f;
    if (a.bias_correction) {
      const double count = static_cast<double>(s.step) + (a.counts_given ? 0.0 : 1.0);
      s.inv_bc1 = static_cast<float>(1.0 / (1.0 - pow(a.beta1_double, count)));
      s.inv_sqrt_bc2 = static_cast<float>(1.0 / sqrt(1.0 - pow(a.beta2_double, count)));
    }
    const float lr = a.lr_device != nullptr ? *a.lr_device : a.lr;
    s.ratio = lr;
    if constexpr (Stage == AdamStage::kLambApply) {
      const float p_norm = a.norms[tensor_id];
      const float u_norm = a.norms[a.num_tensors + tensor_id];
      if (p_norm != 0.0f && u_norm != 0.0f) {
        s.ratio = __fmul_rn(lr, __fdiv_rn(p_norm, u_norm));
      }
    }
    return s;
  });
}

// The true gradient of one element, clipped and, for Adam's L2 mode, decayed.
__device__ __forceinline__ float adam_grad(float grad, float p, const AdamArgs& a,
                                           const AdamBlockScalars& block) {
  float g = __fmul_rn(grad, block.inv_scale);
  if (a.clip) {
    g = __fdiv_rn(g, block.clip);
  }
  if (a.decay_grad) {
    g = __fadd_rn(g, __fmul_rn(a.weight_decay, p));
  }
  return g;
}

__device__ __forceinline__ void adam_moments(float g, float& m, float& v, const AdamArgs& a) {
  m = __fadd_rn(__fmul_rn(a.beta1, m), __fmul_rn(a.beta3, g));
  v = __fadd_rn(__fmul_rn(a.beta2, v), __fmul_rn(__fmul_rn(a.one_minus_beta2, g), g));
}

// The update direction u from the new moments (and, in AdamW mode, the decay of p).
__device__ __forceinline__ float adam_direction(float m, float v, float p, const AdamArgs& a,
                                                const AdamBlockScalars& block) {
  const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), block.inv_sqrt_bc2), a.eps);
  float u = __fdiv_rn(__fmul_rn(m, block.inv_bc1), denom);
  if (a.decay_update) {
    u = __fadd_rn(u, __fmul_rn(a.weight_decay, p));
  }
  return u;
}

template <AdamStage Stage, typename param_t, typename grad_t, typename model_t, bool HasModel>
struct AdamStageOp {
  static constexpr int kDepth = HasModel ? 6 : 5;
  AdamArgs args;

  __device__ __forceinline__ void operator()(const ChunkRef<kDepth>& ref) const {
    float* step = static_cast<float*>(ref.base[kStepList]);
    const AdamBlockScalars block = adam_block_scalars<Stage>(args, step, ref.tensor_id);
    if (block.skip) {
      return;
    }
    param_t* param = static_cast<param_t*>(ref.base[kParamList]) + ref.start;
    const grad_t* grad = static_cast<const grad_t*>(ref.base[kGradList]) + ref.start;
    float* exp_avg = static_cast<float*>(ref.base[kExpAvgList]) + ref.start;
    float* exp_avg_sq = static_cast<float*>(ref.base[kExpAvgSqList]) + ref.start;
    model_t* model = HasModel ? static_cast<model_t*>(ref.base[kDepth - 1]) + ref.start : nullptr;
    constexpr bool kReadsGrad = Stage != AdamStage::kLambApply;
    const bool vectorised = ref.n % kILP == 0 && is_aligned<kILP>(param) &&
                            (!kReadsGrad || is_aligned<kILP>(grad)) &&
                            is_aligned<kILP>(exp_avg) && is_aligned<kILP>(exp_avg_sq) &&
                            (!HasModel || is_aligned<kILP>(model));
    float p_squares = 0.0f;
    float u_squares = 0.0f;
    for_each_group(ref.n, vectorised, [&](int64_t i, auto width) {
      constexpr int N = decltype(width)::value;
      float p[N];
      float m[N];
      float v[N];
      float u[N];
      load_fp32<N>(param + i, p);
      load_fp32<N>(exp_avg + i, m);
      load_fp32<N>(exp_avg_sq + i, v);
      if constexpr (kReadsGrad) {
        float g[N];
        load_fp32<N>(grad + i, g);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          adam_moments(adam_grad(g[k], p[k], args, block), m[k], v[k], args);
        }
        store_rounded<N>(exp_avg + i, m);
        store_rounded<N>(exp_avg_sq + i, v);
      }
#pragma unroll
      for (int k = 0; k < N; ++k) {
        u[k] = adam_direction(m[k], v[k], p[k], args, block);
      }
      if constexpr (Stage == AdamStage::kLambNorms) {
#pragma unroll
        for (int k = 0; k < N; ++k) {
          p_squares = fmaf(p[k], p[k], p_squares);
          u_squares = fmaf(u[k], u[k], u_squares);
        }
      } else {
#pragma unroll
        for (int k = 0; k < N; ++k) {
          p[k] = __fsub_rn(p[k], __fmul_rn(block.ratio, u[k]));
        }
        store_rounded<N>(param + i, p);
        if constexpr (HasModel) {
          store_rounded<N>(model + i, p);
        }
      }
    });
    if constexpr (Stage == AdamStage::kLambNorms) {
      // Every thread reaches these barriers: the loop above has no early exit.
      const float p_sum = block_sum(p_squares);
      __syncthreads();  // block_sum's shared scratch is reused by the second sum
      const float u_sum = block_sum(u_squares);
      if (threadIdx.x == 0) {
        args.partials[ref.global_block] = p_sum;
        args.partials[args.num_partials + ref.global_block] = u_sum;
        if (ref.chunk == 0) {
          args.first_partial[ref.tensor_id] = ref.global_block;
          args.partial_count[ref.tensor_id] = num_chunks(ref.numel);
        }
      }
    } else if (threadIdx.x == 0 && !args.counts_given) {
      count_block_and_increment_step(args.blocks_done, ref.tensor_id, ref.numel, step,
                                     block.step);
    }
  }
};

template <AdamStage Stage, bool HasModel>
int64_t launch_adam_stage_lists(at::TensorList params, at::TensorList grads,
                                at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                at::TensorList steps, at::TensorList model_params,
                                const AdamArgs& args) {
  constexpr int kDepth = HasModel ? 6 : 5;
  std::array<at::TensorList, kDepth> lists;
  lists[kParamList] = params;
  lists[kGradList] = grads;
  lists[kExpAvgList] = exp_avgs;
  lists[kExpAvgSqList] = exp_avg_sqs;
  lists[kStepList] = steps;
  if constexpr (HasModel) {
    lists[kModelList] = model_params;
  }
  int64_t blocks = 0;
  for_each_dtype_group<HasModel>(lists, [&](const std::vector<int64_t>& indices, auto param_tag,
                                            auto grad_tag, auto model_tag) {
    using Op = AdamStageOp<Stage, typename decltype(param_tag)::type,
                           typename decltype(grad_tag)::type, typename decltype(model_tag)::type,
                           HasModel>;
    static_assert(Op::kDepth == kDepth, "list layout");
    blocks += multi_tensor_apply<kDepth>(lists, indices, Op{args}, blocks);
  });
  return blocks;
}

// Launches one stage over all non-empty parameters; returns the number of blocks (one per chunk,
// numbered in the order of the partial sums).
template <AdamStage Stage>
int64_t launch_adam_stage(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::TensorList steps,
                          at::TensorList model_params, const AdamArgs& args) {
  if (model_params.empty()) {
    return launch_adam_stage_lists<Stage, false>(params, grads, exp_avgs, exp_avg_sqs, steps,
                                                 model_params, args);
  }
  return launch_adam_stage_lists<Stage, true>(params, grads, exp_avgs, exp_avg_sqs, steps,
                                              model_params, args);
}

// The checks shared by fused_adam_ and fused_lamb_ (lists, shapes, dtypes, devices, contiguity).
inline void check_adam_family_args(const char* op, at::TensorList params, at::TensorList grads,
                                   at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                   at::TensorList model_params, at::TensorList steps,
                                   const at::Tensor& inv_scale, const at::Tensor& found_inf) {
  check_step_args(op, params, grads, inv_scale, found_inf);
  const at::Device device = found_inf.device();
  check_state_list(op, "exp_avgs", exp_avgs, params, device);
  check_state_list(op, "exp_avg_sqs", exp_avg_sqs, params, device);
  check_model_params(op, model_params, params, device);
  check_steps(op, steps, params, device);
}

// The fp32 hyper-parameters and device pointers common to Adam and LAMB; blocks_done is the
// caller's zeroed [len(params)] int64 counter tensor.
inline AdamArgs make_adam_args(const at::Tensor& found_inf, const at::Tensor& inv_scale,
                               const at::Tensor& blocks_done, double lr, double beta1,
                               double beta2, double beta3, double eps, double weight_decay,
                               bool adam_w_mode, bool bias_correction) {
  AdamArgs a{};
  a.found_inf = found_inf.data_ptr<float>();
  a.inv_scale = inv_scale.data_ptr<float>();
  a.lr = static_cast<float>(lr);
  a.beta1 = static_cast<float>(beta1);
  a.beta2 = static_cast<float>(beta2);
  a.beta3 = static_cast<float>(beta3);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.eps = static_cast<float>(eps);
  a.weight_decay = static_cast<float>(weight_decay);
  a.beta1_double = beta1;
  a.beta2_double = beta2;
  a.bias_correction = bias_correction;
  a.decay_grad = weight_decay != 0.0 && !adam_w_mode;
  a.decay_update = weight_decay != 0.0 && adam_w_mode;
  static_assert(sizeof(int64_t) == sizeof(unsigned long long), "counters are 64-bit");
  a.blocks_done = reinterpret_cast<unsigned long long*>(blocks_done.data_ptr<int64_t>());
  return a;
}

}  // namespace cuda
}  // namespace apex_lite
