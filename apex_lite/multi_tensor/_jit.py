"""Development path: compile ``apex_lite._C``'s sources on first use (``APEX_LITE_JIT=1``).

torch.utils.cpp_extension.load builds csrc/ with ninja into torch's extension cache and loads
the library, which registers the ops. Needs the source tree next to the package (an editable
checkout), a C++ compiler and ninja; CUDA kernels are included when torch has CUDA and nvcc is
found. The compiler flags are setup.py's (AVX2 when this CPU has it, OpenMP, no FP
contraction). Failures are logged as errors with the compiler's message, never swallowed quietly.
"""
from __future__ import annotations

import glob
import importlib.util
import logging
import os
from types import ModuleType
from typing import Tuple

import torch

logger = logging.getLogger("apex_lite.multi_tensor")

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "csrc")


def _setup_flags() -> ModuleType:
    """setup.py beside csrc/, loaded as a module (it defines functions; setup() runs only under
    __main__), so the JIT build uses the same compiler flags as an installed one."""
    spec = importlib.util.spec_from_file_location(
        "apex_lite_setup", os.path.join(os.path.dirname(CSRC), "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_and_load() -> Tuple[bool, str]:
    """Compiles and loads the kernels; ``(True, what)`` or ``(False, why)``."""
    if not os.path.isdir(CSRC):
        reason = (f"APEX_LITE_JIT=1 but the C++ sources are not at {CSRC}; the JIT path needs an "
                  f"editable checkout (or unset APEX_LITE_JIT to use an installed build)")
        logger.error("apex_lite: %s", reason)
        return False, reason
    from torch.utils import cpp_extension

    sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")))
    sources += sorted(glob.glob(os.path.join(CSRC, "cpu", "*.cpp")))
    cuda_sources = sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
    with_cuda = bool(cuda_sources) and torch.version.cuda is not None \
        and cpp_extension.CUDA_HOME is not None
    if with_cuda:
        sources += cuda_sources
    logger.warning("apex_lite: APEX_LITE_JIT=1: compiling %d sources (%s CUDA) from %s; the "
                   "first call takes minutes", len(sources), "with" if with_cuda else "without",
                   CSRC)
    flags = _setup_flags()
    try:
        cpp_extension.load(
            name="apex_lite_C_jit", sources=sources, extra_include_paths=[CSRC],
            extra_cflags=flags.cxx_flags(flags.cpu_arch()), extra_ldflags=flags.LINK_FLAGS,
            extra_cuda_cflags=flags.NVCC_FLAGS,
            with_cuda=with_cuda, is_python_module=False,
            verbose=os.environ.get("APEX_LITE_JIT_VERBOSE", "") == "1")
    except Exception as exc:  # compiler, linker or loader error: report it whole
        reason = f"APEX_LITE_JIT=1 but compiling the kernels failed: {type(exc).__name__}: {exc}"
        logger.error("apex_lite: %s", reason)
        return False, reason
    return True, f"JIT build of {CSRC} (torch.utils.cpp_extension.load)"
