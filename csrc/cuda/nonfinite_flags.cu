// apex_lite::nonfinite_flags on CUDA: bool [n], True where tensors[i] holds an inf or NaN.
//
// The output is zeroed, then every block that finds a non-finite element in its chunk writes True
// for its tensor (only True is ever written, so blocks of one tensor need no coordination). Empty
// tensors are finite. One pass of multi-tensor-apply on the current stream, no host
// synchronisation.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "multi_tensor_apply.cuh"

namespace apex_lite {
namespace cuda {
namespace {

template <typename in_t>
struct NonfiniteFlagOp {
  bool* flags;  // [n tensors]

  __device__ __forceinline__ void operator()(const ChunkRef<1>& ref) const {
    const in_t* in = static_cast<const in_t*>(ref.base[0]) + ref.start;
    const bool vectorised = ref.n % kILP == 0 && is_aligned<kILP>(in);
    bool nonfinite = false;
    for_each_group(ref.n, vectorised, [&](int64_t i, auto width) {
      constexpr int N = decltype(width)::value;
      float v[N];
      load_fp32<N>(in + i, v);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        nonfinite |= is_nonfinite(v[k]);
      }
    });
    // Every thread reaches this barrier: the loop above has no early exit.
    if (__syncthreads_or(nonfinite) && threadIdx.x == 0) {
      flags[ref.tensor_id] = true;
    }
  }
};

at::Tensor nonfinite_flags_cuda(at::TensorList tensors) {
  TORCH_CHECK(!tensors.empty(),
              "apex_lite::nonfinite_flags: the CUDA kernel needs at least one tensor");
  checks::check_reduction(tensors);
  check_contiguous("nonfinite_flags", "tensors", tensors);
  const at::Device device = tensors[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const int64_t n = static_cast<int64_t>(tensors.size());
  TORCH_CHECK(n <= INT32_MAX, "apex_lite::nonfinite_flags: at most 2**31 - 1 tensors per call");

  at::Tensor flags = at::zeros({n}, at::TensorOptions().dtype(at::kBool).device(device));
  bool* flags_ptr = flags.data_ptr<bool>();
  const std::array<at::TensorList, 1> lists{tensors};
  for (const auto& group : group_by_dtypes<1>(lists)) {
    dispatch_dtype(group.dtypes[0], [&](auto tag) {
      using T = typename decltype(tag)::type;
      multi_tensor_apply<1>(lists, group.indices, NonfiniteFlagOp<T>{flags_ptr});
    });
  }
  return flags;
}

}  // namespace
}  // namespace cuda
}  // namespace apex_lite

TORCH_LIBRARY_IMPL(apex_lite, CUDA, m) {
  m.impl("nonfinite_flags", &apex_lite::cuda::nonfinite_flags_cuda);
}
