// Two host-side watches of amp's O2 masters, each one C++ loop per step instead of a Python
// statement per parameter (4000 parameters: about 1 ms of Python a step, against a 7 ms step).
// No host sync: they read only host state (which tensor a .grad is, version counters, flags).
// The Python backend's classes of the same names (apex_lite/multi_tensor/_watches.py) are the
// reference: same answers.
//
// torch.classes.apex_lite.PendingGrads (apex_lite/amp/master_grads.py): at the end of a
// scale_loss, the fused step gives each O2 master whose half model parameter has a gradient its
// PendingGrad (a tensor standing for the true fp32 gradient, made only when used), and at
// step() asks whether any master's .grad was since replaced, deleted or set to None by user
// code, which the step must then apply as the unfused step would.
//
// torch.classes.apex_lite.TensorWatch (apex_lite/amp/model_writes.py): whether a list of tensors
// (the half model parameters) was written in place since recorded (a version counter moved),
// given other memory (``p.data = t`` keeps the version counter but not the data pointer) or had
// its requires_grad flipped: writes that amp did not make, which it takes into the masters.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace apex_lite {
namespace {

using Tensors = std::vector<at::Tensor>;

class PendingGrads : public torch::CustomClassHolder {
 public:
  PendingGrads(Tensors sources, Tensors masters, Tensors pending)
      : sources_(std::move(sources)), masters_(std::move(masters)), pending_(std::move(pending)) {
    TORCH_CHECK(sources_.size() == masters_.size() && masters_.size() == pending_.size(),
                "PendingGrads: sources, masters and pending must be aligned lists");
  }

  // Give each master whose source has a gradient its pending gradient, and record what every
  // master's .grad is now.
  void pend() {
    const size_t n = masters_.size();
    recorded_.assign(n, at::Tensor());
    for (size_t i = 0; i < n; ++i) {
      if (sources_[i].grad().defined()) masters_[i].mutable_grad() = pending_[i];
      recorded_[i] = masters_[i].grad();
    }
    is_recorded_ = true;
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

  // Take the pending gradients off the masters that still hold them (zero_grad: torch's own
  // then finds no gradient to drop there, instead of one Python assignment per master).
  void unpend() {
    const size_t n = masters_.size();
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& g = masters_[i].grad();
      if (g.defined() && g.is_same(pending_[i])) masters_[i].mutable_grad().reset();
    }
  }

  void clear() {
    recorded_.clear();
    is_recorded_ = false;
  }

 private:
  Tensors sources_;
  Tensors masters_;
  Tensors pending_;
  Tensors recorded_;
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

  // The indices of the tensors whose version, data pointer or requires_grad differs from the
  // record (empty when none, or nothing is recorded).
  std::vector<int64_t> changed() const {
    std::vector<int64_t> out;
    if (!is_recorded_) return out;
    const size_t n = tensors_.size();
    for (size_t i = 0; i < n; ++i) {
      if (version(tensors_[i]) != versions_[i] || tensors_[i].const_data_ptr() != data_[i] ||
          tensors_[i].requires_grad() != static_cast<bool>(requires_grad_[i])) {
        out.push_back(static_cast<int64_t>(i));
      }
    }
    return out;
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
  m.class_<PendingGrads>("PendingGrads")
      .def(torch::init<Tensors, Tensors, Tensors>())
      .def("pend", &PendingGrads::pend)
      .def("changed", &PendingGrads::changed)
      .def("unpend", &PendingGrads::unpend)
      .def("clear", &PendingGrads::clear);
  m.class_<TensorWatch>("TensorWatch")
      .def(torch::init<Tensors>())
      .def("record", &TensorWatch::record)
      .def("changed", &TensorWatch::changed);
}

}  // namespace apex_lite
