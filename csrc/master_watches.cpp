// Two host-side watches of amp's O2 masters, each one C++ loop per step instead of a Python
// statement per parameter (4000 parameters: about 1 ms of Python a step, against a 7 ms step).
// No host sync: they read only host state (which tensor a .grad is, version counters, flags).
// The Python backend's classes of the same names (apex_lite/multi_tensor/_watches.py) are the
// reference: same answers.
//
// torch.classes.apex_lite.LazyGradSlots (apex_lite/amp/master_grads.py): at the end of a
// scale_loss, the fused step gives each O2 master whose half model parameter has a gradient its
// LazyGrad (a tensor standing for the true fp32 gradient, made only when used), unless the
// master already holds another gradient, which the new one is added to; at step() it asks
// whether any master's .grad was since replaced, deleted or set to None by user code, which the
// step must then apply as the unfused step would.
//
// torch.classes.apex_lite.TensorWatch (apex_lite/amp/two_copies.py): whether the tensors of a
// list (the half model parameters and their masters) were written since recorded (a version
// counter moved, or other memory: ``p.data = t`` keeps the version counter but not the data
// pointer), and whether their requires_grad was flipped: writes that amp did not make, which it
// carries to the other copy.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

namespace apex_lite {
namespace {

using Tensors = std::vector<at::Tensor>;

class LazyGradSlots : public torch::CustomClassHolder {
 public:
  LazyGradSlots(Tensors sources, Tensors masters, Tensors lazies)
      : sources_(std::move(sources)), masters_(std::move(masters)), lazies_(std::move(lazies)) {
    TORCH_CHECK(sources_.size() == masters_.size() && masters_.size() == lazies_.size(),
                "LazyGradSlots: sources, masters and lazies must be aligned lists");
  }

  // Each master whose source has a gradient and that holds none (or its own lazy gradient)
  // gets its lazy gradient; the indices of those that hold another gradient (which the new one
  // is to be added to) are returned. What every master's .grad is then is recorded.
  std::vector<int64_t> give() {
    const size_t n = masters_.size();
    std::vector<int64_t> holding;
    recorded_.assign(n, at::Tensor());
    for (size_t i = 0; i < n; ++i) {
      if (sources_[i].grad().defined()) {
        const at::Tensor& g = masters_[i].grad();
        if (!g.defined() || g.is_same(lazies_[i])) {
          masters_[i].mutable_grad() = lazies_[i];
        } else {
          holding.push_back(static_cast<int64_t>(i));
        }
      }
      recorded_[i] = masters_[i].grad();
    }
    is_recorded_ = true;
    return holding;
  }

  // The index of the first master whose .grad is not the tensor recorded (another tensor, or
  // none where one was, or one where none was); -1 when none (or nothing is recorded).
  int64_t changed() const {
    if (!is_recorded_) return -1;
    const size_t n = masters_.size();
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& g = masters_[i].grad();
      if (g.defined() != recorded_[i].defined() || (g.defined() && !g.is_same(recorded_[i]))) {
        return static_cast<int64_t>(i);
      }
    }
    return -1;
  }

  // Take the lazy gradients off the masters that still hold them (zero_grad: torch's own then
  // finds no gradient to drop or zero there, instead of one Python assignment per master), and
  // remember which, for put_back.
  void take_back() {
    const size_t n = masters_.size();
    taken_.clear();
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& g = masters_[i].grad();
      if (g.defined() && g.is_same(lazies_[i])) {
        masters_[i].mutable_grad().reset();
        taken_.push_back(i);
      }
    }
  }

  // Give the lazy gradients that the last take_back took off back to their masters.
  void put_back() {
    for (size_t i : taken_) masters_[i].mutable_grad() = lazies_[i];
    taken_.clear();
  }

  // Slot i's lazy gradient is another tensor from now on (the old one is held by user code).
  void replace(int64_t i, at::Tensor lazy) {
    TORCH_CHECK(i >= 0 && static_cast<size_t>(i) < lazies_.size(), "LazyGradSlots: index");
    lazies_[i] = std::move(lazy);
  }

  void clear() {
    recorded_.clear();
    is_recorded_ = false;
  }

 private:
  Tensors sources_;
  Tensors masters_;
  Tensors lazies_;
  Tensors recorded_;
  std::vector<size_t> taken_;
  bool is_recorded_ = false;
};

class TensorWatch : public torch::CustomClassHolder {
 public:
  explicit TensorWatch(Tensors tensors) : tensors_(std::move(tensors)) {}

  void record() {
    const size_t n = tensors_.size();
    versions_.assign(n, 0);
    data_.assign(n, nullptr);
    requires_grad_.assign(n, false);
    for (size_t i = 0; i < n; ++i) {
      versions_[i] = version(tensors_[i]);
      data_[i] = tensors_[i].const_data_ptr();
      requires_grad_[i] = tensors_[i].requires_grad();
    }
    is_recorded_ = true;
  }

  // (written, flipped): the indices of the tensors whose version or data pointer differs from
  // the record, and of those whose requires_grad does (both empty when nothing is recorded).
  std::tuple<std::vector<int64_t>, std::vector<int64_t>> changed() const {
    std::vector<int64_t> written, flipped;
    if (!is_recorded_) return {written, flipped};
    const size_t n = tensors_.size();
    for (size_t i = 0; i < n; ++i) {
      if (version(tensors_[i]) != versions_[i] || tensors_[i].const_data_ptr() != data_[i]) {
        written.push_back(static_cast<int64_t>(i));
      }
      if (tensors_[i].requires_grad() != static_cast<bool>(requires_grad_[i])) {
        flipped.push_back(static_cast<int64_t>(i));
      }
    }
    return {written, flipped};
  }

 private:
  // An inference tensor has no version counter; a parameter never is one.
  static int64_t version(const at::Tensor& t) {
    if (t.is_inference()) return -1;
    return static_cast<int64_t>(t._version());
  }

  Tensors tensors_;
  std::vector<int64_t> versions_;
  std::vector<const void*> data_;
  std::vector<char> requires_grad_;
  bool is_recorded_ = false;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(apex_lite, m) {
  m.class_<LazyGradSlots>("LazyGradSlots")
      .def(torch::init<Tensors, Tensors, Tensors>())
      .def("give", &LazyGradSlots::give)
      .def("changed", &LazyGradSlots::changed)
      .def("take_back", &LazyGradSlots::take_back)
      .def("put_back", &LazyGradSlots::put_back)
      .def("replace", &LazyGradSlots::replace)
      .def("clear", &LazyGradSlots::clear);
  m.class_<TensorWatch>("TensorWatch")
      .def(torch::init<Tensors>())
      .def("record", &TensorWatch::record)
      .def("changed", &TensorWatch::changed);
}

}  // namespace apex_lite
