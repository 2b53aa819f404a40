// apex_lite::nonfinite_flags on CPU: which tensors hold an inf or NaN.
//
// Contract: returns a bool tensor of shape [len(tensors)], True where tensors[i] has an inf or
// NaN element; empty tensors are finite. Reads only; CPU tensors of fp32/fp16/bf16 and any
// strides (non-contiguous ones are read through contiguous copies), on the device of tensors[0]
// (multi_tensor_checks.h); 64-bit sizes. One at::parallel_for over chunks spanning all tensors;
// each segment writes its own flag and the flags are combined per tensor afterwards, so no two
// threads write one byte.
#include "multi_tensor_cpu.h"

#include <torch/library.h>

namespace apex_lite {
namespace cpu {
namespace {

template <typename T>
bool has_nonfinite(const void* base, int64_t begin, int64_t n) {
  const T* x = static_cast<const T*>(base) + begin;
  FVec probe_lo(0.0f), probe_hi(0.0f);
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    FVec lo, hi;
    load_fp32(x + i, lo, hi);
    probe_lo = probe_lo + nonfinite_probe(lo);
    probe_hi = probe_hi + nonfinite_probe(hi);
  }
  float scalar_probe = 0.0f;
  for (; i < n; ++i) scalar_probe += static_cast<float>(x[i]) * 0.0f;
  return probe_saw_nonfinite(probe_lo, probe_hi, scalar_probe);
}

using HasNonfiniteFn = bool (*)(const void*, int64_t, int64_t);

HasNonfiniteFn has_nonfinite_for(at::ScalarType t) {
  static constexpr HasNonfiniteFn table[3] = {has_nonfinite<float>, has_nonfinite<at::Half>,
                                              has_nonfinite<at::BFloat16>};
  return table[dtype_index(t)];
}

at::Tensor nonfinite_flags(at::TensorList given) {
  checks::check_reduction(given);
  const ContiguousList staged(given, ContiguousList::Use::kRead);
  const at::TensorList tensors = staged.list();
  const int64_t n = static_cast<int64_t>(tensors.size());
  const auto offsets = element_offsets(tensors);
  const auto starts = segment_starts(offsets);
  const int64_t chunks = static_cast<int64_t>(starts.size()) - 1;
  std::vector<HasNonfiniteFn> kernels(n);
  std::vector<const void*> data(n);
  for (int64_t i = 0; i < n; ++i) {
    kernels[i] = has_nonfinite_for(tensors[i].scalar_type());
    data[i] = tensors[i].data_ptr();
  }
  std::vector<uint8_t> segment_flag(starts.back(), 0);
  std::vector<int64_t> owner(starts.back());
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      int64_t segment = starts[c];
      for_each_segment(offsets, c, c + 1, [&](int64_t t, int64_t begin, int64_t length) {
        segment_flag[segment] = kernels[t](data[t], begin, length) ? 1 : 0;
        owner[segment] = t;
        ++segment;
      });
    }
  });
  at::Tensor flags = at::zeros({n}, at::TensorOptions().dtype(at::kBool).device(at::kCPU));
  bool* out = flags.data_ptr<bool>();
  for (size_t s = 0; s < segment_flag.size(); ++s) out[owner[s]] |= segment_flag[s] != 0;
  return flags;
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_lite, CPU, m) { m.impl("nonfinite_flags", &nonfinite_flags); }

}  // namespace cpu
}  // namespace apex_lite
