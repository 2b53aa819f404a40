// apex_lite::axpby_ and apex_lite::axpby_out on CUDA: out = a * x + b * y, flagging non-finite x
// and y.
//
// Contract (the Python backend is the reference, bit for bit): out = round_to_out(float(a) *
// float(x) + float(b) * float(y)): the two products each rounded to fp32, then one rounded fp32
// sum, never a fused multiply-add (__fmul_rn / __fadd_rn, whatever -fmad says); a factor of
// exactly 1 leaves its operand unchanged, as torch's unscale kernel does. a and b are converted
// from double to float once, on the host. found_inf (1-element fp32) is set to 1.0f when an
// element of x or y is inf or NaN and never written otherwise. No host synchronisation. Arguments
// are checked as ../multi_tensor_checks.h says (outputs that share memory with another tensor of
// the call are refused) before anything is launched; tensors are contiguous.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "multi_tensor_apply.cuh"

namespace apex_lite {
namespace cuda {
namespace {

// Lists: x, y, and for Depth 3 the output; for Depth 2 the result is written over y.
template <typename x_t, typename y_t, typename out_t, int Depth>
struct AxpbyOp {
  float a;
  float b;
  float* found_inf;

  __device__ __forceinline__ void operator()(const ChunkRef<Depth>& ref) const {
    const x_t* x = static_cast<const x_t*>(ref.base[0]) + ref.start;
    const y_t* y = static_cast<const y_t*>(ref.base[1]) + ref.start;
    out_t* out = static_cast<out_t*>(ref.base[Depth - 1]) + ref.start;
    const bool vectorised = ref.n % kILP == 0 && is_aligned<kILP>(x) && is_aligned<kILP>(y) &&
                            is_aligned<kILP>(out);
    bool nonfinite = false;
    for_each_group(ref.n, vectorised, [&](int64_t i, auto width) {
      constexpr int N = decltype(width)::value;
      float vx[N];
      float vy[N];
      load_fp32<N>(x + i, vx);
      load_fp32<N>(y + i, vy);
      float result[N];
#pragma unroll
      for (int k = 0; k < N; ++k) {
        nonfinite |= is_nonfinite(vx[k]) || is_nonfinite(vy[k]);
        result[k] = __fadd_rn(scaled(vx[k], a), scaled(vy[k], b));
      }
      store_rounded<N>(out + i, result);
    });
    if (nonfinite) {
      *found_inf = 1.0f;
    }
  }
};

void axpby_inplace_cuda(at::TensorList xs, at::TensorList ys, double a, double b,
                        const at::Tensor& found_inf) {
  checks::check_axpby_(xs, ys, found_inf);
  check_contiguous("axpby_", "xs", xs);
  check_contiguous("axpby_", "ys", ys);
  const c10::cuda::CUDAGuard guard(found_inf.device());
  const float a_fp32 = static_cast<float>(a);
  const float b_fp32 = static_cast<float>(b);
  float* found_inf_ptr = found_inf.data_ptr<float>();
  const std::array<at::TensorList, 2> lists{xs, ys};
  for (const auto& group : group_by_dtypes<2>(lists)) {
    dispatch_dtype(group.dtypes[0], [&](auto x_tag) {
      dispatch_dtype(group.dtypes[1], [&](auto y_tag) {
        using x_t = typename decltype(x_tag)::type;
        using y_t = typename decltype(y_tag)::type;
        multi_tensor_apply<2>(lists, group.indices,
                              AxpbyOp<x_t, y_t, y_t, 2>{a_fp32, b_fp32, found_inf_ptr});
      });
    });
  }
}

void axpby_out_cuda(at::TensorList xs, at::TensorList ys, at::TensorList outputs, double a,
                    double b, const at::Tensor& found_inf) {
  checks::check_axpby_out(xs, ys, outputs, found_inf);
  check_contiguous("axpby_out", "xs", xs);
  check_contiguous("axpby_out", "ys", ys);
  check_contiguous("axpby_out", "outputs", outputs);
  const c10::cuda::CUDAGuard guard(found_inf.device());
  const float a_fp32 = static_cast<float>(a);
  const float b_fp32 = static_cast<float>(b);
  float* found_inf_ptr = found_inf.data_ptr<float>();
  const std::array<at::TensorList, 3> lists{xs, ys, outputs};
  for (const auto& group : group_by_dtypes<3>(lists)) {
    dispatch_dtype(group.dtypes[0], [&](auto x_tag) {
      dispatch_dtype(group.dtypes[1], [&](auto y_tag) {
        dispatch_dtype(group.dtypes[2], [&](auto out_tag) {
          using x_t = typename decltype(x_tag)::type;
          using y_t = typename decltype(y_tag)::type;
          using out_t = typename decltype(out_tag)::type;
          multi_tensor_apply<3>(lists, group.indices,
                                AxpbyOp<x_t, y_t, out_t, 3>{a_fp32, b_fp32, found_inf_ptr});
        });
      });
    });
  }
}

}  // namespace
}  // namespace cuda
}  // namespace apex_lite

TORCH_LIBRARY_IMPL(apex_lite, CUDA, m) {
  m.impl("axpby_", &apex_lite::cuda::axpby_inplace_cuda);
  m.impl("axpby_out", &apex_lite::cuda::axpby_out_cuda);
}
