#!/usr/bin/env bash
# The first GPU run tells the whole truth in one call: builds apex_lite for this GPU, runs the
# CUDA tests on both backends, compute-sanitizer, the GPU benchmarks in short mode and timm's
# ApexScaler, and writes at most 8 files into OUTDIR (summary.md first). See tools/gpu_check.py.
#
#   bash tools/gpu_check.sh OUTDIR             # on a CUDA host (about 8-11 minutes)
#   bash tools/gpu_check.sh --dry-run OUTDIR   # anywhere: the script's own plumbing, seconds
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" tools/gpu_check.py "$@"
