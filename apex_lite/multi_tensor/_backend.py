"""Which implementation serves a device: the native extension ``apex_lite._C`` or the Python one.

The choice is made once per device type and logged once, with the real reason when native is not
used: at INFO for a pure-Python install (what the user chose), at WARNING where native kernels
were expected (a build that cannot serve the device, an environment variable asking for one).
``APEX_LITE_DISABLE_EXT=1`` forces Python; ``APEX_LITE_REQUIRE_EXT=1`` turns a fallback into an
error.
"""
from __future__ import annotations

import logging
from types import ModuleType
from typing import Dict, Optional, Tuple

import torch

from . import _native, _python
from ._env import env_flag

logger = logging.getLogger("apex_lite.multi_tensor")

_choices: Dict[str, Tuple[ModuleType, str, str]] = {}


class NativeBackendUnavailable(RuntimeError):
    """Raised when APEX_LITE_REQUIRE_EXT=1 and the native kernels cannot serve a device."""


def _native_ops(device_type: str) -> Tuple[Optional[ModuleType], str, bool]:
    """``(ops, why, expected)``: the native op module for ``device_type`` or None and the reason
    it cannot be used, and whether native kernels were expected here (False: a pure-Python
    install by choice)."""
    ops, why = _native.ops_for(device_type)
    return ops, why, ops is None and _native.native_expected() is not None


def _choose(device_type: str) -> Tuple[ModuleType, str, str]:
    if env_flag("APEX_LITE_DISABLE_EXT"):
        return _python, "python", "APEX_LITE_DISABLE_EXT=1 is set"
    ops, reason, expected = _native_ops(device_type)
    if ops is not None:
        return ops, "native", reason
    if env_flag("APEX_LITE_REQUIRE_EXT"):
        raise NativeBackendUnavailable(
            f"APEX_LITE_REQUIRE_EXT=1 is set but the native multi-tensor kernels cannot serve "
            f"{device_type!r} devices: {reason}. Rebuild with the extension (see the README's "
            f"install flags) or unset APEX_LITE_REQUIRE_EXT to use the Python backend.")
    if expected:
        logger.warning("apex_lite: native multi-tensor kernels unavailable for %s (%s); "
                       "using the Python backend (same results, slower).", device_type, reason)
    else:
        logger.info("apex_lite: multi-tensor ops on %s use the Python backend (torch foreach "
                    "kernels): %s", device_type, reason)
    return _python, "python", reason


def ops_for(device: torch.device) -> ModuleType:
    """The op module (``scale_``, ``scale_out``, ``axpby_``, ``axpby_out``, ``l2norm``,
    ``nonfinite_flags``) that serves ``device``."""
    choice = _choices.get(device.type)
    if choice is None:
        choice = _choices[device.type] = _choose(device.type)
    return choice[0]


def backend(device="cpu") -> Tuple[str, str]:
    """``("native" | "python", why)`` for ``device``: which kernels serve it and the reason."""
    device_type = torch.device(device).type
    ops_for(torch.device(device_type))
    _, name, why = _choices[device_type]
    return name, why


def reset() -> None:
    """Forget the choices made so far (tests change the environment variables)."""
    _choices.clear()
