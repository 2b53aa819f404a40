// apex_lite::l2norm on CPU: the L2 norm of all tensors together and, on request, of each one.
//
// Contract: returns (total, per_tensor_norms), fp32 tensors of shape [1] and [len(tensors)]
// ([0] when per_tensor is false). Squares are formed and summed in fp32 over blocks of
// kBlockElems elements; block sums are combined in double, per tensor and then over tensors, in
// index order, so the result does not depend on the thread count; norms are rounded once to fp32.
// An inf or NaN element makes its tensor's norm and the total inf or NaN. CPU tensors of
// fp32/fp16/bf16 and any strides (non-contiguous ones are read through contiguous copies),
// possibly empty (norm 0); 64-bit sizes. One at::parallel_for over chunks
// spanning all tensors.
#include "multi_tensor_cpu.h"

#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace apex_lite {
namespace cpu {
namespace {

// Elements summed in fp32 before their sum is folded into a double.
constexpr int64_t kBlockElems = 2048;

template <typename T>
double sum_of_squares(const void* base, int64_t begin, int64_t n) {
  const T* x = static_cast<const T*>(base) + begin;
  double total = 0.0;
  int64_t i = 0;
  while (i < n) {
    const int64_t block_end = std::min(n, i + kBlockElems);
    FVec acc_lo(0.0f), acc_hi(0.0f);
    for (; i + kStep <= block_end; i += kStep) {
      FVec lo, hi;
      load_fp32(x + i, lo, hi);
      acc_lo = acc_lo + lo * lo;
      acc_hi = acc_hi + hi * hi;
    }
    __at_align__ float lanes[FVec::size()];
    (acc_lo + acc_hi).store(lanes);
    float block = 0.0f;
    for (int64_t k = 0; k < FVec::size(); ++k) block += lanes[k];
    for (; i < block_end; ++i) {
      const float v = static_cast<float>(x[i]);
      block += v * v;
    }
    total += static_cast<double>(block);
  }
  return total;
}

using SumOfSquaresFn = double (*)(const void*, int64_t, int64_t);

SumOfSquaresFn sum_of_squares_for(at::ScalarType t) {
  static constexpr SumOfSquaresFn table[3] = {sum_of_squares<float>, sum_of_squares<at::Half>,
                                              sum_of_squares<at::BFloat16>};
  return table[dtype_index(t)];
}

std::tuple<at::Tensor, at::Tensor> l2norm(at::TensorList given, bool per_tensor) {
  check_list("l2norm", "tensors", given);
  const ContiguousList staged(given, ContiguousList::Use::kRead);
  const at::TensorList tensors = staged.list();
  const auto options = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  const int64_t n = static_cast<int64_t>(tensors.size());
  const auto offsets = element_offsets(tensors);
  const auto starts = segment_starts(offsets);
  const int64_t chunks = static_cast<int64_t>(starts.size()) - 1;
  std::vector<SumOfSquaresFn> kernels(n);
  std::vector<const void*> data(n);
  for (int64_t i = 0; i < n; ++i) {
    kernels[i] = sum_of_squares_for(tensors[i].scalar_type());
    data[i] = tensors[i].data_ptr();
  }
  std::vector<double> partial(starts.back());
  std::vector<int64_t> owner(starts.back());
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      int64_t segment = starts[c];
      for_each_segment(offsets, c, c + 1, [&](int64_t t, int64_t begin, int64_t length) {
        partial[segment] = kernels[t](data[t], begin, length);
        owner[segment] = t;
        ++segment;
      });
    }
  });
  std::vector<double> per(n, 0.0);
  for (size_t s = 0; s < partial.size(); ++s) per[owner[s]] += partial[s];
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += per[i];
  at::Tensor total_norm = at::empty({1}, options);
  total_norm.data_ptr<float>()[0] = static_cast<float>(std::sqrt(total));
  at::Tensor norms = at::empty({per_tensor ? n : 0}, options);
  if (per_tensor) {
    float* out = norms.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(std::sqrt(per[i]));
  }
  return {total_norm, norms};
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_lite, CPU, m) { m.impl("l2norm", &l2norm); }

}  // namespace cpu
}  // namespace apex_lite
