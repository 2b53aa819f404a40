// Plain tensors: what a step's lists nearly always hold, and what can be read without
// TensorBase's accessors.
//
// A plain tensor is a dense tensor of one device whose only kernel key is its backend's: no
// tensor subclass (Python's key), no functionalization or other wrapper, no sparse, quantized,
// zero, negative or conjugate tensor. Its data is its storage's data at its storage offset, and
// its sizes, dtype and contiguity are fields of its TensorImpl.
//
// Why read the fields: TensorBase's accessors serve every kind of tensor, through virtual calls
// (has_storage, storage) and out-of-line checks (data_ptr<T>'s type check, sizes compared by a
// memcmp call). An O2 AdamW step over 4000 parameters reads 24000 tensors (each parameter's five
// and its count) in a scan that must finish before anything is written: a skipped step right
// after a step takes 1.0 ms through the accessors, 0.85 ms reading the fields (2-core CPU). A
// tensor that is not plain is read through the accessors instead, by the caller's slow path.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>

#include <cstdint>
#include <type_traits>

namespace apex_lite {
namespace plain {

// The keys of a key set that can choose an op's kernel below autograd: without the autograd
// keys and ADInplaceOrView (a step runs below them), the autocast keys and BackendSelect
// (fallthrough for ops, like apex_lite's, that register no kernel there).
inline c10::DispatchKeySet kernel_keys(c10::DispatchKeySet keys) {
  return keys - c10::autograd_dispatch_keyset_with_ADInplaceOrView -
         c10::autocast_dispatch_keyset - c10::DispatchKeySet(c10::DispatchKey::BackendSelect);
}

inline c10::DispatchKeySet kernel_keys(const at::Tensor& t) { return kernel_keys(t.key_set()); }

// Whether t is plain, on the device whose dense key is `backend` (c10::DispatchKey::CPU, CUDA).
inline bool is_plain(const c10::TensorImpl& t, c10::DispatchKey backend) {
  return kernel_keys(t.key_set()) == c10::DispatchKeySet(backend);
}

// a == b, without the memcmp call that ArrayRef's operator== makes for one or two sizes.
inline bool same_sizes(at::IntArrayRef a, at::IntArrayRef b) {
  if (a.size() != b.size()) return false;
  for (size_t d = 0; d < a.size(); ++d) {
    if (a[d] != b[d]) return false;
  }
  return true;
}

template <bool kWritable>
using DataPtr = std::conditional_t<kWritable, void*, const void*>;

// The address of element 0 of a plain tensor t, as t.data_ptr() (kWritable: the storage's
// mutable data, which first materialises a copy-on-write storage) or t.const_data_ptr() give it,
// and raising their errors for a storage that refuses the access; false when t has elements but
// no allocated data (the caller's slow path then raises the accessor's error).
template <bool kWritable>
inline bool data_of(const c10::TensorImpl& t, DataPtr<kWritable>& out) {
  c10::StorageImpl* storage = t.unsafe_storage().unsafeGetStorageImpl();
  if (storage == nullptr) return false;
  uintptr_t base;
  if constexpr (kWritable) {
    base = reinterpret_cast<uintptr_t>(storage->mutable_data());
  } else {
    base = reinterpret_cast<uintptr_t>(storage->data());
  }
  if (base == 0 && t.numel() != 0) return false;
  // As integers: a zero-size tensor's data may be null, with an offset.
  out = reinterpret_cast<DataPtr<kWritable>>(
      base + static_cast<uintptr_t>(t.storage_offset()) * t.dtype().itemsize());
  return true;
}

}  // namespace plain
}  // namespace apex_lite
