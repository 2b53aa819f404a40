// apex_lite::axpby_out on CPU: outputs[i] = a * xs[i] + b * ys[i].
//
// Contract: outputs[i] = round_to_dtype(outputs[i])(float(a) * float(x) + float(b) * float(y)):
// two fp32 products and one fp32 sum, no fused multiply-add (built with -ffp-contract=off),
// rounded once; any of the 27 combinations of fp32/fp16/bf16 for x, y and out (per tensor).
// found_inf (1-element fp32) is set to 1 when an element of xs or ys is inf or NaN, never written
// 0. outputs[i] shares memory with no other tensor of the call but xs[i] or ys[i] computed in
// place (multi_tensor_checks.h: refused before anything is written). CPU tensors of any strides
// (non-contiguous ones are staged through contiguous copies), possibly empty; 64-bit sizes.
// One at::parallel_for over chunks spanning all tensors.
#include "multi_tensor_cpu.h"

#include <torch/library.h>

namespace apex_lite {
namespace cpu {
namespace {

void axpby_out(at::TensorList given_xs, at::TensorList given_ys, at::TensorList given_outputs,
               double a, double b, const at::Tensor& found_inf) {
  checks::check_axpby_out(given_xs, given_ys, given_outputs, found_inf);
  check_found_inf("axpby_out", found_inf);
  const ContiguousList staged_xs(given_xs, ContiguousList::Use::kRead);
  const ContiguousList staged_ys(given_ys, ContiguousList::Use::kRead);
  const ContiguousList staged_outputs(given_outputs, ContiguousList::Use::kWrite);
  const at::TensorList xs = staged_xs.list();
  const at::TensorList ys = staged_ys.list();
  const at::TensorList outputs = staged_outputs.list();
  const bool saw_nonfinite =
      axpby_pass(xs, ys, outputs, static_cast<float>(a), static_cast<float>(b));
  staged_outputs.write_back();
  if (saw_nonfinite) raise_found_inf(found_inf);
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_lite, CPU, m) { m.impl("axpby_out", &axpby_out); }

}  // namespace cpu
}  // namespace apex_lite
