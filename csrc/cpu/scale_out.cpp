// apex_lite::scale_out on CPU: outputs[i] = inputs[i] * scale.
//
// Contract: outputs[i] = round_to_dtype(outputs[i])(float(inputs[i]) * float(scale)), computed in
// fp32 and rounded once, for any of the 9 combinations of fp32/fp16/bf16 in and out (per tensor);
// found_inf (1-element fp32) is set to 1 when an input element is inf or NaN, never written 0.
// outputs[i] shares memory with no other tensor of the call but inputs[i] computed in place, and
// a call that breaks this or any other rule of multi_tensor_checks.h is refused before anything
// is written. CPU tensors of any strides (non-contiguous ones are staged through contiguous
// copies), possibly empty; 64-bit sizes and offsets.
// One at::parallel_for over chunks spanning all tensors.
#include "multi_tensor_cpu.h"

#include <torch/library.h>

namespace apex_lite {
namespace cpu {
namespace {

void scale_out(at::TensorList given_inputs, at::TensorList given_outputs, double scale,
               const at::Tensor& found_inf) {
  checks::check_scale_out(given_inputs, given_outputs, found_inf);
  check_found_inf("scale_out", found_inf);
  const ContiguousList staged_inputs(given_inputs, ContiguousList::Use::kRead);
  const ContiguousList staged_outputs(given_outputs, ContiguousList::Use::kWrite);
  const at::TensorList inputs = staged_inputs.list();
  const at::TensorList outputs = staged_outputs.list();
  const bool saw_nonfinite = scale_pass(inputs, outputs, static_cast<float>(scale));
  staged_outputs.write_back();
  if (saw_nonfinite) raise_found_inf(found_inf);
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_lite, CPU, m) { m.impl("scale_out", &scale_out); }

}  // namespace cpu
}  // namespace apex_lite
