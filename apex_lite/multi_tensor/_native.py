"""Loader for the native kernels in ``apex_lite._C``.

Not built yet: the native kernels are the subject of their own issue. Until then every device is
served by the Python backend, and this module says so.
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional, Tuple


def ops_for(device_type: str) -> Tuple[Optional[ModuleType], str]:
    try:
        from apex_lite import _C  # noqa: F401
    except ImportError as exc:
        return None, f"apex_lite._C is not importable ({exc}); it is built by --cpp_ext/--cuda_ext"
    return None, "apex_lite._C has no multi-tensor kernels yet"
