// Shared by the CPU fused optimizer steps (fused_sgd.cpp, fused_adam.cpp, fused_lamb.cpp, ...),
// beside the rules of their tensors and the checks made of them (fused_optimizer_checks.h): the
// host-side reads of the 1-element tensors, the per-segment driver that loads parameters and
// gradients in fp32 and rounds each result once into the parameter and the model parameter, the
// plan of a call read in one scan over its lists before anything is written (PlannedCall, which
// tests the same rules), and the Adam arithmetic that Adam and LAMB share.
//
// The per-element arithmetic is the contract spelled out in apex_lite/multi_tensor/_python.py:
// every operation rounds once to fp32 (at::vec's operators are single IEEE instructions, sqrt
// included, and the build's -ffp-contract=off forbids fused multiply-adds), hyper-parameters are
// converted from double to fp32 once. Each element function is written once over V, which is
// FVec for the vector body of a segment and float for its last elements, so the two paths
// compute the same bits.
#pragma once

#include "fused_optimizer_checks.h"
#include "multi_tensor_cpu.h"
#include "../plain_tensor.h"

#include <cmath>
#include <array>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace apex_lite {
namespace cpu {

// How many tensors ahead the scans over a call's tensor metadata ask for what they will read.
// Each of thousands of small tensors has its TensorImpl and StorageImpl somewhere on the heap,
// out of cache after the previous step's pass; fetched ahead, the misses overlap.
constexpr size_t kMetadataAhead = 8;

// The lines of a TensorImpl that the checks read (sizes, dtype, device, contiguity).
inline void prefetch_tensor_impl(const at::Tensor& t) {
  const auto impl = reinterpret_cast<uintptr_t>(t.unsafeGetTensorImpl());
  for (uintptr_t offset = 0; offset < 256; offset += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(impl + offset));
  }
}

// The StorageImpl that data_ptr() reads (the TensorImpl is in cache by then).
inline void prefetch_storage_impl(const at::Tensor& t) {
  __builtin_prefetch(t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl());
}

// ---- step counts --------------------------------------------------------------------------

// 1 / (1 - beta1**count) and 1 / sqrt(1 - beta2**count) for the step a tensor is about to take:
// reciprocals, so that an element costs one division rather than three.
struct BiasCorrection {
  float inv_bc1 = 1.0f;
  float inv_sqrt_bc2 = 1.0f;
};

// ---- storage types ------------------------------------------------------------------------

template <typename T>
struct StorageType {
  using type = T;
};

// fn(StorageType<T>{}) for the storage type T of a supported dtype: float, at::Half, at::BFloat16.
template <typename Fn>
inline decltype(auto) visit_storage_type(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kHalf:
      return fn(StorageType<at::Half>{});
    case at::kBFloat16:
      return fn(StorageType<at::BFloat16>{});
    default:
      return fn(StorageType<float>{});
  }
}

// As visit_storage_type, for a tensor that may be absent (at::ScalarType::Undefined: T is void).
template <typename Fn>
inline decltype(auto) visit_optional_storage_type(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::ScalarType::Undefined) return fn(StorageType<void>{});
  return visit_storage_type(dtype, fn);
}

// The dtypes of one parameter's tensors, which choose the kernel that steps it.
struct StepTypes {
  at::ScalarType param;
  at::ScalarType grad;
  at::ScalarType model;  // at::ScalarType::Undefined: no model parameter
};

// The dtype of an optional model parameter (nullptr: at::ScalarType::Undefined).
inline at::ScalarType model_dtype(const at::Tensor* model) {
  return model == nullptr ? at::ScalarType::Undefined : model->scalar_type();
}

// Kernel<P, G, M>::run for a parameter's, its gradient's and its model parameter's storage types
// (no model parameter: M is void).
template <template <typename, typename, typename> class Kernel>
inline auto step_kernel_for(const StepTypes& types) {
  return visit_storage_type(types.param, [&](auto p) {
    return visit_storage_type(types.grad, [&](auto g) {
      return visit_optional_storage_type(types.model, [&](auto m) {
        return &Kernel<typename decltype(p)::type, typename decltype(g)::type,
                       typename decltype(m)::type>::run;
      });
    });
  });
}

// ---- a call's plan --------------------------------------------------------------------------

// The tensor lists of a fused optimizer call: params, grads and models (empty, or one model
// parameter per parameter) of fp32, fp16 or bf16; up to two lists of fp32 state shaped like the
// parameters; and for the Adam-like ops (counted) one step count per parameter, a 1-element fp32
// tensor.
struct StepLists {
  at::TensorList params, grads, models;
  std::array<at::TensorList, 2> state{};
  size_t state_lists = 0;
  at::TensorList steps;
  bool counted = false;
  // false where the counts are read and never written (fused_lamb_mp_'s one count for every
  // parameter): only written counts must be each parameter's own.
  bool own_counts = true;
};

// Where one parameter's tensors are, as the scan read them for the Planner's entry.
struct ParamData {
  void* param;
  const void* grad;
  void* model;                  // nullptr: no model parameter
  std::array<float*, 2> state;  // one per state list; nullptr past StepLists::state_lists
  float* count;                 // nullptr: the call is not counted
};

// A fused optimizer call checked and planned before anything is written: per parameter the
// Planner's Entry (where its tensors are and what else its kernel takes), its dtypes, and its
// first element in the call's index space, all read in one scan over the lists.
//
// With thousands of small tensors the scan is the step's serial part, and its cost is per
// tensor: the TensorImpls and StorageImpls that the previous step's pass pushed out of cache
// (about four lines per tensor, on pages whose TLB entries the pass likely evicted too), and
// the reading itself. When every tensor is plain (plain_tensor.h), contiguous and follows the
// rules (the common case) the scan reads the TensorImpls' fields directly, on all threads,
// each over its own range of parameters with the lines it will read asked for ahead, so that
// the misses of both cores overlap. Otherwise the op's own checks run, raising the first
// failure's error, and a call that passes them (it has non-contiguous or non-plain tensors) is
// planned serially through TensorBase's accessors, over contiguous stand-ins that write_back()
// copies into the originals.
//
// O2 AdamW, 4000 parameters, 2-core CPU, right after a step: a skipped step (the scan, and the
// held lists' gathering of the gradients) takes 0.85 ms, and 1.0 ms through TensorBase's
// accessors (medians of 150, in one process); each thread's scan takes 250-300 us with the
// metadata in cache and 820-850 us after a step. Asking for the lines 4 to 32 parameters ahead,
// or not at all, moves the skipped step by under 0.05 ms: the cores overlap the misses about as
// well by themselves.
//
// Planner: `Entry entry(const ParamData&, Cache&) const`, with one Cache per scanning task
// (Adam: the bias corrections of the last count seen).
template <typename Planner>
class PlannedCall {
 public:
  using Entry = typename Planner::Entry;

  // check(): the op's own checks of its lists, which raise the first failure's error and return
  // for a call that is merely non-contiguous; run when the scan finds anything unusual, or at
  // once when scan is false (the caller saw a list-level problem the scan does not look for).
  // Then, either way, a counted call's step counts are checked to be each parameter's own
  // (checks::check_own_step_counts, over the addresses the plan read), and inv_scale and
  // found_inf last.
  template <typename Check>
  PlannedCall(const char* op, const StepLists& lists, const at::Tensor& inv_scale,
              const at::Tensor& found_inf, Planner planner, Check&& check, bool scan = true)
      : planner_(std::move(planner)) {
    if (!scan || !plan_if_plain(op, lists)) {
      check();
      plan_staged(lists);
    }
    if (lists.counted && lists.own_counts) {
      checks::check_own_step_counts(op, counts_.size(), c10::Device(c10::kCPU), [&](size_t i) {
        return reinterpret_cast<uintptr_t>(counts_[i]);
      });
    }
    check_scalar_tensor(op, "inv_scale", inv_scale);
    check_found_inf(op, found_inf);
  }

  size_t size() const { return entries_.size(); }
  const Planner& planner() const { return planner_; }
  const std::vector<Entry>& entries() const { return entries_; }
  std::vector<Entry>& entries() { return entries_; }
  const std::vector<StepTypes>& types() const { return types_; }
  // offsets()[i]: the first element of parameter i in the call's index space; back(): the total.
  const std::vector<int64_t>& offsets() const { return offsets_; }

  // Copies the results into the non-contiguous originals (parameters, state, model
  // parameters); nothing to do in the common case.
  void write_back() const {
    for (const ContiguousList& list : written_) list.write_back();
  }

 private:
  // Parameters per task of the parallel scan.
  static constexpr int64_t kScanGrain = 128;

  void resize(size_t n, bool counted) {
    entries_.resize(n);
    types_.resize(n);
    offsets_.assign(n + 1, 0);
    counts_.resize(counted ? n : 0);
  }

  void sum_offsets() {
    for (size_t i = 0; i < entries_.size(); ++i) offsets_[i + 1] += offsets_[i];
  }

  // The scan of the common case. False (the plan is then incomplete and is redone) when a list
  // has the wrong length, or a tensor is not plain, breaks a rule or is not contiguous.
  bool plan_if_plain(const char* op, const StepLists& l) {
    const size_t n = l.params.size();
    const Refuse refuse;
    bool lengths = one_per_param(op, "grads", l.grads.size(), n, "", refuse) &&
                   models_length_ok(op, l.models.size(), n, refuse) &&
                   (!l.counted || one_per_param(op, "steps", l.steps.size(), n, kStepsFix, refuse));
    for (size_t s = 0; s < l.state_lists; ++s) {
      lengths = lengths && one_per_param(op, "state", l.state[s].size(), n, "", refuse);
    }
    if (!lengths) return false;
    resize(n, l.counted);
    std::atomic<bool> passed{true};
    at::parallel_for(0, static_cast<int64_t>(n), kScanGrain, [&](int64_t begin, int64_t end) {
      const size_t last = static_cast<size_t>(end);
      typename Planner::Cache cache;
      for (size_t i = static_cast<size_t>(begin); i < last; ++i) {
        prefetch_ahead(l, i, last);
        ParamData data;
        if (!read_plain(op, l, i, data)) {
          passed.store(false, std::memory_order_relaxed);
          return;
        }
        if ((i & 63) == 0 && !passed.load(std::memory_order_relaxed)) return;
        entries_[i] = planner_.entry(data, cache);
      }
    });
    if (!passed.load()) return false;
    sum_offsets();
    return true;
  }

  // Parameter i's data, dtypes (types_[i]) and element count (offsets_[i + 1], summed by
  // sum_offsets) read from the TensorImpls' fields; false when one of its tensors is not plain,
  // not contiguous, or breaks a rule (the rules of the checks, with Refuse: the list names are
  // those of the messages, which are not built).
  bool read_plain(const char* op, const StepLists& l, size_t i, ParamData& data) {
    using plain::data_of;
    const Refuse refuse;
    const c10::TensorImpl& param = *l.params[i].unsafeGetTensorImpl();
    const at::IntArrayRef sizes = param.sizes();
    // The scan's own conditions: a plain, contiguous CPU tensor (the others are staged).
    const auto plain_contiguous = [](const c10::TensorImpl& t) {
      return plain::is_plain(t, c10::DispatchKey::CPU) && t.is_contiguous();
    };
    // A stepped tensor (a gradient, a model parameter) aligned with the parameter.
    const auto stepped = [&](const char* name, const c10::TensorImpl& t, at::ScalarType& dtype) {
      if (!plain_contiguous(t) || !shaped_like_param(op, name, i, t, sizes, refuse) ||
          !stepped_tensor_ok(op, name, i, t, refuse)) {
        return false;
      }
      dtype = c10::typeMetaToScalarType(t.dtype());
      return true;
    };
    StepTypes& types = types_[i];
    if (!plain_contiguous(param) || !stepped_tensor_ok(op, "params", i, param, refuse) ||
        !data_of<true>(param, data.param)) {
      return false;
    }
    types.param = c10::typeMetaToScalarType(param.dtype());
    const c10::TensorImpl& grad = *l.grads[i].unsafeGetTensorImpl();
    if (!stepped("grads", grad, types.grad) || !data_of<false>(grad, data.grad)) return false;
    types.model = at::ScalarType::Undefined;
    data.model = nullptr;
    if (!l.models.empty()) {
      const c10::TensorImpl& model = *l.models[i].unsafeGetTensorImpl();
      if (!stepped("model_params", model, types.model) || !data_of<true>(model, data.model)) {
        return false;
      }
    }
    data.state = {nullptr, nullptr};
    for (size_t s = 0; s < l.state_lists; ++s) {
      const c10::TensorImpl& state = *l.state[s][i].unsafeGetTensorImpl();
      void* state_data = nullptr;
      if (!plain_contiguous(state) || !shaped_like_param(op, "state", i, state, sizes, refuse) ||
          !state_tensor_ok(op, "state", i, state, refuse) || !data_of<true>(state, state_data)) {
        return false;
      }
      data.state[s] = static_cast<float*>(state_data);
    }
    data.count = nullptr;
    if (l.counted) {
      const c10::TensorImpl& step = *l.steps[i].unsafeGetTensorImpl();
      void* count = nullptr;
      if (!plain::is_plain(step, c10::DispatchKey::CPU) || !step_count_ok(op, i, step, refuse) ||
          !data_of<true>(step, count)) {
        return false;
      }
      data.count = static_cast<float*>(count);
      counts_[i] = data.count;
    }
    offsets_[i + 1] = param.numel();
    return true;
  }

  // Parameter i's data, dtypes and element count read through TensorBase's accessors, for lists
  // the op's checks have passed.
  void read_checked(const StepLists& l, size_t i, ParamData& data) {
    const at::Tensor* model = l.models.empty() ? nullptr : &l.models[i];
    data.param = l.params[i].data_ptr();
    data.grad = l.grads[i].const_data_ptr();
    data.model = model == nullptr ? nullptr : model->data_ptr();
    data.state = {nullptr, nullptr};
    for (size_t s = 0; s < l.state_lists; ++s) data.state[s] = l.state[s][i].data_ptr<float>();
    data.count = l.counted ? l.steps[i].data_ptr<float>() : nullptr;
    if (l.counted) counts_[i] = data.count;
    types_[i] = StepTypes{l.params[i].scalar_type(), l.grads[i].scalar_type(), model_dtype(model)};
    offsets_[i + 1] = l.params[i].numel();
  }

  // The other case, once the checks have passed: contiguous stand-ins for the non-contiguous
  // tensors, planned serially.
  void plan_staged(const StepLists& l) {
    using Use = ContiguousList::Use;
    read_.emplace_back(l.grads, Use::kRead);
    written_.reserve(2 + l.state_lists);
    written_.emplace_back(l.params, Use::kRead);
    written_.emplace_back(l.models, Use::kWrite);
    for (size_t s = 0; s < l.state_lists; ++s) written_.emplace_back(l.state[s], Use::kRead);
    StepLists staged = l;
    staged.grads = read_[0].list();
    staged.params = written_[0].list();
    staged.models = written_[1].list();
    for (size_t s = 0; s < l.state_lists; ++s) staged.state[s] = written_[2 + s].list();
    resize(staged.params.size(), l.counted);
    typename Planner::Cache cache;
    for (size_t i = 0; i < staged.params.size(); ++i) {
      ParamData data;
      read_checked(staged, i, data);
      entries_[i] = planner_.entry(data, cache);
    }
    sum_offsets();
  }

  // Asks for what the scan will read of the parameters ahead of i (in [i, end)): the TensorImpls
  // 2 * kMetadataAhead ahead, their StorageImpls kMetadataAhead ahead (the TensorImpl arrived by
  // then). Not the counts' data, which needs its StorageImpl read first: through
  // const_data_ptr() that was a virtual call and a demand load per parameter, for no gain (a
  // skipped 4000-parameter step after a step, three runs in one process each: 0.97-1.21 ms with
  // it, 0.99-1.22 ms without).
  static void prefetch_ahead(const StepLists& l, size_t i, size_t end) {
    const auto each_list = [&](auto&& fn) {
      fn(l.params);
      fn(l.grads);
      if (!l.models.empty()) fn(l.models);
      for (size_t s = 0; s < l.state_lists; ++s) fn(l.state[s]);
      if (l.counted) fn(l.steps);
    };
    if (i + 2 * kMetadataAhead < end) {
      each_list([&](at::TensorList list) { prefetch_tensor_impl(list[i + 2 * kMetadataAhead]); });
    }
    if (i + kMetadataAhead < end) {
      each_list([&](at::TensorList list) { prefetch_storage_impl(list[i + kMetadataAhead]); });
    }
  }

  Planner planner_;
  std::vector<Entry> entries_;
  std::vector<StepTypes> types_;
  std::vector<int64_t> offsets_;
  // Where each parameter's step count is (counted calls; empty otherwise).
  std::vector<float*> counts_;
  // Stand-ins of the non-contiguous case (empty otherwise): read_ (grads) and written_ (params,
  // model_params, then the state lists).
  std::vector<ContiguousList> read_, written_;
};

// &base[index] as a T*, or nullptr when T is void (an absent tensor).
template <typename T>
inline T* element_ptr(void* base, int64_t index) {
  if constexpr (std::is_void_v<T>) {
    return nullptr;
  } else {
    return static_cast<T*>(base) + index;
  }
}

template <typename T>
inline const T* element_ptr(const void* base, int64_t index) {
  if constexpr (std::is_void_v<T>) {
    return nullptr;
  } else {
    return static_cast<const T*>(base) + index;
  }
}

// ---- the element loop -----------------------------------------------------------------------

// fp32 state at x: FVec::size() elements, or one.
template <typename V>
inline V load_state(const float* x) {
  if constexpr (std::is_same_v<V, FVec>) {
    return FVec::loadu(x);
  } else {
    return *x;
  }
}

inline void store_state(float* x, const FVec& value) { value.store(x); }
inline void store_state(float* x, float value) { *x = value; }

// Correctly rounded square roots (vsqrtps / sqrtss).
inline FVec sqrt_lanes(const FVec& x) { return x.sqrt(); }
inline float sqrt_lanes(float x) { return std::sqrt(x); }

// The driver of a step over the n elements of one segment: p = float(param[j]) and
// g = float(grad[j]) (G void: no gradient; g is 0 and unused), update(p, g, j) changes p, and p
// is rounded once into param[j] and, unless M is void, into model[j]. update is called with
// V = FVec for the FVec::size() elements from j, and with V = float for one element j (the
// segment's last elements).
template <typename P, typename G, typename M, typename UpdateFn>
inline void update_segment(P* param, const G* grad, M* model, int64_t n, UpdateFn&& update) {
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    FVec p_lo, p_hi;
    FVec g_lo(0.0f), g_hi(0.0f);
    load_fp32(param + i, p_lo, p_hi);
    if constexpr (!std::is_void_v<G>) load_fp32(grad + i, g_lo, g_hi);
    update(p_lo, g_lo, i);
    update(p_hi, g_hi, i + FVec::size());
    store_from_fp32(param + i, p_lo, p_hi);
    if constexpr (!std::is_void_v<M>) store_from_fp32(model + i, p_lo, p_hi);
  }
  for (; i < n; ++i) {
    float p = static_cast<float>(param[i]);
    float g = 0.0f;
    if constexpr (!std::is_void_v<G>) g = static_cast<float>(grad[i]);
    update(p, g, i);
    param[i] = static_cast<P>(p);
    if constexpr (!std::is_void_v<M>) model[i] = static_cast<M>(p);
  }
}

// ---- Adam (and LAMB) ----------------------------------------------------------------------

// A call's constants in fp32, as the reference rounds them.
struct AdamConstants {
  float inv_scale;
  float clip;  // LAMB's clip divisor (grad_norm / max_grad_norm)
  float beta1;
  float beta3;  // 1 - beta1 (in double, then fp32), or 1 for LAMB without grad averaging
  float beta2;
  float one_minus_beta2;
  float eps;
  float weight_decay;
  bool clip_grad;     // divide the true gradient by clip
  bool decay_grad;    // weight_decay != 0 and not adam_w_mode: g += weight_decay * p
  bool decay_update;  // weight_decay != 0 and adam_w_mode: update += weight_decay * p
};

inline AdamConstants adam_constants(const at::Tensor& inv_scale, double beta1, double beta3,
                                    double beta2, double eps, double weight_decay,
                                    bool adam_w_mode) {
  AdamConstants c;
  c.inv_scale = read_scalar(inv_scale);
  c.clip = 1.0f;
  c.beta1 = static_cast<float>(beta1);
  c.beta3 = static_cast<float>(beta3);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.weight_decay = static_cast<float>(weight_decay);
  c.clip_grad = false;
  c.decay_grad = weight_decay != 0.0 && !adam_w_mode;
  c.decay_update = weight_decay != 0.0 && adam_w_mode;
  return c;
}

// One parameter of an Adam-like call: where its tensors are (contiguous), its bias corrections
// and the factor of its update (lr, or LAMB's lr * trust ratio).
struct AdamTensor {
  void* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* model;  // nullptr: no model parameter
  BiasCorrection bias;
  float step_size;
  float* count;  // the step count, which AdamCall::count_step increments
};

// The direction from the updated moments: (m * inv_bc1) / (sqrt(v) * inv_sqrt_bc2 + eps), plus
// weight_decay * p in AdamW mode.
template <typename V>
inline V adam_direction(const AdamConstants& c, const BiasCorrection& bias, const V& p, const V& m,
                        const V& v) {
  V update = (m * V(bias.inv_bc1)) / (sqrt_lanes(v) * V(bias.inv_sqrt_bc2) + V(c.eps));
  if (c.decay_update) update = update + V(c.weight_decay) * p;
  return update;
}

// From float(grad) g: the true gradient (unscaled, clipped, L2-decayed), the moments updated in
// place at m and v, and the direction returned.
template <typename V>
inline V adam_moments_and_direction(const AdamConstants& c, const BiasCorrection& bias,
                                    const V& p, V g, float* m, float* v) {
  g = g * V(c.inv_scale);
  if (c.clip_grad) g = g / V(c.clip);
  if (c.decay_grad) g = g + V(c.weight_decay) * p;
  const V m_new = V(c.beta1) * load_state<V>(m) + V(c.beta3) * g;
  const V v_new = V(c.beta2) * load_state<V>(v) + (V(c.one_minus_beta2) * g) * g;
  store_state(m, m_new);
  store_state(v, v_new);
  return adam_direction(c, bias, p, m_new, v_new);
}

// p = p - step_size * direction over one segment of one parameter. With a gradient type G the
// moments are updated from the gradient first (Adam; LAMB without trust ratios); with G void
// the direction comes from the moments as stored (LAMB's second stage).
template <typename P, typename G, typename M>
struct AdamStep {
  static void run(const AdamConstants& constants, const AdamTensor& t, int64_t begin, int64_t n) {
    const AdamConstants c = constants;  // a local copy: the stores below cannot alias it
    const BiasCorrection bias = t.bias;
    const float step_size = t.step_size;
    float* m = t.exp_avg + begin;
    float* v = t.exp_avg_sq + begin;
    update_segment(element_ptr<P>(t.param, begin), element_ptr<G>(t.grad, begin),
                   element_ptr<M>(t.model, begin), n, [&](auto& p, auto g, int64_t j) {
                     using V = std::decay_t<decltype(p)>;
                     V update;
                     if constexpr (std::is_void_v<G>) {
                       update = adam_direction(c, bias, p, load_state<V>(m + j),
                                               load_state<V>(v + j));
                     } else {
                       update = adam_moments_and_direction(c, bias, p, g, m + j, v + j);
                     }
                     p = p - V(step_size) * update;
                   });
  }
};

using AdamStepFn = void (*)(const AdamConstants&, const AdamTensor&, int64_t, int64_t);

// The plan entries of an Adam-like call (fused_adam_, fused_lamb_): the bias corrections of
// each count + 1, in double then rounded to fp32 (all 1 without bias correction; tensors with
// the same count, the common case, share one pow), step_size as the factor, and the count that
// count_step() increments.
struct AdamPlanner {
  using Entry = AdamTensor;
  struct Cache {
    double count = std::numeric_limits<double>::quiet_NaN();
    BiasCorrection bias;
  };

  double beta1, beta2;
  bool bias_correction;
  float step_size;
  // The counts hold the number of the step being taken (fused_lamb_mp_'s group count, which the
  // caller increments), not the number of steps taken so far.
  bool counts_given = false;

  AdamTensor entry(const ParamData& d, Cache& cache) const {
    if (bias_correction) {
      const double next = static_cast<double>(*d.count) + (counts_given ? 0.0 : 1.0);
      if (next != cache.count) {
        cache.bias.inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(beta1, next)));
        cache.bias.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, next)));
        cache.count = next;
      }
    }
    return AdamTensor{d.param, d.grad, d.state[0], d.state[1], d.model, cache.bias, step_size,
                      d.count};
  }
};

// An Adam-like call checked and planned (PlannedCall): state lists exp_avgs and exp_avg_sqs, one
// count per parameter.
class AdamCall : public PlannedCall<AdamPlanner> {
 public:
  AdamCall(const char* op, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
           at::TensorList exp_avg_sqs, at::TensorList model_params, at::TensorList steps,
           const at::Tensor& inv_scale, const at::Tensor& found_inf, double beta1, double beta2,
           bool bias_correction, float step_size, bool counts_given = false)
      : PlannedCall(op,
                    StepLists{params, grads, model_params, {exp_avgs, exp_avg_sqs}, 2, steps, true,
                              !counts_given},
                    inv_scale, found_inf,
                    AdamPlanner{beta1, beta2, bias_correction, step_size, counts_given},
                    [&] {
                      check_step_args(op, params, grads, model_params, inv_scale, found_inf);
                      check_state_list(op, "exp_avgs", exp_avgs, params);
                      check_state_list(op, "exp_avg_sqs", exp_avg_sqs, params);
                      check_steps(op, steps, params);
                    }) {}

  // steps[i] += 1 in fp32 for every parameter (each its own count: PlannedCall refused shared
  // ones). Not for counts_given (fused_lamb_mp_'s one step tensor, which the caller increments).
  void count_step() const {
    for (const AdamTensor& t : entries()) *t.count += 1.0f;
  }
};

// Bytes at the start of each array of the next tensor that a thread asks for before it steps the
// current one (4000 tensors of 2500 elements, O2: 256 to 10240 bytes all took 0.7-1 ms off
// about 10.5 ms; 1024 as much as any).
constexpr int64_t kPrefetchHeadBytes = 1024;

// Small tensors are separate allocations, and the hardware prefetcher starts over at each array
// of each tensor: a few demand misses per array before it runs ahead again. Asking for the next
// tensor's first lines while the current one is stepped hides them. A prefetch never faults, so
// arrays shorter than that and absent ones (nullptr) are harmless.
// (Addresses as integers: the bytes past a short array are no object to point into.)
inline void prefetch_heads(const AdamTensor& t) {
  const void* arrays[] = {t.param, t.grad, t.exp_avg, t.exp_avg_sq, t.model};
  for (const void* a : arrays) {
    if (a == nullptr) continue;
    const auto start = reinterpret_cast<uintptr_t>(a);
    for (int64_t b = 0; b < kPrefetchHeadBytes; b += 64) {
      __builtin_prefetch(reinterpret_cast<const void*>(start + static_cast<uintptr_t>(b)));
    }
  }
}

// The one parallel pass of AdamStep<P, G, M> over every parameter of the call.
inline void adam_step_pass(const AdamConstants& c, const AdamCall& call) {
  const std::vector<AdamTensor>& tensors = call.entries();
  std::vector<AdamStepFn> kernels(call.size());
  for (size_t i = 0; i < call.size(); ++i) kernels[i] = step_kernel_for<AdamStep>(call.types()[i]);
  const int64_t n = static_cast<int64_t>(tensors.size());
  parallel_segments(call.offsets(), [&](int64_t t, int64_t begin, int64_t length) {
    if (begin == 0 && t + 1 < n) prefetch_heads(tensors[t + 1]);
    kernels[t](c, tensors[t], begin, length);
  });
}

}  // namespace cpu
}  // namespace apex_lite
