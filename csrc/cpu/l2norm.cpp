// apex_lite::l2norm on CPU: the L2 norm of all tensors together and, on request, of each one.
//
// Contract: returns (total, per_tensor_norms), fp32 tensors of shape [1] and [len(tensors)]
// ([0] when per_tensor is false). Squares are formed and summed in fp32 over blocks of
// kSquareBlockElems elements (SquareSum in multi_tensor_cpu.h); block sums are combined in
// double, per tensor and then over tensors, in index order, so the result does not depend on the
// thread count; norms are rounded once to fp32. An inf or NaN element makes its tensor's norm
// and the total inf or NaN. CPU tensors of fp32/fp16/bf16 and any strides (non-contiguous ones
// are read through contiguous copies), on the device of tensors[0] (multi_tensor_checks.h),
// possibly empty (norm 0); 64-bit sizes. One at::parallel_for over chunks spanning all tensors.
#include "multi_tensor_cpu.h"

#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace apex_lite {
namespace cpu {
namespace {

template <typename T>
double sum_of_squares(const void* base, int64_t begin, int64_t n) {
  const T* x = static_cast<const T*>(base) + begin;
  SquareSum sum;
  for_each_square_block(
      n,
      [&](int64_t i) {
        FVec lo, hi;
        load_fp32(x + i, lo, hi);
        sum.add(lo, hi);
      },
      [&](int64_t i) { sum.add(static_cast<float>(x[i])); }, [&] { sum.end_block(); });
  return sum.total();
}

using SumOfSquaresFn = double (*)(const void*, int64_t, int64_t);

SumOfSquaresFn sum_of_squares_for(at::ScalarType t) {
  static constexpr SumOfSquaresFn table[3] = {sum_of_squares<float>, sum_of_squares<at::Half>,
                                              sum_of_squares<at::BFloat16>};
  return table[dtype_index(t)];
}

std::tuple<at::Tensor, at::Tensor> l2norm(at::TensorList given, bool per_tensor) {
  checks::check_reduction(given);
  const ContiguousList staged(given, ContiguousList::Use::kRead);
  const at::TensorList tensors = staged.list();
  const auto options = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  const int64_t n = static_cast<int64_t>(tensors.size());
  const auto offsets = element_offsets(tensors);
  const auto starts = segment_starts(offsets);
  std::vector<SumOfSquaresFn> kernels(n);
  std::vector<const void*> data(n);
  for (int64_t i = 0; i < n; ++i) {
    kernels[i] = sum_of_squares_for(tensors[i].scalar_type());
    data[i] = tensors[i].data_ptr();
  }
  std::vector<double> partials(starts.back());
  parallel_indexed_segments(offsets, starts,
                            [&](int64_t segment, int64_t t, int64_t begin, int64_t length) {
                              partials[segment] = kernels[t](data[t], begin, length);
                            });
  const std::vector<double> per = per_tensor_totals(partials, segment_owners(offsets, starts), n);
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
