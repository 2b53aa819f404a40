#!/usr/bin/env bash
# Checks that apex_lite installs, builds and passes a fast subset of its tests on one torch
# release, in a fresh venv made as `python3 -m venv` makes it (its pip and setuptools as they
# come), apex_lite installed from this checkout with --no-build-isolation:
#   1. the pure install, the first command (examples/amp_recipe.py, small sizes), the subset on
#      the Python backend;
#   2. the native CPU build (APEX_LITE_CPP_EXT=1), the subset with the native kernels required.
#
#   bash tools/check_torch_range.sh 2.5.1 [VENV]      # the floor (TORCH_FLOOR in setup.py)
#   bash tools/check_torch_range.sh 2.14.1 [VENV]     # the newest release this machine serves
#
# torch comes from the machine's pip configuration: a CPU wheel where one lies on disk, else
# PyPI's build (for torch before 2.13 on x86-64 that is a CUDA build with its nvidia-*
# dependencies, about 2.5 GB to download and 4 GB installed: minutes). pip's cache keeps the
# download for the next run. Exits non-zero at the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${1:?usage: check_torch_range.sh TORCH_VERSION [VENV]}
VENV=${2:-${TMPDIR:-/tmp}/apex_lite_torch_$TORCH}
PY=${PYTHON:-python3}
SUBSET=(test_build.py test_amp_initialize.py test_amp_fused_step.py test_torch_fused_route.py
        test_amp_scaling.py test_step_count_and_nan_rules.py test_torch_fused_chunks.py)
started=$SECONDS
say() { echo "== check_torch_range $TORCH ($((SECONDS - started)) s): $*"; }

rm -rf "$VENV"
"$PY" -m venv "$VENV"
V="$VENV/bin/python"
say "venv with $("$V" -m pip --version | cut -d' ' -f1-2), setuptools $("$V" -c 'import setuptools; print(setuptools.__version__)')"
"$V" -m pip install -q "torch==$TORCH" numpy pytest
# What --no-build-isolation needs besides setuptools (README, Install flags): wheel where
# setuptools is older than 70.1. setup.py names it when it is missing.
"$V" -m pip install -q wheel
say "torch $("$V" -c 'import torch; print(torch.__version__)') installed"

"$V" -m pip install -q --no-build-isolation --no-deps .
say "pure install done"
(cd examples && APEX_LITE_DISABLE_EXT=1 "$V" amp_recipe.py --device cpu --batch-size 16 \
    --width 64 --layers 2 --batches 4 --epochs 1 | tail -8)
(cd tests && APEX_LITE_DISABLE_EXT=1 "$V" -m pytest -q -x -p no:cacheprovider "${SUBSET[@]}")
say "pure install: first command and subset passed"

APEX_LITE_CPP_EXT=1 MAX_JOBS=${MAX_JOBS:-2} "$V" -m pip install -q --no-build-isolation \
    --no-deps .
say "native build done"
(cd tests && APEX_LITE_REQUIRE_EXT=1 "$V" -m pytest -q -x -p no:cacheprovider "${SUBSET[@]}")
say "native build: subset passed"
rm -rf "$VENV"
