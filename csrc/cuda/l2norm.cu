// apex_lite::l2norm on CUDA: the L2 norm of all elements of a list of tensors, and optionally of
// each tensor, accumulated in fp32. Returns (total fp32 [1], per-tensor fp32 [n] or [0]).
//
// Three kernels on the current stream, no host synchronisation, deterministic for given inputs:
// 1. multi-tensor-apply: each block writes the fp32 sum of squares of its chunk to
//    partials[global block] (each thread's squares accumulated with fmaf, one rounding per term:
//    the exception to multi_tensor_apply.cuh's no-FMA rule, since norms agree with the other
//    backends within fp32 rounding, not bit for bit; then a block reduction in a fixed order),
//    and the block of a tensor's first chunk records where the tensor's run of partials starts
//    and how long it is (a tensor's chunks have consecutive global block numbers, launch_plan.h);
// 2. one block sums all partials in a fixed order and writes sqrt(sum) to total;
// 3. with per_tensor, one block per tensor sums that tensor's run of partials and writes its sqrt
//    (0 for an empty tensor).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "multi_tensor_apply.cuh"

namespace apex_lite {
namespace cuda {
namespace {

constexpr int kReduceBlockSize = 512;

template <typename in_t>
struct SumOfSquaresOp {
  float* partials;             // [total chunks]
  int64_t* first_partial;      // [n tensors]
  int64_t* partial_count;      // [n tensors], zero for a tensor without chunks

  __device__ __forceinline__ void operator()(const ChunkRef<1>& ref) const {
    const in_t* in = static_cast<const in_t*>(ref.base[0]) + ref.start;
    const bool vectorised = ref.n % kILP == 0 && is_aligned<kILP>(in);
    float sum = 0.0f;
    for_each_group(ref.n, vectorised, [&](int64_t i, auto width) {
      constexpr int N = decltype(width)::value;
      float v[N];
      load_fp32<N>(in + i, v);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        sum = fmaf(v[k], v[k], sum);
      }
    });
    sum = block_sum(sum);
    if (threadIdx.x == 0) {
      partials[ref.global_block] = sum;
      if (ref.chunk == 0) {
        first_partial[ref.tensor_id] = ref.global_block;
        partial_count[ref.tensor_id] = num_chunks(ref.numel);
      }
    }
  }
};

// sqrt of the sum of partials[first, first + count), computed by one block in a fixed order.
__device__ __forceinline__ float block_norm(const float* partials, int64_t first, int64_t count) {
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < count; j += blockDim.x) {
    sum = __fadd_rn(sum, partials[first + j]);
  }
  return sqrtf(block_sum(sum));
}

__global__ void __launch_bounds__(kReduceBlockSize)
    total_norm_kernel(const float* partials, int64_t count, float* total) {
  const float norm = block_norm(partials, 0, count);
  if (threadIdx.x == 0) {
    *total = norm;
  }
}

__global__ void __launch_bounds__(kReduceBlockSize)
    per_tensor_norm_kernel(const float* partials, const int64_t* first_partial,
                           const int64_t* partial_count, float* norms) {
  const int64_t tensor = blockIdx.x;
  const float norm = block_norm(partials, first_partial[tensor], partial_count[tensor]);
  if (threadIdx.x == 0) {
    norms[tensor] = norm;
  }
}

std::tuple<at::Tensor, at::Tensor> l2norm_cuda(at::TensorList tensors, bool per_tensor) {
  TORCH_CHECK(!tensors.empty(), "apex_lite::l2norm: the CUDA kernel needs at least one tensor");
  checks::check_reduction(tensors);
  check_contiguous("l2norm", "tensors", tensors);
  const at::Device device = tensors[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const int64_t n = static_cast<int64_t>(tensors.size());
  TORCH_CHECK(n <= INT32_MAX, "apex_lite::l2norm: at most 2**31 - 1 tensors per call");

  at::Tensor total = at::zeros({1}, fp32);
  at::Tensor norms = at::zeros({per_tensor ? n : 0}, fp32);
  int64_t total_chunks = 0;
  for (const at::Tensor& t : tensors) {
    total_chunks += num_chunks(t.numel());
  }
  if (total_chunks == 0) {
    return {total, norms};
  }

  at::Tensor partials = at::empty({total_chunks}, fp32);
  // first_partial and partial_count of each tensor, side by side; zero counts for empty tensors.
  at::Tensor runs = at::zeros({2, n}, fp32.dtype(at::kLong));
  float* partials_ptr = partials.data_ptr<float>();
  int64_t* first_partial = runs.data_ptr<int64_t>();
  int64_t* partial_count = first_partial + n;

  const std::array<at::TensorList, 1> lists{tensors};
  int64_t blocks = 0;
  for (const auto& group : group_by_dtypes<1>(lists)) {
    dispatch_dtype(group.dtypes[0], [&](auto tag) {
      using T = typename decltype(tag)::type;
      blocks += multi_tensor_apply<1>(
          lists, group.indices, SumOfSquaresOp<T>{partials_ptr, first_partial, partial_count},
          blocks);
    });
  }
  TORCH_CHECK(blocks == total_chunks, "apex_lite::l2norm: internal error, launched ", blocks,
              " blocks for ", total_chunks, " chunks");

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  total_norm_kernel<<<1, kReduceBlockSize, 0, stream>>>(partials_ptr, total_chunks,
                                                        total.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (per_tensor) {
    per_tensor_norm_kernel<<<static_cast<unsigned int>(n), kReduceBlockSize, 0, stream>>>(
        partials_ptr, first_partial, partial_count, norms.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {total, norms};
}

}  // namespace
}  // namespace cuda
}  // namespace apex_lite

TORCH_LIBRARY_IMPL(apex_lite, CUDA, m) {
  m.impl("l2norm", &apex_lite::cuda::l2norm_cuda);
}
