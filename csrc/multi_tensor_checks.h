// The argument checks of the multi-tensor ops (scale_, scale_out, axpby_, axpby_out, l2norm,
// nonfinite_flags), shared by their CPU and CUDA kernels.
//
// Contract: every check is one that apex_lite/multi_tensor/_checks.py makes for the Python
// backend, made in the same order, raising the same exception type (TORCH_CHECK_TYPE: TypeError,
// TORCH_CHECK_VALUE: ValueError) with the same message, so that a bad call is refused alike by
// every backend and the Python layer does no per-tensor work for the native kernels. The checks
// read sizes, strides, dtypes, devices and addresses on the host, never an element: no device
// work, no synchronisation. A kernel makes them all before it writes anything.
//
// One header for both devices: the rules and their messages are the same on each, and a single
// copy cannot drift. Each device adds what only its kernels need (CUDA: contiguous tensors).
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace apex_lite {
namespace checks {

inline bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// A dtype as Python prints it ("torch.float64").
inline std::string python_dtype(at::ScalarType t) {
  return "torch." + std::string(c10::getDtypeNames(t).first);
}

// A shape as Python prints tuple(tensor.shape): "(3, 2)", "(3,)", "()".
inline std::string python_shape(at::IntArrayRef sizes) {
  std::string text = "(";
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (d > 0) text += ", ";
    text += std::to_string(sizes[d]);
  }
  return text + (sizes.size() == 1 ? ",)" : ")");
}

// Whether t is dense with like's sizes and strides (dims of size 1 aside, whose strides mean
// nothing): the two put each element at the same offset from their first address, so a kernel
// may walk them as flat arrays together (channels_last parameters with their gradients and
// state, as torch makes them). apex_lite/multi_tensor/_layout.py's laid_out_as.
inline bool laid_out_as(const at::Tensor& t, const at::Tensor& like) {
  if (t.sizes() != like.sizes() || !t.is_non_overlapping_and_dense()) return false;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) != 1 && t.stride(d) != like.stride(d)) return false;
  }
  return true;
}

// A list argument and the name the messages give it.
struct NamedList {
  const char* name;
  at::TensorList tensors;
};

// found_inf: one fp32 element (its device is checked as the anchor of the tensors').
inline void check_found_inf(const at::Tensor& found_inf) {
  TORCH_CHECK_TYPE(found_inf.defined() && found_inf.numel() == 1 &&
                       found_inf.scalar_type() == at::kFloat,
                   "found_inf must be a 1-element float32 tensor (create it with "
                   "torch.zeros(1, device=...) and zero it yourself between steps)");
}

inline void check_same_length(const NamedList& a, const NamedList& b) {
  TORCH_CHECK_VALUE(a.tensors.size() == b.tensors.size(), a.name, " has ", a.tensors.size(),
                    " tensors but ", b.name, " has ", b.tensors.size(),
                    "; they are used pairwise");
}

// Per tensor, list by list and in index order: a tensor, of a supported dtype, on `device` (the
// device of the argument named `anchor`).
inline void check_tensors(const at::Device& device, const char* anchor,
                          std::initializer_list<NamedList> lists) {
  for (const NamedList& list : lists) {
    for (size_t i = 0; i < list.tensors.size(); ++i) {
      const at::Tensor& t = list.tensors[i];
      TORCH_CHECK_TYPE(t.defined(), list.name, "[", i, "] is undefined (None), not a tensor");
      TORCH_CHECK_TYPE(is_supported_dtype(t.scalar_type()), list.name, "[", i, "] has dtype ",
                       python_dtype(t.scalar_type()),
                       "; multi-tensor kernels take float32, float16 and bfloat16 tensors only");
      TORCH_CHECK_VALUE(t.device() == device, list.name, "[", i, "] is on ", t.device().str(),
                        " but ", anchor, " is on ", device.str(),
                        "; all tensors of a call must be on one device. Call once per device.");
    }
  }
}

inline void check_same_shapes(const NamedList& a, const NamedList& b) {
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    TORCH_CHECK_VALUE(a.tensors[i].sizes() == b.tensors[i].sizes(), a.name, "[", i,
                      "] has shape ", python_shape(a.tensors[i].sizes()), " but ", b.name, "[",
                      i, "] has ", python_shape(b.tensors[i].sizes()));
  }
}

// ---- overlap ------------------------------------------------------------------------------------
//
// The kernels read and write each pair (or triple) on its own, in chunks and in parallel, so an
// output that overlaps a tensor of another pair would be read after it was written, or written
// twice: wrong values, different on each backend. Refused: an output that shares memory with
// another output, or with an input other than the one it is computed from in place (the same
// tensor, or the same elements in the same layout); an output whose own elements share memory
// (an expand()ed view). Inputs may share memory with each other: they are only read.
//
// Each tensor's elements lie in the byte range [start, end); the ranges are sorted by start and
// scanned once. Where two meet, one sweep compares each range with those before it that reach it.
// Sorting is stable (equal starts keep the order outputs, then each input list, by index), so the
// pair named in the message is the one _checks.check_no_overlap names.

// One tensor's bytes [start, end). The sort and the scans move and read these; what the rare
// exact comparison and the messages need is in the TensorRef that `tensor` indexes.
struct Span {
  uintptr_t start;
  uintptr_t end;               // one past the last byte
  size_t tensor;               // index into the call's TensorRef list
  bool written;
};

struct TensorRef {
  const at::Tensor* tensor;
  const char* name;            // its list's name
  int64_t index;               // its index in that list
};

// The span of all of t's elements, strided or not (t not empty).
inline Span span_of(const at::Tensor& t, size_t tensor, bool written) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  int64_t extent = t.numel();
  if (!t.is_contiguous()) {
    extent = 1;
    for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  }
  const uintptr_t bytes = static_cast<uintptr_t>(extent) * t.element_size();
  return Span{start, start + bytes, tensor, written};
}

// An output and an input that view the same elements in the same layout: each element is read
// where it is written (the in-place form, safe).
inline bool same_elements(const at::Tensor& a, const at::Tensor& b) {
  return a.const_data_ptr() == b.const_data_ptr() && a.sizes() == b.sizes() &&
         a.strides() == b.strides() && a.element_size() == b.element_size();
}

// The output `written` computed in place from the input `read`: they are one pair.
inline bool in_place_pair(const TensorRef& written, const TensorRef& read) {
  return written.index == read.index && same_elements(*written.tensor, *read.tensor);
}

// Sorts spans by start, stably: a least-significant-digit radix sort over the bits in which the
// starts differ, a byte per pass (three or four passes: a call's tensors lie within a few GiB, at
// addresses aligned alike). Linear in the number of tensors, which matters at thousands of
// tensors per call. Spans already in order (tensors allocated one after the other) cost one scan.
inline void sort_by_start(std::vector<Span>& spans) {
  const auto by_start = [](const Span& a, const Span& b) { return a.start < b.start; };
  if (std::is_sorted(spans.begin(), spans.end(), by_start)) return;
  uintptr_t differing = 0;
  for (const Span& span : spans) differing |= span.start ^ spans[0].start;
  std::vector<Span> sorted(spans.size());
  constexpr unsigned kBits = 8 * sizeof(uintptr_t);
  for (unsigned shift = __builtin_ctzll(differing); shift < kBits && (differing >> shift) != 0;
       shift += 8) {
    std::array<size_t, 257> next{};
    for (const Span& span : spans) ++next[((span.start >> shift) & 0xff) + 1];
    for (size_t digit = 0; digit < 256; ++digit) next[digit + 1] += next[digit];
    for (const Span& span : spans) sorted[next[(span.start >> shift) & 0xff]++] = span;
    spans.swap(sorted);
  }
}

// Whether no two of these sorted spans meet: each starts at or after the furthest end before it.
inline bool disjoint(const std::vector<Span>& spans) {
  uintptr_t furthest_end = 0;
  for (const Span& span : spans) {
    if (span.start < furthest_end) return false;
    furthest_end = std::max(furthest_end, span.end);
  }
  return true;
}

// Raises the error for the output `first` sharing memory with `second`.
inline void refuse_shared(const TensorRef& first, const TensorRef& second) {
  TORCH_CHECK_VALUE(false, first.name, "[", first.index, "] shares memory with ", second.name,
                    "[", second.index,
                    "]: the kernels would read elements that another output already overwrote "
                    "(or write one element twice), and the backends would disagree. Outputs may "
                    "be their own inputs (outputs is inputs, or outputs[i] is inputs[i]) but must "
                    "not overlap any other tensor of the call: write into separate tensors, or "
                    "clone() the inputs first.");
}

// Refuses what the block comment above says. `inputs[k].tensors[i]` that is `outputs[i]` itself
// is left out (the output stands for it). The lists' lengths are checked before.
inline void check_no_overlap(const NamedList& outputs, std::initializer_list<NamedList> inputs) {
  size_t count = outputs.tensors.size();
  for (const NamedList& list : inputs) count += list.tensors.size();
  std::vector<TensorRef> refs;
  std::vector<Span> spans;
  refs.reserve(count);
  spans.reserve(count);
  for (size_t i = 0; i < outputs.tensors.size(); ++i) {
    const at::Tensor& t = outputs.tensors[i];
    if (t.numel() == 0) continue;
    TORCH_CHECK_VALUE(t.is_contiguous() || at::has_internal_overlap(t) != at::MemOverlap::Yes,
                      outputs.name, "[", i,
                      "] has elements that share memory (an expand()ed or as_strided view): "
                      "writing it would race with itself. Write into a tensor of its own "
                      "(torch.empty_like) instead.");
    spans.push_back(span_of(t, refs.size(), true));
    refs.push_back(TensorRef{&t, outputs.name, static_cast<int64_t>(i)});
  }
  for (const NamedList& list : inputs) {
    for (size_t i = 0; i < list.tensors.size(); ++i) {
      const at::Tensor& t = list.tensors[i];
      if (t.numel() == 0 || t.is_same(outputs.tensors[i])) continue;
      spans.push_back(span_of(t, refs.size(), false));
      refs.push_back(TensorRef{&t, list.name, static_cast<int64_t>(i)});
    }
  }
  sort_by_start(spans);
  if (disjoint(spans)) return;  // the common case

  // Some spans meet: decide pair by pair which may, in one sweep. Before each span, the spans (by
  // their rank in the sorted order) that may still reach it: at most one output (two outputs
  // that both reach a point overlap each other, which was refused), and the inputs since the
  // last output (after an output, only its own in-place inputs can still reach past its start).
  constexpr size_t kNone = static_cast<size_t>(-1);
  size_t live_output = kNone;
  std::vector<size_t> live_inputs;
  std::vector<size_t> kept;
  for (size_t rank = 0; rank < spans.size(); ++rank) {
    const Span& span = spans[rank];
    const TensorRef& ref = refs[span.tensor];
    // The first span before this one, in sorted order, that it must not overlap.
    size_t other = kNone;
    if (live_output != kNone && spans[live_output].end > span.start &&
        (span.written || !in_place_pair(refs[spans[live_output].tensor], ref))) {
      other = live_output;
    }
    if (span.written) {
      kept.clear();
      for (const size_t input : live_inputs) {
        // An input that ends before this span reaches no later one either.
        if (spans[input].end <= span.start) continue;
        if (in_place_pair(ref, refs[spans[input].tensor])) {
          kept.push_back(input);
          continue;
        }
        other = std::min(other, input);
        break;
      }
      if (other == kNone) {
        live_output = rank;
        live_inputs.swap(kept);
      }
    } else if (other == kNone) {
      live_inputs.push_back(rank);
    }
    if (other != kNone) {
      if (spans[other].written) {
        refuse_shared(refs[spans[other].tensor], ref);
      } else {
        refuse_shared(ref, refs[spans[other].tensor]);
      }
    }
  }
}

// ---- the checks of each op, in the order _checks.py makes them ---------------------------------

// scale_(tensors, scale, found_inf): tensors written in place.
inline void check_scale_(at::TensorList tensors, const at::Tensor& found_inf) {
  check_found_inf(found_inf);
  const NamedList named{"tensors", tensors};
  check_tensors(found_inf.device(), "found_inf", {named});
  check_no_overlap(named, {});
}

// A list read and a list written pairwise, shaped alike.
inline void check_read_and_written(const at::Tensor& found_inf, const NamedList& read,
                                   const NamedList& written) {
  check_found_inf(found_inf);
  check_same_length(read, written);
  check_tensors(found_inf.device(), "found_inf", {read, written});
  check_same_shapes(read, written);
  check_no_overlap(written, {read});
}

// scale_out(inputs, outputs, scale, found_inf).
inline void check_scale_out(at::TensorList inputs, at::TensorList outputs,
                            const at::Tensor& found_inf) {
  check_read_and_written(found_inf, NamedList{"inputs", inputs}, NamedList{"outputs", outputs});
}

// axpby_(xs, ys, a, b, found_inf): ys written in place.
inline void check_axpby_(at::TensorList xs, at::TensorList ys, const at::Tensor& found_inf) {
  check_read_and_written(found_inf, NamedList{"xs", xs}, NamedList{"ys", ys});
}

// axpby_out(xs, ys, outputs, a, b, found_inf).
inline void check_axpby_out(at::TensorList xs, at::TensorList ys, at::TensorList outputs,
                            const at::Tensor& found_inf) {
  check_found_inf(found_inf);
  const NamedList named_xs{"xs", xs};
  const NamedList named_ys{"ys", ys};
  const NamedList named_outputs{"outputs", outputs};
  check_same_length(named_xs, named_ys);
  check_same_length(named_xs, named_outputs);
  check_tensors(found_inf.device(), "found_inf", {named_xs, named_ys, named_outputs});
  check_same_shapes(named_xs, named_ys);
  check_same_shapes(named_xs, named_outputs);
  check_no_overlap(named_outputs, {named_xs, named_ys});
}

// l2norm(tensors, ...) and nonfinite_flags(tensors): read only, on the device of tensors[0].
inline void check_reduction(at::TensorList tensors) {
  if (tensors.empty()) return;
  TORCH_CHECK_TYPE(tensors[0].defined(), "tensors[0] is undefined (None), not a tensor");
  check_tensors(tensors[0].device(), "tensors[0]", {NamedList{"tensors", tensors}});
}

// ---- step counts (the fused Adam-like optimizer steps) -------------------------------------------
//
// Each parameter's step count is an element of its own: a count that two parameters share would
// advance once per parameter in one step, and their bias corrections would depend on the order in
// which they are stepped (on CUDA, on which block reads the count after another's increment).
// Shared means at one address (the same tensor, or views of one element); distinct elements of
// one buffer are distinct counts (apex_multi_tensor.py passes those). _checks.check_own_step_counts
// makes the same check for the Python backend.

// Raises the error for steps[j] at the address of the earlier steps[i], on `device` (named in
// the fix: a count made without it would be on the CPU, which a CUDA kernel refuses).
inline void refuse_shared_step(const char* op, size_t i, size_t j, const c10::Device& device) {
  TORCH_CHECK_VALUE(false, "apex_lite::", op, ": steps[", j, "] shares its memory with steps[", i,
                    "]: each parameter needs a step count of its own (a shared count would "
                    "advance once per parameter in a step, and their bias corrections would "
                    "depend on the order they are stepped in). Give each parameter its own "
                    "tensor: torch.zeros((), dtype=torch.float32, device='", device.str(),
                    "') per parameter, or a clone() of the shared one.");
}

// Refuses two of n step counts at one address (address(k): where steps[k]'s element is) on
// `device`. Names the lowest j whose address an earlier index holds, and the first index i that
// holds it, as _checks.check_own_step_counts does. One scan when the addresses rise with the
// index (counts allocated one after the other, the common case), else a sort.
template <typename Address>
inline void check_own_step_counts(const char* op, size_t n, const c10::Device& device,
                                  Address&& address) {
  uintptr_t previous = 0;
  size_t k = 0;
  for (; k < n; ++k) {
    const uintptr_t a = address(k);
    if (k > 0 && a <= previous) break;
    previous = a;
  }
  if (k == n) return;
  std::vector<std::pair<uintptr_t, size_t>> sorted(n);
  for (k = 0; k < n; ++k) sorted[k] = {address(k), k};
  std::sort(sorted.begin(), sorted.end());
  // In each run of equal addresses, sorted by index: the run's first two indices.
  size_t first = n, second = n;
  for (k = 1; k < n; ++k) {
    const bool starts_run = k < 2 || sorted[k - 2].first != sorted[k].first;
    if (sorted[k].first == sorted[k - 1].first && starts_run && sorted[k].second < second) {
      first = sorted[k - 1].second;
      second = sorted[k].second;
    }
  }
  if (second < n) refuse_shared_step(op, first, second, device);
}

}  // namespace checks
}  // namespace apex_lite
