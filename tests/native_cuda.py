"""The module-level gate of the CUDA kernel test files: skip without a GPU or without the CUDA
kernels, and fail instead under APEX_LITE_REQUIRE_EXT=1 (a CI run meant to test them must not
pass by skipping)."""
from __future__ import annotations

import os
from typing import Optional, Sequence

import pytest
import torch


def _unavailable(op_names: Sequence[str]) -> Optional[str]:
    try:
        import apex_lite._C  # noqa: F401  (registers the torch.ops.apex_lite kernels)
    except ImportError as exc:
        return f"apex_lite._C is not importable ({exc}); build it with --cuda_ext"
    missing = [name for name in op_names
               if not torch._C._dispatch_has_kernel_for_dispatch_key(f"apex_lite::{name}", "CUDA")]
    if missing:
        return f"apex_lite._C has no CUDA kernels for {', '.join(missing)}; build it with --cuda_ext"
    return None


def require_cuda_kernels(op_names: Sequence[str]) -> None:
    """Call at a test module's top: skips the module (or fails it, see above)."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA kernel tests need a CUDA GPU", allow_module_level=True)
    reason = _unavailable(op_names)
    if reason is not None:
        if os.environ.get("APEX_LITE_REQUIRE_EXT", "").strip().lower() in ("1", "true", "yes",
                                                                           "on"):
            raise RuntimeError(f"APEX_LITE_REQUIRE_EXT=1 but {reason}")
        pytest.skip(reason, allow_module_level=True)
