// apex_lite::scale_ and apex_lite::scale_out on CUDA: out = in * scale, flagging non-finite input.
//
// Contract (the Python backend is the reference, bit for bit): out = round_to_out(float(in) *
// float(scale)), with scale converted from double to float once, on the host; a scale of exactly
// 1 copies the widened value unchanged. found_inf (1-element fp32) is set to 1.0f when an input
// element is inf or NaN and never written otherwise. No host synchronisation. Arguments are
// checked as ../multi_tensor_checks.h says (outputs that share memory with another tensor of the
// call are refused) before anything is launched; tensors are contiguous.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "multi_tensor_apply.cuh"

namespace apex_lite {
namespace cuda {
namespace {

// Depth 1: in place (list 0 is read and written); Depth 2: list 0 read, list 1 written.
template <typename in_t, typename out_t, int Depth>
struct ScaleOp {
  float scale;
  float* found_inf;

  __device__ __forceinline__ void operator()(const ChunkRef<Depth>& ref) const {
    const in_t* in = static_cast<const in_t*>(ref.base[0]) + ref.start;
    out_t* out = static_cast<out_t*>(ref.base[Depth - 1]) + ref.start;
    const bool vectorised =
        ref.n % kILP == 0 && is_aligned<kILP>(in) && is_aligned<kILP>(out);
    bool nonfinite = false;
    for_each_group(ref.n, vectorised, [&](int64_t i, auto width) {
      constexpr int N = decltype(width)::value;
      float v[N];
      load_fp32<N>(in + i, v);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        nonfinite |= is_nonfinite(v[k]);
        v[k] = scaled(v[k], scale);
      }
      store_rounded<N>(out + i, v);
    });
    if (nonfinite) {
      *found_inf = 1.0f;
    }
  }
};

void scale_inplace_cuda(at::TensorList tensors, double scale, const at::Tensor& found_inf) {
  checks::check_scale_(tensors, found_inf);
  check_contiguous("scale_", "tensors", tensors);
  const c10::cuda::CUDAGuard guard(found_inf.device());
  const float scale_fp32 = static_cast<float>(scale);
  float* found_inf_ptr = found_inf.data_ptr<float>();
  const std::array<at::TensorList, 1> lists{tensors};
  for (const auto& group : group_by_dtypes<1>(lists)) {
    dispatch_dtype(group.dtypes[0], [&](auto tag) {
      using T = typename decltype(tag)::type;
      multi_tensor_apply<1>(lists, group.indices, ScaleOp<T, T, 1>{scale_fp32, found_inf_ptr});
    });
  }
}

void scale_out_cuda(at::TensorList inputs, at::TensorList outputs, double scale,
                    const at::Tensor& found_inf) {
  checks::check_scale_out(inputs, outputs, found_inf);
  check_contiguous("scale_out", "inputs", inputs);
  check_contiguous("scale_out", "outputs", outputs);
  const c10::cuda::CUDAGuard guard(found_inf.device());
  const float scale_fp32 = static_cast<float>(scale);
  float* found_inf_ptr = found_inf.data_ptr<float>();
  const std::array<at::TensorList, 2> lists{inputs, outputs};
  for (const auto& group : group_by_dtypes<2>(lists)) {
    dispatch_dtype(group.dtypes[0], [&](auto in_tag) {
      dispatch_dtype(group.dtypes[1], [&](auto out_tag) {
        using in_t = typename decltype(in_tag)::type;
        using out_t = typename decltype(out_tag)::type;
        multi_tensor_apply<2>(lists, group.indices,
                              ScaleOp<in_t, out_t, 2>{scale_fp32, found_inf_ptr});
      });
    });
  }
}

}  // namespace
}  // namespace cuda
}  // namespace apex_lite

TORCH_LIBRARY_IMPL(apex_lite, CUDA, m) {
  m.impl("scale_", &apex_lite::cuda::scale_inplace_cuda);
  m.impl("scale_out", &apex_lite::cuda::scale_out_cuda);
}
