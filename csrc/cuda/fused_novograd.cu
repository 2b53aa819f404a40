// apex_lite::fused_novograd_ on CUDA: one NovoGrad step (apex's FusedNovoGrad) over lists of
// parameters.
//
// Contract: csrc/ops.cpp; the arithmetic is csrc/cpu/fused_novograd.cpp's (each fp32 operation
// correctly rounded, __f*_rn: no fused multiply-add). Three launches on the current stream, no
// scratch the size of the parameters:
// 1. (multi-tensor-apply over the gradients) each block writes the fp32 sum of the squares (or
//    the largest magnitude, norm_type 0, by fmaxf as apex: NaN elements passed over, as the CPU
//    kernel and the Python backend pass them) of the true gradients of its chunk to
//    partials[global block]; the block of a tensor's first chunk records where the tensor's run
//    of partials starts;
// 2. (one block per parameter, over the 1-element lists exp_avg_sqs and steps) the run combined
//    in a fixed order into the norm n, the second moment v blended (v = n on a count-0 parameter
//    without init_zero) and stored, the bias corrections computed in double from the step count,
//    which is then incremented, and the parameter's denom = v * r2 + eps and r1 stored in a
//    [2, n] scratch;
// 3. (multi-tensor-apply over params, grads, exp_avgs, model params) the elementwise update.
// Every kernel reads found_inf first and, when it is not 0, writes nothing. inv_scale, found_inf
// and the step counts are read on the device only: no host synchronisation. The L2 norms are
// accumulated in an order of their own, so they (and through them p) can differ from the Python
// backend's in the last bits; the inf norm is exact.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "optimizer_step.cuh"

namespace apex_lite {
namespace cuda {
namespace {

struct NovoGradArgs {
  const float* found_inf;
  const float* inv_scale;
  float lr;
  float beta1;
  float beta3;
  float beta2;
  float one_minus_beta2;  // computed in double
  float eps;
  float weight_decay;
  double beta1_double;
  double beta2_double;
  bool bias_correction;
  bool decay;
  bool reg_inside_moment;
  bool inf_norm;
  bool init_zero;
  float* partials;         // [total chunks]
  int64_t* first_partial;  // [num_tensors]
  int64_t* partial_count;  // [num_tensors]
  float* scalars;          // [2][num_tensors]: denom, then r1
  int64_t num_tensors;
};

struct NormBlockScalars {
  float inv_scale;
  bool skip;
};

// The largest value of the block (every thread must call it).
__device__ __forceinline__ float block_max(float v) {
  __shared__ float warp_max[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, offset));
  }
  if (lane == 0) {
    warp_max[warp] = v;
  }
  __syncthreads();
  if (warp == 0) {
    const int num_warps = static_cast<int>(blockDim.x / 32);
    v = lane < num_warps ? warp_max[lane] : 0.0f;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, offset));
    }
  }
  return v;
}

// Stage 1: the partial norm of one chunk of one gradient.
template <typename grad_t>
struct NovoGradNormOp {
  NovoGradArgs args;

  __device__ __forceinline__ void operator()(const ChunkRef<1>& ref) const {
    const NormBlockScalars block = share_from_thread0<NormBlockScalars>([&] {
      NormBlockScalars s{};
      s.skip = skips(args.found_inf);
      if (!s.skip) {
        s.inv_scale = *args.inv_scale;
      }
      return s;
    });
    if (block.skip) {
      return;
    }
    const grad_t* grad = static_cast<const grad_t*>(ref.base[0]) + ref.start;
    const bool vectorised = ref.n % kILP == 0 && is_aligned<kILP>(grad);
    float acc = 0.0f;
    for_each_group(ref.n, vectorised, [&](int64_t i, auto width) {
      constexpr int N = decltype(width)::value;
      float g[N];
      load_fp32<N>(grad + i, g);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float t = __fmul_rn(g[k], block.inv_scale);
        acc = args.inf_norm ? fmaxf(acc, fabsf(t)) : __fadd_rn(acc, __fmul_rn(t, t));
      }
    });
    // Every thread reaches the barriers: the loop above has no early exit.
    const float total = args.inf_norm ? block_max(acc) : block_sum(acc);
    if (threadIdx.x == 0) {
      args.partials[ref.global_block] = total;
      if (ref.chunk == 0) {
        args.first_partial[ref.tensor_id] = ref.global_block;
        args.partial_count[ref.tensor_id] = num_chunks(ref.numel);
      }
    }
  }
};

// Stage 2: one block per parameter (lists: exp_avg_sqs, steps; both 1-element tensors).
struct NovoGradScalarsOp {
  NovoGradArgs args;

  __device__ __forceinline__ void operator()(const ChunkRef<2>& ref) const {
    const bool skip = share_from_thread0<bool>([&] { return skips(args.found_inf); });
    if (skip) {
      return;
    }
    const int64_t first = args.first_partial[ref.tensor_id];
    const int64_t count = args.partial_count[ref.tensor_id];
    float acc = 0.0f;
    for (int64_t j = threadIdx.x; j < count; j += blockDim.x) {
      const float part = args.partials[first + j];
      acc = args.inf_norm ? fmaxf(acc, part) : __fadd_rn(acc, part);
    }
    const float total = args.inf_norm ? block_max(acc) : block_sum(acc);
    if (threadIdx.x != 0) {
      return;
    }
    const float norm = args.inf_norm ? total : __fsqrt_rn(total);
    float* v_ptr = static_cast<float*>(ref.base[0]);
    float* step_ptr = static_cast<float*>(ref.base[1]);
    const float v_old = *v_ptr;
    const float step = *step_ptr;
    float v;
    if (step == 0.0f && !args.init_zero) {
      v = norm;
    } else if (args.inf_norm) {
      v = __fadd_rn(__fmul_rn(args.beta2, v_old), __fmul_rn(args.one_minus_beta2, norm));
    } else {
      v = __fsqrt_rn(__fadd_rn(__fmul_rn(args.beta2, __fmul_rn(v_old, v_old)),
                               __fmul_rn(args.one_minus_beta2, __fmul_rn(norm, norm))));
    }
    float r1 = 1.0f;
    float r2 = 1.0f;
    if (args.bias_correction) {
      const double next = static_cast<double>(step) + 1.0;
      r1 = static_cast<float>(1.0 / (1.0 - pow(args.beta1_double, next)));
      r2 = static_cast<float>(1.0 / sqrt(1.0 - pow(args.beta2_double, next)));
    }
    *v_ptr = v;
    *step_ptr = __fadd_rn(step, 1.0f);
    args.scalars[ref.tensor_id] = __fadd_rn(__fmul_rn(v, r2), args.eps);
    args.scalars[args.num_tensors + ref.tensor_id] = r1;
  }
};

struct StepBlockScalars {
  float inv_scale;
  float denom;
  float r1;
  bool skip;
};

// Stage 3: the elementwise update of one chunk (lists: params, grads, exp_avgs[, models]).
template <typename param_t, typename grad_t, typename model_t, bool HasModel>
struct NovoGradStepOp {
  static constexpr int kDepth = HasModel ? 4 : 3;
  NovoGradArgs args;

  __device__ __forceinline__ void operator()(const ChunkRef<kDepth>& ref) const {
    const StepBlockScalars block = share_from_thread0<StepBlockScalars>([&] {
      StepBlockScalars s{};
      s.skip = skips(args.found_inf);
      if (!s.skip) {
        s.inv_scale = *args.inv_scale;
        s.denom = args.scalars[ref.tensor_id];
        s.r1 = args.scalars[args.num_tensors + ref.tensor_id];
      }
      return s;
    });
    if (block.skip) {
      return;
    }
    param_t* param = static_cast<param_t*>(ref.base[0]) + ref.start;
    const grad_t* grad = static_cast<const grad_t*>(ref.base[1]) + ref.start;
    float* exp_avg = static_cast<float*>(ref.base[2]) + ref.start;
    model_t* model = HasModel ? static_cast<model_t*>(ref.base[kDepth - 1]) + ref.start : nullptr;
    const bool vectorised = ref.n % kILP == 0 && is_aligned<kILP>(param) &&
                            is_aligned<kILP>(grad) && is_aligned<kILP>(exp_avg) &&
                            (!HasModel || is_aligned<kILP>(model));
    const NovoGradArgs& a = args;
    for_each_group(ref.n, vectorised, [&](int64_t i, auto width) {
      constexpr int N = decltype(width)::value;
      float p[N];
      float g[N];
      float m[N];
      load_fp32<N>(param + i, p);
      load_fp32<N>(grad + i, g);
      load_fp32<N>(exp_avg + i, m);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        float gk = __fmul_rn(g[k], block.inv_scale);
        if (a.reg_inside_moment) {
          gk = __fdiv_rn(gk, block.denom);
          if (a.decay) {
            gk = __fadd_rn(gk, __fmul_rn(a.weight_decay, p[k]));
          }
        }
        m[k] = __fadd_rn(__fmul_rn(a.beta1, m[k]), __fmul_rn(a.beta3, gk));
        float update = __fmul_rn(m[k], block.r1);
        if (!a.reg_inside_moment) {
          update = __fdiv_rn(update, block.denom);
          if (a.decay) {
            update = __fadd_rn(update, __fmul_rn(a.weight_decay, p[k]));
          }
        }
        p[k] = __fsub_rn(p[k], __fmul_rn(a.lr, update));
      }
      store_rounded<N>(exp_avg + i, m);
      store_rounded<N>(param + i, p);
      if constexpr (HasModel) {
        store_rounded<N>(model + i, p);
      }
    });
  }
};

template <bool HasModel>
void launch_novograd_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList model_params, const NovoGradArgs& args) {
  constexpr int kDepth = HasModel ? 4 : 3;
  std::array<at::TensorList, kDepth> lists;
  lists[0] = params;
  lists[1] = grads;
  lists[2] = exp_avgs;
  if constexpr (HasModel) {
    lists[3] = model_params;
  }
  for_each_dtype_group<HasModel>(lists, [&](const std::vector<int64_t>& indices, auto param_tag,
                                            auto grad_tag, auto model_tag) {
    using Op = NovoGradStepOp<typename decltype(param_tag)::type,
                              typename decltype(grad_tag)::type,
                              typename decltype(model_tag)::type, HasModel>;
    multi_tensor_apply<kDepth>(lists, indices, Op{args});
  });
}

// exp_avg_sqs: one 1-element float32 tensor per parameter on the device.
void check_moment_scalars(const char* op, at::TensorList exp_avg_sqs, at::TensorList params,
                          const at::Device& device) {
  TORCH_CHECK(exp_avg_sqs.size() == params.size(), "apex_lite::", op, ": exp_avg_sqs has ",
              exp_avg_sqs.size(), " tensors but params has ", params.size(),
              "; pass one 1-element second moment per parameter");
  for (size_t i = 0; i < exp_avg_sqs.size(); ++i) {
    const at::Tensor& v = exp_avg_sqs[i];
    TORCH_CHECK(v.defined() && v.device() == device && v.scalar_type() == at::kFloat &&
                    v.numel() == 1,
                "apex_lite::", op, ": exp_avg_sqs[", i,
                "] must be a 1-element float32 tensor on ", device,
                " (the parameter's second moment, a norm)");
  }
}

void fused_novograd_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList model_params,
                         at::TensorList steps, const at::Tensor& inv_scale,
                         const at::Tensor& found_inf, double lr, double beta1, double beta2,
                         double eps, double weight_decay, bool bias_correction,
                         bool grad_averaging, bool reg_inside_moment, int64_t norm_type,
                         bool init_zero) {
  const char* op = "fused_novograd_";
  TORCH_CHECK(norm_type == 0 || norm_type == 2, "apex_lite::", op, ": norm_type is ", norm_type,
              "; NovoGrad's norms are 2 (L2) and 0 (the inf norm)");
  check_step_args(op, params, grads, inv_scale, found_inf);
  const at::Device device = found_inf.device();
  check_state_list(op, "exp_avgs", exp_avgs, params, device);
  check_moment_scalars(op, exp_avg_sqs, params, device);
  check_model_params(op, model_params, params, device);
  check_steps(op, steps, params, device);
  if (params.empty()) {
    return;
  }
  const c10::cuda::CUDAGuard guard(device);
  const int64_t n = static_cast<int64_t>(params.size());
  TORCH_CHECK(n <= INT32_MAX, "apex_lite::", op, ": at most 2**31 - 1 parameters per call");

  NovoGradArgs args{};
  args.found_inf = found_inf.data_ptr<float>();
  args.inv_scale = inv_scale.data_ptr<float>();
  args.lr = static_cast<float>(lr);
  args.beta1 = static_cast<float>(beta1);
  args.beta3 = static_cast<float>(grad_averaging ? 1.0 - beta1 : 1.0);
  args.beta2 = static_cast<float>(beta2);
  args.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  args.eps = static_cast<float>(eps);
  args.weight_decay = static_cast<float>(weight_decay);
  args.beta1_double = beta1;
  args.beta2_double = beta2;
  args.bias_correction = bias_correction;
  args.decay = weight_decay != 0.0;
  args.reg_inside_moment = reg_inside_moment;
  args.inf_norm = norm_type == 0;
  args.init_zero = init_zero;

  int64_t total_chunks = 0;
  for (const at::Tensor& p : params) {
    total_chunks += num_chunks(p.numel());
  }
  // Rows: each tensor's first partial and partial count (zero for tensors without chunks).
  const at::Tensor counters =
      at::zeros({2, n}, at::TensorOptions().dtype(at::kLong).device(device));
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const at::Tensor partials = at::empty({total_chunks > 0 ? total_chunks : 1}, fp32);
  const at::Tensor scalars = at::empty({2, n}, fp32);
  args.partials = partials.data_ptr<float>();
  args.first_partial = counters.data_ptr<int64_t>();
  args.partial_count = counters.data_ptr<int64_t>() + n;
  args.scalars = scalars.data_ptr<float>();
  args.num_tensors = n;

  // Stage 1, one launch group per gradient dtype, blocks numbered across them.
  int64_t blocks = 0;
  const std::array<at::TensorList, 1> grad_list{grads};
  for (const auto& group : group_by_dtypes<1>(grad_list)) {
    dispatch_dtype(group.dtypes[0], [&](auto grad_tag) {
      using Op = NovoGradNormOp<typename decltype(grad_tag)::type>;
      blocks += multi_tensor_apply<1>(grad_list, group.indices, Op{args}, blocks);
    });
  }
  TORCH_CHECK(blocks == total_chunks, "apex_lite::", op, ": internal error, launched ", blocks,
              " blocks for ", total_chunks, " chunks");

  // Stage 2: every parameter, empty ones included.
  std::vector<int64_t> all(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    all[static_cast<size_t>(i)] = i;
  }
  multi_tensor_apply<2>(std::array<at::TensorList, 2>{exp_avg_sqs, steps}, all,
                        NovoGradScalarsOp{args});

  // Stage 3.
  if (model_params.empty()) {
    launch_novograd_step<false>(params, grads, exp_avgs, model_params, args);
  } else {
    launch_novograd_step<true>(params, grads, exp_avgs, model_params, args);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace apex_lite

TORCH_LIBRARY_IMPL(apex_lite, CUDA, m) {
  m.impl("fused_novograd_", &apex_lite::cuda::fused_novograd_cuda);
}
