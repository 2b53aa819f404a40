"""The environment variables that steer the kernels' choice (``APEX_LITE_DISABLE_EXT``,
``APEX_LITE_REQUIRE_EXT``, ``APEX_LITE_JIT``, ...), read the same way by the backend chooser
(``_backend``) and the native loader (``_native``); a leaf module, so that neither imports the
other for it."""
from __future__ import annotations

import os


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to a true value (1, true, yes, on)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
