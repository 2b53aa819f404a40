// Host-side planning of multi-tensor-apply launches: which chunks of which tensors each launch
// covers. Plain C++ (no CUDA, no torch) so that it is unit-tested without a GPU
// (csrc/cuda/tests/launch_plan_test.cc, run by tools/check_cuda_compile.sh).
//
// A tensor of `numel` elements is cut into chunks of kChunkSize elements (the last one shorter);
// every chunk is one CUDA block. A launch holds at most `max_tensors` tensors ("slots", bounded by
// the kernel-argument struct) and at most `max_blocks` chunks; a tensor that does not fit is
// continued in slot 0 of the next launch. All sizes, chunk indices and offsets are 64-bit: a
// tensor may hold more than 2**31 elements.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace apex_lite {
namespace cuda {

constexpr int64_t kChunkSize = 65536;

// constexpr: also called from device code (nvcc --expt-relaxed-constexpr, which torch passes).
constexpr int64_t num_chunks(int64_t numel) { return (numel + kChunkSize - 1) / kChunkSize; }

// One tensor's share of a launch: chunks [first_chunk, first_chunk + num_chunks) of tensor
// `tensor` (an index into the caller's list), processed by blocks
// [block_start, block_start + num_chunks) of the launch.
struct LaunchSlot {
  int64_t tensor;
  int64_t first_chunk;
  int64_t num_chunks;
  int64_t block_start;
};

struct LaunchPlan {
  std::vector<LaunchSlot> slots;
  int64_t num_blocks = 0;
};

// Plans the launches over the tensors `order` (indices into `numels`, in the order given), skipping
// empty tensors. Chunks come out in order: the blocks of all launches, concatenated, visit every
// chunk of order[0], then of order[1], and so on, so a tensor's chunks have consecutive global
// block numbers.
inline std::vector<LaunchPlan> plan_launches(const std::vector<int64_t>& order,
                                             const std::vector<int64_t>& numels,
                                             int64_t max_tensors, int64_t max_blocks) {
  if (max_tensors < 1 || max_blocks < 1) {
    throw std::invalid_argument("plan_launches: max_tensors and max_blocks must be positive");
  }
  std::vector<LaunchPlan> plans;
  LaunchPlan current;
  for (const int64_t tensor : order) {
    const int64_t numel = numels.at(static_cast<size_t>(tensor));
    if (numel < 0) {
      throw std::invalid_argument("plan_launches: negative numel");
    }
    const int64_t chunks = num_chunks(numel);
    int64_t done = 0;
    while (done < chunks) {
      if (static_cast<int64_t>(current.slots.size()) == max_tensors ||
          current.num_blocks == max_blocks) {
        plans.push_back(std::move(current));
        current = LaunchPlan();
      }
      const int64_t room = max_blocks - current.num_blocks;
      const int64_t take = chunks - done < room ? chunks - done : room;
      current.slots.push_back(LaunchSlot{tensor, done, take, current.num_blocks});
      current.num_blocks += take;
      done += take;
    }
  }
  if (current.num_blocks > 0) {
    plans.push_back(std::move(current));
  }
  return plans;
}

}  // namespace cuda
}  // namespace apex_lite
