#!/usr/bin/env bash
# Compile-check every csrc/cuda/*.cu for sm_80 and sm_90 with this machine's nvcc, against the
# installed torch's headers and with the flags torch's CUDAExtension passes; then build and run
# the host-only unit test of the launch planner (csrc/cuda/tests/launch_plan_test.cc).
#
# Works with a CPU-only torch: its wheel lacks the generated header c10/cuda/impl/cuda_cmake_macros.h,
# so a one-line stand-in is generated in a temporary include directory.
#
# Exit status: 0 when everything compiles (or "skipped: nvcc not found"), non-zero otherwise.
# Usage: tools/check_cuda_compile.sh [op ...]   (default: every csrc/cuda/*.cu; e.g. "scale")
# Environment: NVCC (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc), PYTHON (default python),
# APEX_LITE_CUDA_STD (default: the -std torch's cpp_extension uses), APEX_LITE_NVCC_THREADS (default
# 2: nvcc compiles the two architectures of a file in parallel; 74 s -> 58 s for axpby.cu on the
# 2-core CI machine).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cuda_dir="$repo_root/csrc/cuda"
python="${PYTHON:-python}"

nvcc="${NVCC:-}"
if [[ -z "$nvcc" ]]; then
  if command -v nvcc >/dev/null 2>&1; then
    nvcc="$(command -v nvcc)"
  elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
    nvcc=/usr/local/cuda/bin/nvcc
  fi
fi
if [[ -z "$nvcc" || ! -x "$nvcc" ]]; then
  echo "check_cuda_compile: skipped: nvcc not found (set NVCC or put nvcc on PATH)"
  exit 0
fi

work_dir="$(mktemp -d /tmp/apex_lite_cuda_check.XXXXXX)"
trap 'rm -rf "$work_dir"' EXIT
mkdir -p "$work_dir/include/c10/cuda/impl"
echo '#define C10_CUDA_BUILD_SHARED_LIBS' > "$work_dir/include/c10/cuda/impl/cuda_cmake_macros.h"

# Include paths, C++ ABI and language standard of the installed torch.
mapfile -t torch_config < <("$python" - <<'PY'
import inspect
import sysconfig

import torch
import torch.utils.cpp_extension as cpp_extension

for path in cpp_extension.include_paths():
    print("-I" + path)
print("-I" + sysconfig.get_paths()["include"])
print("-D_GLIBCXX_USE_CXX11_ABI=" + str(int(torch._C._GLIBCXX_USE_CXX11_ABI)))
source = inspect.getsource(cpp_extension)
print("-std=c++20" if "'-std=c++20'" in source else "-std=c++17")
PY
)
std_flag="${torch_config[-1]}"
unset 'torch_config[-1]'
if [[ -n "${APEX_LITE_CUDA_STD:-}" ]]; then
  std_flag="-std=$APEX_LITE_CUDA_STD"
fi

# What torch.utils.cpp_extension.CUDAExtension passes to nvcc (COMMON_NVCC_FLAGS and the rest).
nvcc_flags=(
  "$std_flag"
  -D__CUDA_NO_HALF_OPERATORS__
  -D__CUDA_NO_HALF_CONVERSIONS__
  -D__CUDA_NO_BFLOAT16_CONVERSIONS__
  -D__CUDA_NO_HALF2_OPERATORS__
  --expt-relaxed-constexpr
  -Xcompiler -fPIC
  -DTORCH_API_INCLUDE_EXTENSION_H
  -DTORCH_EXTENSION_NAME=_C
  -O3
  --threads "${APEX_LITE_NVCC_THREADS:-2}"
  -gencode arch=compute_80,code=sm_80
  -gencode arch=compute_90,code=sm_90
  "-I$work_dir/include"
  "-I$cuda_dir"
  "${torch_config[@]}"
)

echo "check_cuda_compile: $("$nvcc" --version | tail -n 2 | head -n 1)"
echo "check_cuda_compile: flags: ${nvcc_flags[*]}"

shopt -s nullglob
if [[ $# -gt 0 ]]; then
  sources=()
  for name in "$@"; do
    sources+=("$cuda_dir/$(basename "$name" .cu).cu")
  done
else
  sources=("$cuda_dir"/*.cu)
fi
if [[ ${#sources[@]} -eq 0 ]]; then
  echo "check_cuda_compile: no .cu files under csrc/cuda" >&2
  exit 1
fi

failed=()
total_start=$SECONDS
# One file at a time on purpose: each compile is heavy (torch headers) and the machine is shared;
# within a file nvcc's --threads compiles the two architectures side by side.
for source in "${sources[@]}"; do
  name="$(basename "$source" .cu)"
  start=$SECONDS
  if "$nvcc" "${nvcc_flags[@]}" -c "$source" -o "$work_dir/$name.o"; then
    echo "check_cuda_compile: ok     $name.cu ($((SECONDS - start)) s)"
  else
    echo "check_cuda_compile: FAILED $name.cu ($((SECONDS - start)) s)" >&2
    failed+=("$name.cu")
  fi
done

plan_test="$cuda_dir/tests/launch_plan_test.cc"
if c++ -std=c++17 -Wall -Wextra -O1 "-I$cuda_dir" "$plan_test" -o "$work_dir/launch_plan_test" \
    && "$work_dir/launch_plan_test"; then
  echo "check_cuda_compile: ok     tests/launch_plan_test.cc"
else
  echo "check_cuda_compile: FAILED tests/launch_plan_test.cc" >&2
  failed+=("tests/launch_plan_test.cc")
fi

echo "check_cuda_compile: ${#sources[@]} .cu file(s) in $((SECONDS - total_start)) s"
if [[ ${#failed[@]} -ne 0 ]]; then
  echo "check_cuda_compile: failed: ${failed[*]}" >&2
  exit 1
fi
echo "check_cuda_compile: all passed"
