// apex_lite::fused_adagrad_ on CUDA: one Adagrad step (apex's FusedAdagrad) over lists of
// parameters.
//
// Contract: csrc/ops.cpp; the per-element arithmetic is csrc/cpu/fused_adagrad.cpp's, each fp32
// operation correctly rounded (__f*_rn: no fused multiply-add, whatever -fmad says):
//   g = float(grad) * inv_scale
//   g = g + weight_decay * p                  (weight_decay != 0, not adagrad_w_mode)
//   h = h + g * g
//   u = g / (sqrt(h) + eps)
//   u = u + weight_decay * p                  (weight_decay != 0, adagrad_w_mode)
//   p = p - lr * u
// One multi-tensor-apply launch per dtype group; the last block of each parameter increments its
// step count (optimizer_step.cuh), and one more launch counts the empty parameters. Every block
// reads found_inf first and, when it is not 0, writes nothing. No host synchronisation.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "optimizer_step.cuh"

namespace apex_lite {
namespace cuda {
namespace {

// List order: params, grads, sums, steps (1-element tensors), then model params when present.
constexpr int kAdagradSteps = 3;

struct AdagradArgs {
  const float* found_inf;
  const float* inv_scale;
  float lr;
  float eps;
  float weight_decay;
  bool decay_grad;    // weight_decay != 0 and not adagrad_w_mode
  bool decay_update;  // weight_decay != 0 and adagrad_w_mode
  unsigned long long* blocks_done;
};

struct AdagradBlockScalars {
  float inv_scale;
  float step;
  bool skip;
};

template <typename param_t, typename grad_t, typename model_t, bool HasModel>
struct AdagradOp {
  static constexpr int kDepth = HasModel ? 5 : 4;
  AdagradArgs args;

  __device__ __forceinline__ void operator()(const ChunkRef<kDepth>& ref) const {
    float* step = static_cast<float*>(ref.base[kAdagradSteps]);
    const AdagradBlockScalars block = share_from_thread0<AdagradBlockScalars>([&] {
      AdagradBlockScalars s{};
      s.skip = skips(args.found_inf);
      if (!s.skip) {
        s.inv_scale = *args.inv_scale;
        s.step = *step;
      }
      return s;
    });
    if (block.skip) {
      return;
    }
    param_t* param = static_cast<param_t*>(ref.base[0]) + ref.start;
    const grad_t* grad = static_cast<const grad_t*>(ref.base[1]) + ref.start;
    float* sum = static_cast<float*>(ref.base[2]) + ref.start;
    model_t* model = HasModel ? static_cast<model_t*>(ref.base[kDepth - 1]) + ref.start : nullptr;
    const bool vectorised = ref.n % kILP == 0 && is_aligned<kILP>(param) &&
                            is_aligned<kILP>(grad) && is_aligned<kILP>(sum) &&
                            (!HasModel || is_aligned<kILP>(model));
    const AdagradArgs& a = args;
    for_each_group(ref.n, vectorised, [&](int64_t i, auto width) {
      constexpr int N = decltype(width)::value;
      float p[N];
      float g[N];
      float h[N];
      load_fp32<N>(param + i, p);
      load_fp32<N>(grad + i, g);
      load_fp32<N>(sum + i, h);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        float gk = __fmul_rn(g[k], block.inv_scale);
        if (a.decay_grad) {
          gk = __fadd_rn(gk, __fmul_rn(a.weight_decay, p[k]));
        }
        h[k] = __fadd_rn(h[k], __fmul_rn(gk, gk));
        float update = __fdiv_rn(gk, __fadd_rn(__fsqrt_rn(h[k]), a.eps));
        if (a.decay_update) {
          update = __fadd_rn(update, __fmul_rn(a.weight_decay, p[k]));
        }
        p[k] = __fsub_rn(p[k], __fmul_rn(a.lr, update));
      }
      store_rounded<N>(sum + i, h);
      store_rounded<N>(param + i, p);
      if constexpr (HasModel) {
        store_rounded<N>(model + i, p);
      }
    });
    if (threadIdx.x == 0) {
      count_block_and_increment_step(a.blocks_done, ref.tensor_id, ref.numel, step, block.step);
    }
  }
};

template <bool HasModel>
void launch_adagrad(at::TensorList params, at::TensorList grads, at::TensorList sums,
                    at::TensorList steps, at::TensorList model_params, const AdagradArgs& args) {
  constexpr int kDepth = HasModel ? 5 : 4;
  std::array<at::TensorList, kDepth> lists;
  lists[0] = params;
  lists[1] = grads;
  lists[2] = sums;
  lists[kAdagradSteps] = steps;
  if constexpr (HasModel) {
    lists[4] = model_params;
  }
  for_each_dtype_group<HasModel>(lists, [&](const std::vector<int64_t>& indices, auto param_tag,
                                            auto grad_tag, auto model_tag) {
    using Op = AdagradOp<typename decltype(param_tag)::type, typename decltype(grad_tag)::type,
                         typename decltype(model_tag)::type, HasModel>;
    multi_tensor_apply<kDepth>(lists, indices, Op{args});
  });
}

void fused_adagrad_cuda(at::TensorList params, at::TensorList grads, at::TensorList sums,
                        at::TensorList model_params, at::TensorList steps,
                        const at::Tensor& inv_scale, const at::Tensor& found_inf, double lr,
                        double eps, double weight_decay, bool adagrad_w_mode) {
  const char* op = "fused_adagrad_";
  check_step_args(op, params, grads, inv_scale, found_inf);
  const at::Device device = found_inf.device();
  check_state_list(op, "sums", sums, params, device);
  check_model_params(op, model_params, params, device);
  check_steps(op, steps, params, device);
  if (params.empty()) {
    return;
  }
  const c10::cuda::CUDAGuard guard(device);
  const int64_t n = static_cast<int64_t>(params.size());
  TORCH_CHECK(n <= INT32_MAX, "apex_lite::", op, ": at most 2**31 - 1 parameters per call");
  const at::Tensor blocks_done =
      at::zeros({n}, at::TensorOptions().dtype(at::kLong).device(device));
  static_assert(sizeof(int64_t) == sizeof(unsigned long long), "counters are 64-bit");

  AdagradArgs args{};
  args.found_inf = found_inf.data_ptr<float>();
  args.inv_scale = inv_scale.data_ptr<float>();
  args.lr = static_cast<float>(lr);
  args.eps = static_cast<float>(eps);
  args.weight_decay = static_cast<float>(weight_decay);
  args.decay_grad = weight_decay != 0.0 && !adagrad_w_mode;
  args.decay_update = weight_decay != 0.0 && adagrad_w_mode;
  args.blocks_done = reinterpret_cast<unsigned long long*>(blocks_done.data_ptr<int64_t>());

  if (model_params.empty()) {
    launch_adagrad<false>(params, grads, sums, steps, model_params, args);
  } else {
    launch_adagrad<true>(params, grads, sums, steps, model_params, args);
  }
  increment_steps_of_empty_params(params, steps, found_inf);
}

}  // namespace
}  // namespace cuda
}  // namespace apex_lite

TORCH_LIBRARY_IMPL(apex_lite, CUDA, m) {
  m.impl("fused_adagrad_", &apex_lite::cuda::fused_adagrad_cuda);
}
