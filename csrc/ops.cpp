// The op schemas of apex_lite._C, in one place. Each device registers its kernels in its own
// file with TORCH_LIBRARY_IMPL(apex_lite, CPU|CUDA, m); Python registers the fake kernels.
//
// Contract shared by every kernel (apex_lite/multi_tensor/_python.py is the reference):
// arithmetic in fp32 whatever the storage dtype, rounded once to the output dtype; found_inf is
// a 1-element fp32 tensor on the tensors' device, set to 1 when an input element is inf or NaN,
// never written 0; no host synchronisation.
#include <torch/library.h>

TORCH_LIBRARY(apex_lite, m) {
  // tensors[i] *= scale
  m.def("scale_(Tensor(a!)[] tensors, float scale, Tensor(b!) found_inf) -> ()");
  // outputs[i] = inputs[i] * scale; outputs never alias inputs
  m.def("scale_out(Tensor[] inputs, Tensor(a!)[] outputs, float scale, Tensor(b!) found_inf) -> ()");
  // ys[i] = a * xs[i] + b * ys[i]; both xs and ys are checked
  m.def("axpby_(Tensor[] xs, Tensor(a!)[] ys, float a, float b, Tensor(b!) found_inf) -> ()");
  // outputs[i] = a * xs[i] + b * ys[i]; outputs alias neither
  m.def("axpby_out(Tensor[] xs, Tensor[] ys, Tensor(a!)[] outputs, float a, float b, "
        "Tensor(b!) found_inf) -> ()");
  // (total, per_tensor_norms): fp32 [1] and fp32 [len(tensors)] (or [0] when not per_tensor)
  m.def("l2norm(Tensor[] tensors, bool per_tensor) -> (Tensor, Tensor)");
  // bool [len(tensors)]: True where tensors[i] holds an inf or NaN
  m.def("nonfinite_flags(Tensor[] tensors) -> Tensor");
}
