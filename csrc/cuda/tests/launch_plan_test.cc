// Unit test of the multi-tensor-apply launch planner (csrc/cuda/launch_plan.h), host only.
// Built and run by tools/check_cuda_compile.sh (c++ -std=c++17 -I csrc/cuda). Named .cc, not .cpp,
// so that no glob of the extension's sources picks up its main().
//
// For each case it checks what the CUDA kernel relies on: every chunk of every non-empty tensor
// is visited exactly once, in tensor order; slot and block limits hold; block_start values tile
// each launch's grid; a chunk's 64-bit element offset is chunk * kChunkSize.
#include "launch_plan.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using apex_lite::cuda::kChunkSize;
using apex_lite::cuda::LaunchPlan;
using apex_lite::cuda::num_chunks;
using apex_lite::cuda::plan_launches;

namespace {

int failures = 0;

void expect(bool condition, const std::string& what) {
  if (!condition) {
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    ++failures;
  }
}

void check_case(const std::string& name, const std::vector<int64_t>& numels,
                const std::vector<int64_t>& order, int64_t max_tensors, int64_t max_blocks,
                int64_t expected_launches) {
  const std::vector<LaunchPlan> plans = plan_launches(order, numels, max_tensors, max_blocks);
  if (expected_launches >= 0) {
    expect(static_cast<int64_t>(plans.size()) == expected_launches,
           name + ": " + std::to_string(plans.size()) + " launches, expected " +
               std::to_string(expected_launches));
  }
  // The (tensor, chunk) sequence the blocks of all launches visit, in global block order.
  std::vector<std::pair<int64_t, int64_t>> visited;
  for (size_t p = 0; p < plans.size(); ++p) {
    const LaunchPlan& plan = plans[p];
    const std::string where = name + " launch " + std::to_string(p);
    expect(!plan.slots.empty() && plan.num_blocks > 0, where + ": empty launch");
    expect(static_cast<int64_t>(plan.slots.size()) <= max_tensors, where + ": too many slots");
    expect(plan.num_blocks <= max_blocks, where + ": too many blocks");
    int64_t next_block = 0;
    for (const auto& slot : plan.slots) {
      expect(slot.block_start == next_block, where + ": slots do not tile the grid");
      expect(&slot == &plan.slots.front() || slot.first_chunk == 0,
             where + ": a slot other than the first continues a split tensor");
      expect(slot.num_chunks > 0, where + ": slot without chunks");
      for (int64_t c = 0; c < slot.num_chunks; ++c) {
        visited.emplace_back(slot.tensor, slot.first_chunk + c);
      }
      next_block += slot.num_chunks;
    }
    expect(next_block == plan.num_blocks, where + ": num_blocks is not the sum of the slots");
  }
  std::vector<std::pair<int64_t, int64_t>> expected;
  for (const int64_t t : order) {
    for (int64_t c = 0; c < num_chunks(numels[static_cast<size_t>(t)]); ++c) {
      expected.emplace_back(t, c);
    }
  }
  expect(visited == expected, name + ": chunks not visited exactly once in tensor order");
}

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(i);
  return v;
}

}  // namespace

int main() {
  expect(num_chunks(0) == 0 && num_chunks(1) == 1 && num_chunks(kChunkSize) == 1 &&
             num_chunks(kChunkSize + 1) == 2,
         "num_chunks at the chunk boundary");
  const int64_t big = (int64_t{1} << 31) + 12345;  // more elements than an int32 can count
  expect(num_chunks(big) == 32769, "num_chunks above 2**31");
  expect((num_chunks(big) - 1) * kChunkSize == (int64_t{1} << 31),
         "64-bit element offset of the last chunk above 2**31");

  check_case("no tensors", {}, {}, 4, 8, 0);
  check_case("only empty tensors", {0, 0, 0}, {0, 1, 2}, 4, 8, 0);
  check_case("boundary sizes", {0, 1, 555, kChunkSize, kChunkSize + 1, 7777 * 77},
             iota(6), 160, 32768, 1);
  check_case("slot limit", std::vector<int64_t>(10, 100), iota(10), 4, 32768, 3);
  check_case("block limit splits a tensor", {10 * kChunkSize}, {0}, 4, 3, 4);
  check_case("split tensor continues in slot 0", {2 * kChunkSize, 5 * kChunkSize, 1}, {0, 1, 2},
             4, 3, 3);
  check_case("subset in a given order (dtype groups)", {5, 0, 7 * kChunkSize, 9, 3 * kChunkSize},
             {4, 2, 0}, 2, 4, -1);
  check_case("many small tensors", std::vector<int64_t>(4000, 2500), iota(4000), 160, 32768, 25);
  check_case("above 2**31 elements", {3, big, 7}, {0, 1, 2}, 160, 32768, 2);

  // The launch that continues a split tensor starts it at the right chunk.
  const auto plans = plan_launches({0}, {big}, 160, 32768);
  expect(plans.size() == 2 && plans[1].slots.size() == 1 && plans[1].slots[0].first_chunk == 32768
             && plans[1].slots[0].num_chunks == 1,
         "a tensor above 2**31 elements continues at chunk 32768");

  if (failures != 0) {
    std::fprintf(stderr, "launch_plan_test: %d failure(s)\n", failures);
    return EXIT_FAILURE;
  }
  std::printf("launch_plan_test: all cases passed\n");
  return EXIT_SUCCESS;
}
