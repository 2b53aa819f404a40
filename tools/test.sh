#!/usr/bin/env bash
# The README's test command. Installs what the tests need (torch only where it is missing, and
# then the pinned CPU wheel), installs apex_lite with its C++ CPU extension, and runs the suite
# twice: with the native kernels required, and with the Python backend forced.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install "torch==2.13.0"
"$PY" -c "import pytest" 2>/dev/null || "$PY" -m pip install pytest
# The examples' and benchmarks' --plot are tested too (tests/test_examples.py).
"$PY" -c "import matplotlib" 2>/dev/null || "$PY" -m pip install matplotlib
APEX_LITE_CPP_EXT=1 MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip install -q --no-build-isolation .

# The tests import the installed package: run them from tests/ so that the source tree's
# apex_lite (which has no built extension) does not shadow it.
cd tests
echo "== tests with the native CPU extension (APEX_LITE_REQUIRE_EXT=1)"
APEX_LITE_REQUIRE_EXT=1 "$PY" -m pytest -q "$@"
echo "== tests with the Python backend (APEX_LITE_DISABLE_EXT=1)"
APEX_LITE_DISABLE_EXT=1 "$PY" -m pytest -q "$@"
