// Multi-tensor-apply for CUDA: one kernel launch processes the chunks of many tensors.
//
// Each CUDA block processes one chunk (kChunkSize elements) of one tensor. The tensors' addresses,
// 64-bit sizes and the block-to-chunk map travel by value in the kernel-argument struct
// TensorListMetadata (at most 4 KiB of kernel arguments, the portable limit); when a list does not
// fit, the host launches again (launch_plan.h decides the split). Inside a chunk, threads use
// aligned vector accesses of kILP elements when every pointer and the chunk length allow it, and
// one element at a time otherwise.
//
// Arithmetic contract shared by the kernels (apex_lite/multi_tensor/_python.py is the reference):
// values are widened to fp32, computed in fp32 with explicitly rounded operations (no fused
// multiply-add, whatever -fmad says), and narrowed once to the output dtype with the c10::Half /
// c10::BFloat16 conversions (round to nearest even), the ones torch's own kernels use. The one
// exception is the sums of squares of the norms (l2norm.cu, LAMB's trust ratios in adam_step.cuh):
// fmaf, one rounding per term; norms agree with the other backends within fp32 rounding, not bit
// for bit, as their order of summation differs anyway.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "../multi_tensor_checks.h"
#include "launch_plan.h"

namespace apex_lite {
namespace cuda {

constexpr int kBlockSize = 512;
// Elements per thread per vector access: 16 bytes of fp32, 8 bytes of fp16/bf16.
constexpr int kILP = 4;
// Blocks per launch: 2**31 elements, so a larger tensor is also split across launches.
constexpr int64_t kMaxBlocksPerLaunch = 32768;
// The portable limit on the size of a kernel's arguments.
constexpr size_t kMaxKernelArgBytes = 4096;

// The kernel-argument struct of one launch over lists of Depth tensors (list d, slot s is
// addresses[d][s]). Slot s covers blocks [block_start[s], block_start[s+1]) (the last slot ends at
// gridDim.x); its k-th block processes chunk k of a tensor of sizes[s] elements, the caller's
// tensor number tensor_ids[s], except that slot 0 may continue a tensor split across launches:
// its k-th block processes chunk first_chunk + k (launch_plan.h starts every other slot at chunk 0).
// Element counts and chunk indices are 64-bit; block_start is a block index within one launch
// (below kMaxBlocksPerLaunch), so 32 bits hold it and leave room for more tensors per launch.
// kMaxTensors: as many slots as fit in 4 KiB beside the largest functor used at that depth (the
// fused optimizers': about 140 bytes at depths 5 and 6); multi_tensor_apply's static_assert checks.
template <int Depth>
struct TensorListMetadata {
  static_assert(Depth >= 1 && Depth <= 6, "TensorListMetadata: 1 to 6 lists");
  static constexpr int kMaxTensors = Depth == 1   ? 160
                                     : Depth == 2 ? 120
                                     : Depth == 3 ? 96
                                     : Depth == 4 ? 80
                                     : Depth == 5 ? 68
                                                  : 60;
  void* addresses[Depth][kMaxTensors];
  int64_t sizes[kMaxTensors];
  int32_t block_start[kMaxTensors];
  int32_t tensor_ids[kMaxTensors];
  int64_t first_chunk;
  // Number of blocks in the launches made before this one for the same op call: block b of this
  // launch is block first_global_block + b of the call (l2norm's partial sums are indexed by it).
  int64_t first_global_block;
  int32_t num_slots;
};
static_assert(kMaxBlocksPerLaunch <= INT32_MAX, "block_start is 32-bit");

// What a block is given to work on: one chunk of one tensor of each list.
template <int Depth>
struct ChunkRef {
  void* base[Depth];      // the tensors' first elements (the chunk starts at base + start)
  int64_t start;          // element offset of the chunk in its tensor
  int64_t n;              // elements in the chunk, at most kChunkSize
  int64_t chunk;          // chunk index in its tensor
  int64_t numel;          // elements in the whole tensor
  int64_t global_block;   // block index within the whole op call
  int32_t tensor_id;      // index of the tensor in the caller's list
};

template <int Depth, typename Op>
__global__ void __launch_bounds__(kBlockSize)
    multi_tensor_apply_kernel(const TensorListMetadata<Depth> meta, const Op op) {
  const int64_t block = blockIdx.x;
  // The last slot whose first block is at or before this one (slots are in block order).
  int lo = 0;
  int hi = meta.num_slots - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (meta.block_start[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  ChunkRef<Depth> ref;
#pragma unroll
  for (int d = 0; d < Depth; ++d) {
    ref.base[d] = meta.addresses[d][lo];
  }
  ref.chunk = (lo == 0 ? meta.first_chunk : 0) + (block - meta.block_start[lo]);
  ref.start = ref.chunk * kChunkSize;
  ref.numel = meta.sizes[lo];
  ref.n = ref.numel - ref.start < kChunkSize ? ref.numel - ref.start : kChunkSize;
  ref.global_block = meta.first_global_block + block;
  ref.tensor_id = meta.tensor_ids[lo];
  op(ref);
}

// Launches `op` over the tensors `indices` of `lists` (contiguous, on the current device), on the
// current stream. lists[0][i] sets the number of elements; every other lists[d][i] has as many,
// except a list of per-tensor scalars (1-element tensors such as the optimizers' step counts),
// which the functor reads and writes at ChunkRef::base[d] itself, never at base + start.
// `first_global_block` is passed on to the blocks (see TensorListMetadata); returns the number of
// blocks launched.
template <int Depth, typename Op>
int64_t multi_tensor_apply(const std::array<at::TensorList, Depth>& lists,
                           const std::vector<int64_t>& indices, const Op& op,
                           int64_t first_global_block = 0) {
  using Meta = TensorListMetadata<Depth>;
  static_assert(sizeof(Meta) + sizeof(Op) <= kMaxKernelArgBytes,
                "multi-tensor-apply kernel arguments exceed 4 KiB");
  static_assert(std::is_trivially_copyable<Op>::value, "kernel functors are passed by value");

  TORCH_CHECK(lists[0].size() <= static_cast<size_t>(INT32_MAX),
              "apex_lite: at most 2**31 - 1 tensors per multi-tensor call");
  std::vector<int64_t> numels(lists[0].size());
  for (const int64_t i : indices) {
    numels[static_cast<size_t>(i)] = lists[0][static_cast<size_t>(i)].numel();
  }
  const std::vector<LaunchPlan> plans =
      plan_launches(indices, numels, Meta::kMaxTensors, kMaxBlocksPerLaunch);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  int64_t launched = 0;
  for (const LaunchPlan& plan : plans) {
    Meta meta{};
    meta.num_slots = static_cast<int32_t>(plan.slots.size());
    meta.first_chunk = plan.slots[0].first_chunk;
    meta.first_global_block = first_global_block + launched;
    for (size_t s = 0; s < plan.slots.size(); ++s) {
      const LaunchSlot& slot = plan.slots[s];
      const size_t tensor = static_cast<size_t>(slot.tensor);
      for (int d = 0; d < Depth; ++d) {
        meta.addresses[d][s] = lists[d][tensor].data_ptr();
      }
      TORCH_INTERNAL_ASSERT(s == 0 || slot.first_chunk == 0,
                            "multi_tensor_apply: only slot 0 may continue a split tensor");
      meta.sizes[s] = numels[tensor];
      meta.block_start[s] = static_cast<int32_t>(slot.block_start);
      meta.tensor_ids[s] = static_cast<int32_t>(slot.tensor);
    }
    multi_tensor_apply_kernel<Depth, Op>
        <<<static_cast<unsigned int>(plan.num_blocks), kBlockSize, 0, stream>>>(meta, op);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    launched += plan.num_blocks;
  }
  return launched;
}

// ---- element access ----------------------------------------------------------------------------

template <typename T, int N>
struct alignas(sizeof(T) * N) AlignedVector {
  T val[N];
};

template <int N, typename T>
__device__ __forceinline__ bool is_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * N) == 0;
}

// Loads N elements at p (aligned to N elements) widened to fp32 (exact for fp16 and bf16).
template <int N, typename T>
__device__ __forceinline__ void load_fp32(const T* p, float (&v)[N]) {
  const AlignedVector<T, N> vec = *reinterpret_cast<const AlignedVector<T, N>*>(p);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    v[k] = static_cast<float>(vec.val[k]);
  }
}

// The unsigned integer type of a vector access of Bytes bytes. Stores go through __stwb (st.global.wb,
// the default write-back policy) on this type: one vector store instruction, which the compiler
// cannot split (a plain struct store was split into N scalar stores once the loop was unswitched).
template <size_t Bytes>
struct VectorBits;
template <>
struct VectorBits<16> {
  using type = uint4;
};
template <>
struct VectorBits<8> {
  using type = uint2;
};
template <>
struct VectorBits<4> {
  using type = unsigned int;
};
template <>
struct VectorBits<2> {
  using type = unsigned short;
};

// Stores N fp32 values at p (aligned to N elements), rounded to T to nearest even.
template <int N, typename T>
__device__ __forceinline__ void store_rounded(T* p, const float (&v)[N]) {
  using Bits = typename VectorBits<sizeof(T) * N>::type;
  static_assert(sizeof(Bits) == sizeof(AlignedVector<T, N>), "vector size mismatch");
  union {
    AlignedVector<T, N> vec;
    Bits bits;
  } out;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    out.vec.val[k] = static_cast<T>(v[k]);
  }
  __stwb(reinterpret_cast<Bits*>(p), out.bits);
}

// inf or NaN: all exponent bits set. A bit test, so that no compiler flag can change it.
__device__ __forceinline__ bool is_nonfinite(float v) {
  return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
}

// `v * factor` rounded to fp32, as torch's _amp_foreach_non_finite_check_and_unscale_ (the Python
// backend) computes it: a factor of exactly 1 leaves v untouched (NaN payloads included).
__device__ __forceinline__ float scaled(float v, float factor) {
  return factor == 1.0f ? v : __fmul_rn(v, factor);
}

// Calls body(i, std::integral_constant<int, N>) for the groups of N elements of a chunk of n
// elements that this thread owns: vector groups of kILP when `vectorised`, else single elements.
template <typename Body>
__device__ __forceinline__ void for_each_group(int64_t n, bool vectorised, Body&& body) {
  if (vectorised) {
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * kILP; i < n;
         i += static_cast<int64_t>(blockDim.x) * kILP) {
      body(i, std::integral_constant<int, kILP>());
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      body(i, std::integral_constant<int, 1>());
    }
  }
}

// The sum of `v` over the block, valid in thread 0. Every thread of the block must call it
// (blockDim.x a multiple of 32, at most 1024); the order of the additions depends only on
// blockDim.x, so the result is deterministic.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, offset));
  }
  if (lane == 0) {
    warp_sums[warp] = v;
  }
  __syncthreads();
  if (warp == 0) {
    const int num_warps = static_cast<int>(blockDim.x / 32);
    v = lane < num_warps ? warp_sums[lane] : 0.0f;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, offset));
    }
  }
  return v;
}

// ---- host-side checks and dtype dispatch -------------------------------------------------------

// The multi-tensor ops check their arguments with ../multi_tensor_checks.h (shared with the CPU
// kernels), then check_contiguous; the fused optimizer steps with check_tensor_list (one dense
// layout per parameter) and the rest.
using checks::is_supported_dtype;

// What the kernels rely on beyond the shared checks: contiguous tensors (apex_lite.multi_tensor
// stages non-contiguous tensors before calling the op).
inline void check_contiguous(const char* op, const char* name, at::TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].is_contiguous(), "apex_lite::", op, ": ", name, "[", i,
                "] is not contiguous; call apex_lite.multi_tensor (which stages non-contiguous "
                "tensors) or pass .contiguous() tensors");
  }
}

// Checks what the fused optimizer kernels rely on: every tensor a CUDA tensor on `device`, of a
// supported dtype; the parameters (`like` empty) dense, in any order of their dims, and every
// other tensor of a parameter laid out as it (`like` the parameters): the kernels walk a
// parameter's tensors as flat arrays together, so a channels_last model steps without copies.
inline void check_tensor_list(const char* op, const char* name, at::TensorList tensors,
                              const at::Device& device, at::TensorList like = {}) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), "apex_lite::", op, ": ", name, "[", i, "] is an undefined tensor");
    TORCH_CHECK(t.device() == device, "apex_lite::", op, ": ", name, "[", i, "] is on ",
                t.device(), " but the call runs on ", device,
                "; all tensors (and found_inf) must be on one CUDA device");
    TORCH_CHECK(is_supported_dtype(t.scalar_type()), "apex_lite::", op, ": ", name, "[", i,
                "] has dtype ", t.scalar_type(), "; only float32, float16 and bfloat16 are supported");
    if (like.empty()) {
      TORCH_CHECK(t.is_non_overlapping_and_dense(), "apex_lite::", op, ": ", name, "[", i,
                  "] is not dense (it has gaps or overlaps); call apex_lite.multi_tensor (which "
                  "stages such tensors) or pass .contiguous() tensors");
    } else {
      TORCH_CHECK(checks::laid_out_as(t, like[i]), "apex_lite::", op, ": ", name, "[", i,
                  "] is not laid out as params[", i, "] (dense, with the same strides); call "
                  "apex_lite.multi_tensor (which stages such tensors) or pass tensors of one "
                  "layout");
    }
  }
}

inline void check_found_inf(const char* op, const at::Tensor& found_inf) {
  TORCH_CHECK(found_inf.defined() && found_inf.is_cuda(), "apex_lite::", op,
              ": found_inf must be a CUDA tensor on the tensors' device");
  TORCH_CHECK(found_inf.scalar_type() == at::kFloat && found_inf.numel() == 1, "apex_lite::", op,
              ": found_inf must be a 1-element float32 tensor, got ", found_inf.scalar_type(),
              " with ", found_inf.numel(), " elements");
}

inline void check_same_length(const char* op, const char* name_a, at::TensorList a,
                              const char* name_b, at::TensorList b) {
  TORCH_CHECK(a.size() == b.size(), "apex_lite::", op, ": ", name_a, " has ", a.size(),
              " tensors but ", name_b, " has ", b.size(), "; they are used pairwise");
}

inline void check_same_shapes(const char* op, const char* name_a, at::TensorList a,
                              const char* name_b, at::TensorList b) {
  check_same_length(op, name_a, a, name_b, b);
  for (size_t i = 0; i < a.size(); ++i) {
    TORCH_CHECK(a[i].sizes() == b[i].sizes(), "apex_lite::", op, ": ", name_a, "[", i,
                "] has shape ", a[i].sizes(), " but ", name_b, "[", i, "] has ", b[i].sizes());
  }
}

// The indices of the non-empty tensors of `lists`, grouped by their dtypes (one dtype per list),
// in order within each group: one kernel instantiation serves each group.
template <int Depth>
struct DtypeGroup {
  std::array<at::ScalarType, Depth> dtypes;
  std::vector<int64_t> indices;
};

template <int Depth>
std::vector<DtypeGroup<Depth>> group_by_dtypes(const std::array<at::TensorList, Depth>& lists) {
  std::vector<DtypeGroup<Depth>> groups;
  for (size_t i = 0; i < lists[0].size(); ++i) {
    if (lists[0][i].numel() == 0) {
      continue;
    }
    std::array<at::ScalarType, Depth> dtypes;
    for (int d = 0; d < Depth; ++d) {
      dtypes[d] = lists[d][i].scalar_type();
    }
    DtypeGroup<Depth>* group = nullptr;
    for (auto& g : groups) {
      if (g.dtypes == dtypes) {
        group = &g;
        break;
      }
    }
    if (group == nullptr) {
      groups.push_back(DtypeGroup<Depth>{dtypes, {}});
      group = &groups.back();
    }
    group->indices.push_back(static_cast<int64_t>(i));
  }
  return groups;
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>()) with the C++ type T that stores `dtype` (float, c10::Half, c10::BFloat16).
template <typename F>
void dispatch_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      f(TypeTag<float>());
      return;
    case at::kHalf:
      f(TypeTag<c10::Half>());
      return;
    case at::kBFloat16:
      f(TypeTag<c10::BFloat16>());
      return;
    default:
      TORCH_CHECK(false, "apex_lite: unsupported dtype ", dtype,
                  "; only float32, float16 and bfloat16 are supported");
  }
}

}  // namespace cuda
}  // namespace apex_lite
