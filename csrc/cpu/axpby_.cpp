// apex_lite::axpby_ on CPU: ys[i] = a * xs[i] + b * ys[i], in place on ys.
//
// Contract: ys[i] = round_to_dtype(ys[i])(float(a) * float(x) + float(b) * float(y)): two fp32
// products and one fp32 sum, no fused multiply-add (built with -ffp-contract=off), rounded once.
// found_inf (1-element fp32) is set to 1 when an element of xs or ys is inf or NaN, never written
// 0. xs and ys may each mix fp32/fp16/bf16; ys[i] shares memory with no other tensor of the call
// but xs[i] when that views the same elements (multi_tensor_checks.h: refused before anything is
// written). CPU tensors of any strides (non-contiguous ones are staged through contiguous
// copies), possibly empty; 64-bit sizes.
// One at::parallel_for over chunks spanning all tensors.
#include "multi_tensor_cpu.h"

#include <torch/library.h>

namespace apex_lite {
namespace cpu {
namespace {

void axpby_(at::TensorList given_xs, at::TensorList given_ys, double a, double b,
            const at::Tensor& found_inf) {
  checks::check_axpby_(given_xs, given_ys, found_inf);
  check_found_inf("axpby_", found_inf);
  const ContiguousList staged_xs(given_xs, ContiguousList::Use::kRead);
  const ContiguousList staged_ys(given_ys, ContiguousList::Use::kRead);
  const at::TensorList xs = staged_xs.list();
  const at::TensorList ys = staged_ys.list();
  const bool saw_nonfinite =
      axpby_pass(xs, ys, ys, static_cast<float>(a), static_cast<float>(b));
  staged_ys.write_back();
  if (saw_nonfinite) raise_found_inf(found_inf);
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_lite, CPU, m) { m.impl("axpby_", &axpby_); }

}  // namespace cpu
}  // namespace apex_lite
