// torch.classes.apex_lite.GradWatch: whether the .grad of a list of tensors changed since it was
// recorded (the same gradient tensor, at the same version), without a host sync and without a
// Python call per tensor.
//
// Why: under amp's O2 the half model parameters' .grad still holds the gradients multiplied by
// the loss scale after scale_loss; the true ones are the fp32 masters'. An edit of a half
// gradient between scale_loss and step() (clip_grad_norm_ on model.parameters(), in-place
// arithmetic, a new .grad) would be applied to scaled values or ignored, so step() refuses it
// (apex_lite/amp/grad_edits.py). A tensor's version counter is bumped by every in-place op on it
// (and on its views) through autograd's ADInplaceOrView kernel; a host integer, read here. The
// Python backend's GradWatch (apex_lite/multi_tensor/_python.py) is the reference: same answers.
//
// record() keeps a reference to each gradient (so that a new tensor at a freed one's address
// cannot pass for it) until clear(); amp clears at step(), at zero_grad and before the next
// backward, so no gradient outlives the model's own reference to it for longer than that.
// Each gradient is three dependent reads away (the source's TensorImpl, its AutogradMeta, the
// gradient's TensorImpl) and its version a fourth (the shared version counter): they are asked
// for ahead of use so that the cache misses overlap, as in held_lists.cpp.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace apex_lite {
namespace {

using Tensors = std::vector<at::Tensor>;

class GradWatch : public torch::CustomClassHolder {
 public:
  explicit GradWatch(Tensors sources) : sources_(std::move(sources)) {}

  // Remember every source's .grad (undefined where it has none) and that gradient's version.
  void record() {
    const size_t n = sources_.size();
    grads_.assign(n, at::Tensor());
    versions_.assign(n, 0);
    for (size_t i = 0; i < n; ++i) {
      prefetch(i);
      const at::Tensor& g = sources_[i].grad();
      if (g.defined()) {
        grads_[i] = g;
        versions_[i] = version(g);
      }
    }
    recorded_ = true;
  }

  // The index of the first source whose .grad is a tensor other than the one recorded, or the
  // recorded one at another version; -1 when none (or nothing is recorded). A gradient set to
  // None since counts as cleared, not changed.
  int64_t changed() const {
    if (!recorded_) return -1;
    const size_t n = sources_.size();
    for (size_t i = 0; i < n; ++i) {
      prefetch(i);
      const at::Tensor& g = sources_[i].grad();
      if (!g.defined()) continue;
      if (!g.is_same(grads_[i]) || version(g) != versions_[i]) return static_cast<int64_t>(i);
    }
    return -1;
  }

  // The indices of the sources that had a .grad when recorded and have none now (empty when
  // none, or nothing is recorded). amp applies such a clearing as fp32 training would: the
  // parameter is not updated.
  std::vector<int64_t> cleared() const {
    std::vector<int64_t> out;
    if (!recorded_) return out;
    const size_t n = sources_.size();
    for (size_t i = 0; i < n; ++i) {
      prefetch(i);
      if (grads_[i].defined() && !sources_[i].grad().defined()) {
        out.push_back(static_cast<int64_t>(i));
      }
    }
    return out;
  }

  // Forget the record (and drop its references to the gradients).
  void clear() {
    grads_.clear();
    versions_.clear();
    recorded_ = false;
  }

 private:
  static constexpr size_t kAhead = 8;

  void prefetch(size_t i) const {
    const size_t n = sources_.size();
    if (i + 3 * kAhead < n) __builtin_prefetch(sources_[i + 3 * kAhead].unsafeGetTensorImpl());
    if (i + 2 * kAhead < n) {
      __builtin_prefetch(sources_[i + 2 * kAhead].unsafeGetTensorImpl()->autograd_meta());
    }
    if (i + kAhead < n) __builtin_prefetch(sources_[i + kAhead].grad().unsafeGetTensorImpl());
  }

  // An inference tensor has no version counter; a gradient never is one, but such a tensor
  // then reads as a version no record holds.
  static int64_t version(const at::Tensor& g) {
    if (g.is_inference()) return -1;
    return static_cast<int64_t>(g._version());
  }

  Tensors sources_;
  Tensors grads_;
  std::vector<int64_t> versions_;
  bool recorded_ = false;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(apex_lite, m) {
  m.class_<GradWatch>("GradWatch")
      .def(torch::init<Tensors>())
      .def("record", &GradWatch::record)
      .def("changed", &GradWatch::changed)
      .def("cleared", &GradWatch::cleared)
      .def("clear", &GradWatch::clear);
}

}  // namespace apex_lite
