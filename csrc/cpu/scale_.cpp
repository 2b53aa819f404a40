// apex_lite::scale_ on CPU: tensors[i] *= scale, in place.
//
// Contract: each element becomes round_to_dtype(float(x) * float(scale)), computed in fp32;
// found_inf (1-element fp32) is set to 1 when an element was inf or NaN before scaling and is
// never written 0. Tensors may mix fp32/fp16/bf16, are CPU tensors of any strides (non-contiguous
// ones are staged through contiguous copies and copied back), may be empty;
// sizes and offsets are 64-bit. Arguments are checked as multi_tensor_checks.h says (tensors that
// share memory are refused) before anything is written. One at::parallel_for over chunks
// spanning all tensors.
#include "multi_tensor_cpu.h"

#include <torch/library.h>

namespace apex_lite {
namespace cpu {
namespace {

void scale_(at::TensorList given, double scale, const at::Tensor& found_inf) {
  checks::check_scale_(given, found_inf);
  check_found_inf("scale_", found_inf);
  const ContiguousList staged(given, ContiguousList::Use::kRead);
  const at::TensorList tensors = staged.list();
  const bool saw_nonfinite = scale_pass(tensors, tensors, static_cast<float>(scale));
  staged.write_back();
  if (saw_nonfinite) raise_found_inf(found_inf);
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_lite, CPU, m) { m.impl("scale_", &scale_); }

}  // namespace cpu
}  // namespace apex_lite
