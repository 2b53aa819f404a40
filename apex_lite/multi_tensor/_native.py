"""Loader for the native kernels in ``apex_lite._C``: finds out whether they can serve a device,
and if not, the real reason.

``apex_lite._C`` is built by ``--cpp_ext``/``--cuda_ext`` (see setup.py); with ``APEX_LITE_JIT=1``
it is instead compiled on first use from the source tree by torch.utils.cpp_extension.load
(development only, see ``_jit.py``). The library is loaded at most once per process.
"""
from __future__ import annotations

import importlib.util
from types import ModuleType, SimpleNamespace
from typing import Optional, Tuple, Union

import torch

from ._env import env_flag

# Environment variables that ask for native kernels, at build time or (JIT) at run time.
REQUEST_VARS = ("APEX_LITE_JIT", "APEX_LITE_CPP_EXT", "APEX_LITE_CUDA_EXT")

OP_NAMES = ("scale_", "scale_out", "axpby_", "axpby_out", "l2norm", "nonfinite_flags",
            "fused_sgd_", "fused_adam_", "fused_lamb_", "fused_novograd_", "fused_adagrad_")
# ---- issue 27: FusedMixedPrecisionLamb's op ----
OP_NAMES += ("fused_lamb_mp_",)
# ---- end issue 27 ----
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}

# (loaded, why): the outcome of the one attempt to load the library.
_loaded: Optional[Tuple[bool, str]] = None


def _build_info() -> Optional[ModuleType]:
    """The record setup.py wrote when it built ``_C``, or None (JIT build, or never built)."""
    try:
        from apex_lite import _build_info
    except ImportError:
        return None
    return _build_info


def _version_mismatch() -> Optional[str]:
    info = _build_info()
    if info is not None and info.TORCH_VERSION != torch.__version__:
        return (f"torch version mismatch: apex_lite._C was built against torch "
                f"{info.TORCH_VERSION} but torch {torch.__version__} is running; rebuild "
                f"apex_lite with the same flags (--cpp_ext/--cuda_ext) against this torch")
    return None


def _cpu_lacks_build_arch() -> Optional[str]:
    """Why the CPU cannot run the build's instructions (an AVX2 build on a CPU without AVX2)."""
    info = _build_info()
    if info is None or getattr(info, "CPU_ARCH", "default") != "avx2":
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        return None
    return (f"apex_lite._C was compiled for AVX2 on the machine that built it, but this CPU "
            f"supports {capability} only; rebuild here, or with APEX_LITE_CPU_ARCH=default for "
            f"a portable build")


def native_expected() -> Optional[str]:
    """Why this process expects native kernels, or None for a pure-Python install by choice.

    Expected: setup.py built ``apex_lite._C`` (its record exists), a compiled ``_C`` is present,
    or an environment variable asks for one. When none holds, the Python backend is what the
    user installed, so falling back to it is news (INFO), not a problem (WARNING).
    """
    for name in REQUEST_VARS:
        if env_flag(name):
            return f"{name}=1 is set"
    if _build_info() is not None:
        return "setup.py built apex_lite._C (apex_lite/_build_info.py records it)"
    if importlib.util.find_spec("apex_lite._C") is not None:
        return "a compiled apex_lite._C is present"
    return None


def _import_built() -> Tuple[bool, str]:
    lacking = _cpu_lacks_build_arch()
    if lacking:  # importing would run AVX2 instructions in the library's initialisers
        return False, lacking
    try:
        from apex_lite import _C
    except ImportError as exc:
        if native_expected() is None:
            return False, ("apex_lite._C was not built (a pure-Python install; --cpp_ext/"
                           "--cuda_ext or APEX_LITE_CPP_EXT=1/APEX_LITE_CUDA_EXT=1 build it)")
        mismatch = _version_mismatch()
        reason = f"apex_lite._C is not importable ({exc})"
        if mismatch:
            return False, f"{reason}; probable cause: {mismatch}"
        return False, (f"{reason}; it is built by installing with --cpp_ext/--cuda_ext or "
                       f"APEX_LITE_CPP_EXT=1/APEX_LITE_CUDA_EXT=1")
    mismatch = _version_mismatch()
    if mismatch:
        return False, mismatch
    return True, f"apex_lite._C from {_C.__file__}"


def _load() -> Tuple[bool, str]:
    global _loaded
    if _loaded is None:
        if env_flag("APEX_LITE_JIT"):
            from . import _jit
            _loaded = _jit.build_and_load()
        else:
            _loaded = _import_built()
        if _loaded[0]:
            from . import _fake
            _fake.register()
    return _loaded


def _has_kernels(dispatch_key: str) -> bool:
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"apex_lite::{name}", dispatch_key)
               for name in OP_NAMES)


def ops_for(device_type: str) -> Tuple[Optional[Union[ModuleType, SimpleNamespace]], str]:
    """``(ops, why)``: the native op module serving ``device_type``, or None and the reason."""
    loaded, why = _load()
    if not loaded:
        return None, why
    if device_type == "meta" and _has_kernels("Meta"):
        # Meta tensors carry shapes only: the ops dispatch them to the fake kernels _load
        # registered, as torch.compile's tracing does.
        from . import _native_ops
        return _native_ops.CPU_OPS, f"fake (meta) kernels: {why}"
    dispatch_key = _DISPATCH_KEYS.get(device_type)
    if dispatch_key is None:
        return None, f"apex_lite._C has kernels for cpu and cuda only, not {device_type!r}"
    if not _has_kernels(dispatch_key):
        if dispatch_key == "CUDA":
            return None, ("apex_lite._C was built without CUDA (its CUDA kernels are not "
                          "registered); rebuild with --cuda_ext or APEX_LITE_CUDA_EXT=1")
        return None, f"apex_lite._C has no {dispatch_key} kernels registered"
    from . import _native_ops
    ops = _native_ops.CPU_OPS if device_type == "cpu" else _native_ops.STAGED_OPS
    return ops, f"native kernels: {why}"
