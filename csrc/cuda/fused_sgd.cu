// apex_lite::fused_sgd_ on CUDA: one SGD step (torch.optim.SGD, apex's FusedSGD) over lists of
// parameters, in one multi-tensor-apply pass per dtype combination.
//
// Contract (csrc/ops.cpp; apex_lite/multi_tensor/_python.py is the reference, bit for bit: every
// operation below is one correctly rounded fp32 operation on both sides):
//   g = float(grad) * inv_scale
//   g = g + weight_decay * p                          (weight_decay != 0, not wd_after_momentum)
//   momentum != 0:  buf = g                           (first_run; the old buffer is not read)
//                   buf = momentum * buf + (1 - dampening) * g      (otherwise)
//                   g = g + momentum * buf  (nesterov)  or  g = buf
//   g = g + weight_decay * p                          (weight_decay != 0, wd_after_momentum)
//   p = p - lr * g
// in fp32, each product rounded before it is added (no fused multiply-add), hyper-parameters
// converted from double to fp32 once on the host (1 - dampening computed in double first); p is
// the fp32 value of the parameter (fp32, or fp16/bf16 without master weights), stored rounded once
// to its dtype, and to the model parameter's dtype when model_params is given.
// Every block reads found_inf first and, when it is not 0, writes nothing. inv_scale and
// found_inf are read on the device only: no host synchronisation, current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "optimizer_step.cuh"

namespace apex_lite {
namespace cuda {
namespace {

struct SgdArgs {
  const float* found_inf;
  const float* inv_scale;
  float lr;
  float momentum;
  float dampening_complement;  // 1 - dampening, computed in double
  float weight_decay;
  bool decay_before_momentum;
  bool decay_after_momentum;
  bool nesterov;
  bool first_run;
};

struct SgdBlockScalars {
  float inv_scale;
  bool skip;
};

// Lists: params, grads, then momentum buffers (HasBuf), then model params (HasModel).
template <typename param_t, typename grad_t, typename model_t, bool HasBuf, bool HasModel>
struct SgdOp {
  static constexpr int kDepth = 2 + (HasBuf ? 1 : 0) + (HasModel ? 1 : 0);
  SgdArgs args;

  __device__ __forceinline__ void operator()(const ChunkRef<kDepth>& ref) const {
    const SgdBlockScalars block = share_from_thread0<SgdBlockScalars>([&] {
      SgdBlockScalars s;
      s.skip = skips(args.found_inf);
      s.inv_scale = *args.inv_scale;
      return s;
    });
    if (block.skip) {
      return;
    }
    param_t* param = static_cast<param_t*>(ref.base[0]) + ref.start;
    const grad_t* grad = static_cast<const grad_t*>(ref.base[1]) + ref.start;
    float* bufs = HasBuf ? static_cast<float*>(ref.base[2]) + ref.start : nullptr;
    model_t* model = HasModel ? static_cast<model_t*>(ref.base[kDepth - 1]) + ref.start : nullptr;
    const bool vectorised = ref.n % kILP == 0 && is_aligned<kILP>(param) &&
                            is_aligned<kILP>(grad) && (!HasBuf || is_aligned<kILP>(bufs)) &&
                            (!HasModel || is_aligned<kILP>(model));
    for_each_group(ref.n, vectorised, [&](int64_t i, auto width) {
      constexpr int N = decltype(width)::value;
      float p[N];
      float g[N];
      [[maybe_unused]] float buf[N] = {};  // momentum buffers (HasBuf)
      load_fp32<N>(param + i, p);
      load_fp32<N>(grad + i, g);
      if constexpr (HasBuf) {
        if (!args.first_run) {
          load_fp32<N>(bufs + i, buf);
        }
      }
#pragma unroll
      for (int k = 0; k < N; ++k) {
        float d = __fmul_rn(g[k], block.inv_scale);
        if (args.decay_before_momentum) {
          d = __fadd_rn(d, __fmul_rn(args.weight_decay, p[k]));
        }
        if constexpr (HasBuf) {
          buf[k] = args.first_run ? d
                                  : __fadd_rn(__fmul_rn(args.momentum, buf[k]),
                                              __fmul_rn(args.dampening_complement, d));
          d = args.nesterov ? __fadd_rn(d, __fmul_rn(args.momentum, buf[k])) : buf[k];
        }
        if (args.decay_after_momentum) {
          d = __fadd_rn(d, __fmul_rn(args.weight_decay, p[k]));
        }
        p[k] = __fsub_rn(p[k], __fmul_rn(args.lr, d));
      }
      if constexpr (HasBuf) {
        store_rounded<N>(bufs + i, buf);
      }
      store_rounded<N>(param + i, p);
      if constexpr (HasModel) {
        store_rounded<N>(model + i, p);
      }
    });
  }
};

template <bool HasBuf, bool HasModel>
void launch_sgd(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                at::TensorList model_params, const SgdArgs& args) {
  constexpr int kDepth = 2 + (HasBuf ? 1 : 0) + (HasModel ? 1 : 0);
  std::array<at::TensorList, kDepth> lists;
  lists[0] = params;
  lists[1] = grads;
  if constexpr (HasBuf) {
    lists[2] = momentum_buffers;
  }
  if constexpr (HasModel) {
    lists[kDepth - 1] = model_params;
  }
  for_each_dtype_group<HasModel>(lists, [&](const std::vector<int64_t>& indices, auto param_tag,
                                            auto grad_tag, auto model_tag) {
    using Op = SgdOp<typename decltype(param_tag)::type, typename decltype(grad_tag)::type,
                     typename decltype(model_tag)::type, HasBuf, HasModel>;
    static_assert(Op::kDepth == kDepth, "list layout");
    multi_tensor_apply<kDepth>(lists, indices, Op{args});
  });
}

void fused_sgd_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                    at::TensorList model_params, const at::Tensor& inv_scale,
                    const at::Tensor& found_inf, double lr, double momentum, double dampening,
                    double weight_decay, bool nesterov, bool wd_after_momentum, bool first_run) {
  const char* op = "fused_sgd_";
  check_step_args(op, params, grads, inv_scale, found_inf);
  const at::Device device = found_inf.device();
  const bool has_buf = momentum != 0.0;
  // As the Python backend, buffers passed with momentum == 0 are ignored.
  TORCH_CHECK(!has_buf || momentum_buffers.size() == params.size(), "apex_lite::", op,
              ": momentum is ", momentum, " but momentum_buffers has ", momentum_buffers.size(),
              " tensors for ", params.size(), " parameters; pass one buffer per parameter");
  if (has_buf) {
    check_state_list(op, "momentum_buffers", momentum_buffers, params, device);
  }
  check_model_params(op, model_params, params, device);
  if (params.empty()) {
    return;
  }
  const c10::cuda::CUDAGuard guard(device);

  SgdArgs args{};
  args.found_inf = found_inf.data_ptr<float>();
  args.inv_scale = inv_scale.data_ptr<float>();
  args.lr = static_cast<float>(lr);
  args.momentum = static_cast<float>(momentum);
  args.dampening_complement = static_cast<float>(1.0 - dampening);
  args.weight_decay = static_cast<float>(weight_decay);
  args.decay_before_momentum = weight_decay != 0.0 && !wd_after_momentum;
  args.decay_after_momentum = weight_decay != 0.0 && wd_after_momentum;
  args.nesterov = nesterov;
  args.first_run = first_run;

  const bool has_model = !model_params.empty();
  if (has_buf && has_model) {
    launch_sgd<true, true>(params, grads, momentum_buffers, model_params, args);
  } else if (has_buf) {
    launch_sgd<true, false>(params, grads, momentum_buffers, model_params, args);
  } else if (has_model) {
    launch_sgd<false, true>(params, grads, momentum_buffers, model_params, args);
  } else {
    launch_sgd<false, false>(params, grads, momentum_buffers, model_params, args);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace apex_lite

TORCH_LIBRARY_IMPL(apex_lite, CUDA, m) {
  m.impl("fused_sgd_", &apex_lite::cuda::fused_sgd_cuda);
}
