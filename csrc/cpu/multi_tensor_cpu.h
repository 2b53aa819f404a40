// Shared machinery of the CPU multi-tensor kernels: argument checks, the chunk plan over all
// tensors of a call, and the vectorised fp32 load/store of fp32/fp16/bf16 storage.
//
// A call's tensors are laid end to end in one index space of 64-bit element offsets and cut into
// chunks of kChunkElems elements. Chunks are the unit of at::parallel_for: one parallel region per
// call whatever the number of tensors, and every chunk (but the last) has the same size, so
// thousands of small tensors cost one balanced pass. The chunk plan depends only on the tensor
// sizes, never on the thread count, which keeps reductions deterministic.
//
// Arithmetic is in fp32 and must match apex_lite/multi_tensor/_python.py bit for bit; the
// extension is compiled with -ffp-contract=off so that a*x + b*y is two roundings, never an FMA.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/TensorBody.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "../multi_tensor_checks.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace apex_lite {
namespace cpu {

// Elements per chunk (as apex's multi_tensor_apply). Tests cross this boundary.
constexpr int64_t kChunkElems = 65536;

using FVec = at::vec::Vectorized<float>;
// Elements handled per vector step: two fp32 vectors, i.e. one vector of 16-bit values.
constexpr int64_t kStep = 2 * FVec::size();

using checks::is_supported_dtype;

// Index of a supported dtype in the kernel tables: fp32 0, fp16 1, bf16 2.
inline int dtype_index(at::ScalarType t) {
  return t == at::kFloat ? 0 : (t == at::kHalf ? 1 : 2);
}

// Contiguous stand-ins for a list: the list itself when every tensor is contiguous (the common
// case costs one scan), else contiguous copies (for tensors that are read) or fresh buffers (for
// tensors that are only written) in place of the non-contiguous ones. write_back() copies the
// stand-ins' values into the original non-contiguous tensors. Staging runs below autograd, like
// the kernel itself, so parameters that require grad can be written (the caller holds no_grad).
class ContiguousList {
 public:
  enum class Use { kRead, kWrite };

  ContiguousList(at::TensorList tensors, Use use) : original_(tensors) {
    const bool all_contiguous = std::all_of(tensors.begin(), tensors.end(),
                                            [](const at::Tensor& t) { return t.is_contiguous(); });
    if (all_contiguous) return;
    c10::impl::ExcludeDispatchKeyGuard below_autograd(
        c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    staged_.reserve(tensors.size());
    for (const at::Tensor& t : tensors) {
      if (t.is_contiguous()) {
        staged_.push_back(t);
      } else if (use == Use::kRead) {
        staged_.push_back(t.contiguous());
      } else {
        staged_.push_back(at::empty(t.sizes(), t.options()));
      }
    }
  }

  // A list the caller knows to be contiguous (it has just scanned it): nothing to stage.
  explicit ContiguousList(at::TensorList contiguous) : original_(contiguous) {}

  at::TensorList list() const { return staged_.empty() ? original_ : at::TensorList(staged_); }

  void write_back() const {
    if (staged_.empty()) return;
    c10::impl::ExcludeDispatchKeyGuard below_autograd(
        c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    for (size_t i = 0; i < staged_.size(); ++i) {
      if (!original_[i].is_contiguous()) original_[i].copy_(staged_[i]);
    }
  }

 private:
  at::TensorList original_;
  std::vector<at::Tensor> staged_;
};

// found_inf, inv_scale and the like: one fp32 value on the CPU, which the kernels read and write
// through data_ptr on the host. (The dispatcher sends a call to the CPU kernels only when all of
// its tensors are CPU tensors; this keeps the host pointer safe whatever the caller.)
inline void check_scalar_tensor(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.numel() == 1 && t.scalar_type() == at::kFloat && t.device().is_cpu(),
              "apex_lite::", op, ": ", name, " must be a 1-element float32 CPU tensor, got ",
              t.numel(), " elements of ", t.scalar_type(), " on ", t.device());
}

inline void check_found_inf(const char* op, const at::Tensor& found_inf) {
  check_scalar_tensor(op, "found_inf", found_inf);
}

inline float read_scalar(const at::Tensor& t) { return *t.data_ptr<float>(); }

// Sets found_inf to 1 (never 0): the caller zeroes it, so one flag collects several calls.
inline void raise_found_inf(const at::Tensor& found_inf) {
  *found_inf.data_ptr<float>() = 1.0f;
}

// offsets[i] is the first element of tensor i in the call's index space; offsets[n] the total.
inline std::vector<int64_t> element_offsets(at::TensorList tensors) {
  std::vector<int64_t> offsets(tensors.size() + 1);
  offsets[0] = 0;
  for (size_t i = 0; i < tensors.size(); ++i) offsets[i + 1] = offsets[i] + tensors[i].numel();
  return offsets;
}

inline int64_t chunk_count(int64_t total) { return (total + kChunkElems - 1) / kChunkElems; }

// Calls segment_fn(tensor, begin, length) for every non-empty piece of every tensor that lies in
// chunks [chunk_begin, chunk_end), in index order; begin is an element offset inside the tensor.
template <typename SegmentFn>
inline void for_each_segment(const std::vector<int64_t>& offsets, int64_t chunk_begin,
                             int64_t chunk_end, SegmentFn&& segment_fn) {
  const int64_t total = offsets.back();
  int64_t pos = chunk_begin * kChunkElems;
  const int64_t end = std::min(chunk_end * kChunkElems, total);
  if (pos >= end) return;
  // The last tensor whose first element is <= pos; empty tensors share offsets and are skipped.
  int64_t t = std::upper_bound(offsets.begin(), offsets.end(), pos) - offsets.begin() - 1;
  while (pos < end) {
    const int64_t piece_end = std::min({end, offsets[t + 1], (pos / kChunkElems + 1) * kChunkElems});
    if (piece_end > pos) {
      segment_fn(t, pos - offsets[t], piece_end - pos);
      pos = piece_end;
    }
    if (pos == offsets[t + 1]) ++t;
  }
}

// Where each chunk's segments start in a flat per-segment array (size chunks + 1), so that a
// reduction can write one partial per segment from any thread and combine them in index order.
inline std::vector<int64_t> segment_starts(const std::vector<int64_t>& offsets) {
  const int64_t chunks = chunk_count(offsets.back());
  std::vector<int64_t> starts(chunks + 1, 0);
  int64_t count = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    starts[c] = count;
    for_each_segment(offsets, c, c + 1, [&](int64_t, int64_t, int64_t) { ++count; });
  }
  starts[chunks] = count;
  return starts;
}

// fp32 view of kStep elements of any supported storage type.
template <typename T>
inline void load_fp32(const T* src, FVec& lo, FVec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo = FVec::loadu(src);
    hi = FVec::loadu(src + FVec::size());
  } else {
    at::vec::load_to_float<T>(src, lo, hi);
  }
}

// Rounds kStep fp32 values once to T (round to nearest even) and stores them.
template <typename T>
inline void store_from_fp32(T* dst, const FVec& lo, const FVec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo.store(dst);
    hi.store(dst + FVec::size());
  } else {
    at::vec::convert_from_float<T>(lo, hi).store(dst);
  }
}

// x * 0 is +-0 for finite x and NaN for inf or NaN, so a running sum of x * 0 is NaN exactly
// when some x was not finite: one multiply and one add per vector, no branch in the loop.
inline FVec nonfinite_probe(const FVec& x) { return x * FVec(0.0f); }

// The probes run in two independent accumulators so that the add chain does not bound the loop.
inline bool probe_saw_nonfinite(const FVec& acc_lo, const FVec& acc_hi, float scalar_acc) {
  __at_align__ float lanes[FVec::size()];
  (acc_lo + acc_hi).store(lanes);
  bool bad = scalar_acc != scalar_acc;
  for (int64_t i = 0; i < FVec::size(); ++i) bad |= lanes[i] != lanes[i];
  return bad;
}

// Runs segment_fn(tensor, begin, length) over all segments of the call in one parallel region
// over chunks.
template <typename SegmentFn>
inline void parallel_segments(const std::vector<int64_t>& offsets, SegmentFn&& segment_fn) {
  const int64_t chunks = chunk_count(offsets.back());
  if (chunks == 0) return;
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for_each_segment(offsets, chunk_begin, chunk_end, segment_fn);
  });
}

// As parallel_segments, for segment_fn that returns true when it saw a non-finite input.
// Returns true when any segment did.
template <typename SegmentFn>
inline bool parallel_over_segments(const std::vector<int64_t>& offsets, SegmentFn&& segment_fn) {
  std::atomic<bool> saw_nonfinite{false};
  parallel_segments(offsets, [&](int64_t t, int64_t begin, int64_t length) {
    if (segment_fn(t, begin, length)) saw_nonfinite.store(true, std::memory_order_relaxed);
  });
  return saw_nonfinite.load();
}

// As parallel_segments, with the segment's index in the call (starts from segment_starts) passed
// first: segment_fn(segment, tensor, begin, length). A reduction writes one partial per segment
// and combines them in index order afterwards, so its result does not depend on the threads.
template <typename SegmentFn>
inline void parallel_indexed_segments(const std::vector<int64_t>& offsets,
                                      const std::vector<int64_t>& starts,
                                      SegmentFn&& segment_fn) {
  const int64_t chunks = static_cast<int64_t>(starts.size()) - 1;
  if (chunks <= 0) return;
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      int64_t segment = starts[c];
      for_each_segment(offsets, c, c + 1, [&](int64_t t, int64_t begin, int64_t length) {
        segment_fn(segment++, t, begin, length);
      });
    }
  });
}

// The tensor each segment belongs to, in segment order (as parallel_indexed_segments numbers
// them).
inline std::vector<int64_t> segment_owners(const std::vector<int64_t>& offsets,
                                           const std::vector<int64_t>& starts) {
  std::vector<int64_t> owners(starts.back());
  int64_t segment = 0;
  for_each_segment(offsets, 0, static_cast<int64_t>(starts.size()) - 1,
                   [&](int64_t t, int64_t, int64_t) { owners[segment++] = t; });
  return owners;
}

// Per-tensor totals of per-segment partials, added in segment order.
inline std::vector<double> per_tensor_totals(const std::vector<double>& partials,
                                             const std::vector<int64_t>& owners,
                                             size_t tensors) {
  std::vector<double> totals(tensors, 0.0);
  for (size_t s = 0; s < partials.size(); ++s) totals[owners[s]] += partials[s];
  return totals;
}

// Elements whose squares are summed in fp32 before the sum is folded into a double.
constexpr int64_t kSquareBlockElems = 2048;

// Sum of the squares of a run of fp32 values, reproducible: within a block of kSquareBlockElems
// consecutive elements the squares are summed in fp32 (full vectors in two vector accumulators,
// the run's last elements one by one), and the block sums in double. The caller calls
// end_block() after each block; the order depends only on the run's length.
class SquareSum {
 public:
  void add(const FVec& lo, const FVec& hi) {
    lo_ = lo_ + lo * lo;
    hi_ = hi_ + hi * hi;
  }
  void add(float x) { tail_ += x * x; }
  void end_block() {
    __at_align__ float lanes[FVec::size()];
    (lo_ + hi_).store(lanes);
    float block = 0.0f;
    for (int64_t k = 0; k < FVec::size(); ++k) block += lanes[k];
    total_ += static_cast<double>(block + tail_);
    lo_ = FVec(0.0f);
    hi_ = FVec(0.0f);
    tail_ = 0.0f;
  }
  double total() const { return total_; }

 private:
  FVec lo_{0.0f};
  FVec hi_{0.0f};
  float tail_ = 0.0f;
  double total_ = 0.0;
};

static_assert(kSquareBlockElems % kStep == 0, "only a run's last block may end in single elements");

// Walks [0, n) block by block for a SquareSum: vector_fn(i) for each run of kStep elements from
// i, scalar_fn(i) for each element left over, end_block() after each block.
template <typename VectorFn, typename ScalarFn, typename EndBlockFn>
inline void for_each_square_block(int64_t n, VectorFn&& vector_fn, ScalarFn&& scalar_fn,
                                  EndBlockFn&& end_block) {
  int64_t i = 0;
  while (i < n) {
    const int64_t block_end = std::min(n, i + kSquareBlockElems);
    for (; i + kStep <= block_end; i += kStep) vector_fn(i);
    for (; i < block_end; ++i) scalar_fn(i);
    end_block();
  }
}

// The four dtype-specialised elementwise kernels. Each returns true when an input was not finite.

// out = round(float(x) * s)
template <typename In, typename Out>
bool scale_segment(const void* in_base, void* out_base, int64_t begin, int64_t n, float s) {
  const In* x = static_cast<const In*>(in_base) + begin;
  Out* out = static_cast<Out*>(out_base) + begin;
  const FVec vs(s);
  FVec probe_lo(0.0f), probe_hi(0.0f);
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    FVec lo, hi;
    load_fp32(x + i, lo, hi);
    probe_lo = probe_lo + nonfinite_probe(lo);
    probe_hi = probe_hi + nonfinite_probe(hi);
    store_from_fp32(out + i, lo * vs, hi * vs);
  }
  float scalar_probe = 0.0f;
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    scalar_probe += v * 0.0f;
    out[i] = static_cast<Out>(v * s);
  }
  return probe_saw_nonfinite(probe_lo, probe_hi, scalar_probe);
}

// out = round(float(a) * float(x) + float(b) * float(y)): two products, one sum, no FMA.
template <typename X, typename Y, typename Out>
bool axpby_segment(const void* x_base, const void* y_base, void* out_base, int64_t begin,
                   int64_t n, float a, float b) {
  const X* x = static_cast<const X*>(x_base) + begin;
  const Y* y = static_cast<const Y*>(y_base) + begin;
  Out* out = static_cast<Out*>(out_base) + begin;
  const FVec va(a), vb(b);
  FVec probe_lo(0.0f), probe_hi(0.0f);
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    FVec x_lo, x_hi, y_lo, y_hi;
    load_fp32(x + i, x_lo, x_hi);
    load_fp32(y + i, y_lo, y_hi);
    probe_lo = probe_lo + (nonfinite_probe(x_lo) + nonfinite_probe(y_lo));
    probe_hi = probe_hi + (nonfinite_probe(x_hi) + nonfinite_probe(y_hi));
    const FVec ax_lo = va * x_lo, ax_hi = va * x_hi;
    const FVec by_lo = vb * y_lo, by_hi = vb * y_hi;
    store_from_fp32(out + i, ax_lo + by_lo, ax_hi + by_hi);
  }
  float scalar_probe = 0.0f;
  for (; i < n; ++i) {
    const float xv = static_cast<float>(x[i]);
    const float yv = static_cast<float>(y[i]);
    scalar_probe += xv * 0.0f + yv * 0.0f;
    const float ax = a * xv;
    const float by = b * yv;
    out[i] = static_cast<Out>(ax + by);
  }
  return probe_saw_nonfinite(probe_lo, probe_hi, scalar_probe);
}

using ScaleSegmentFn = bool (*)(const void*, void*, int64_t, int64_t, float);
using AxpbySegmentFn = bool (*)(const void*, const void*, void*, int64_t, int64_t, float, float);

// scale_segment for (input dtype, output dtype), indexed by dtype_index.
inline ScaleSegmentFn scale_kernel_for(at::ScalarType in, at::ScalarType out) {
  using at::BFloat16;
  using at::Half;
  static constexpr ScaleSegmentFn table[3][3] = {
      {scale_segment<float, float>, scale_segment<float, Half>, scale_segment<float, BFloat16>},
      {scale_segment<Half, float>, scale_segment<Half, Half>, scale_segment<Half, BFloat16>},
      {scale_segment<BFloat16, float>, scale_segment<BFloat16, Half>,
       scale_segment<BFloat16, BFloat16>}};
  return table[dtype_index(in)][dtype_index(out)];
}

template <typename X, typename Y>
struct AxpbyRow {
  static constexpr AxpbySegmentFn fns[3] = {axpby_segment<X, Y, float>,
                                            axpby_segment<X, Y, at::Half>,
                                            axpby_segment<X, Y, at::BFloat16>};
};

// axpby_segment for (x dtype, y dtype, output dtype), indexed by dtype_index.
inline AxpbySegmentFn axpby_kernel_for(at::ScalarType x, at::ScalarType y, at::ScalarType out) {
  using at::BFloat16;
  using at::Half;
  static constexpr const AxpbySegmentFn* table[3][3] = {
      {AxpbyRow<float, float>::fns, AxpbyRow<float, Half>::fns, AxpbyRow<float, BFloat16>::fns},
      {AxpbyRow<Half, float>::fns, AxpbyRow<Half, Half>::fns, AxpbyRow<Half, BFloat16>::fns},
      {AxpbyRow<BFloat16, float>::fns, AxpbyRow<BFloat16, Half>::fns,
       AxpbyRow<BFloat16, BFloat16>::fns}};
  return table[dtype_index(x)][dtype_index(y)][dtype_index(out)];
}

// The elementwise pass shared by scale_ and scale_out over contiguous lists (outputs may be the
// inputs): outputs[i] = round(float(inputs[i]) * s). Returns whether an input was not finite.
inline bool scale_pass(at::TensorList inputs, at::TensorList outputs, float s) {
  const auto offsets = element_offsets(inputs);
  std::vector<ScaleSegmentFn> kernels(inputs.size());
  std::vector<const void*> in_data(inputs.size());
  std::vector<void*> out_data(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    kernels[i] = scale_kernel_for(inputs[i].scalar_type(), outputs[i].scalar_type());
    in_data[i] = inputs[i].data_ptr();
    out_data[i] = outputs[i].data_ptr();
  }
  return parallel_over_segments(offsets, [&](int64_t t, int64_t begin, int64_t length) {
    return kernels[t](in_data[t], out_data[t], begin, length, s);
  });
}

// The elementwise pass shared by axpby_ and axpby_out over contiguous lists (outputs may be ys):
// outputs[i] = round(a * float(xs[i]) + b * float(ys[i])). Returns whether an x or y was not
// finite.
inline bool axpby_pass(at::TensorList xs, at::TensorList ys, at::TensorList outputs, float a,
                       float b) {
  const auto offsets = element_offsets(xs);
  std::vector<AxpbySegmentFn> kernels(xs.size());
  std::vector<const void*> x_data(xs.size());
  std::vector<const void*> y_data(xs.size());
  std::vector<void*> out_data(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    kernels[i] = axpby_kernel_for(xs[i].scalar_type(), ys[i].scalar_type(),
                                  outputs[i].scalar_type());
    x_data[i] = xs[i].data_ptr();
    y_data[i] = ys[i].data_ptr();
    out_data[i] = outputs[i].data_ptr();
  }
  return parallel_over_segments(offsets, [&](int64_t t, int64_t begin, int64_t length) {
    return kernels[t](x_data[t], y_data[t], out_data[t], begin, length, a, b);
  });
}

}  // namespace cpu
}  // namespace apex_lite
