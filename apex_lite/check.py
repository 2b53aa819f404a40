"""Environment check: ``python -m apex_lite.check [--require-native]``.

Prints the torch and CUDA versions, the devices torch sees, how apex_lite._C was built (and
against which torch), and for each present device type the multi-tensor backend that serves it,
with the real reason where the native kernels are not used. ``--require-native`` exits 1 when a
present device is served by the Python backend.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional, Tuple

import torch

import apex_lite
from apex_lite import multi_tensor


def _devices() -> List[Tuple[str, str]]:
    """(device type, description) for every device type present."""
    found = [("cpu", f"{torch.get_num_threads()} threads, "
                     f"capability {torch.backends.cpu.get_cpu_capability()}")]
    if torch.cuda.is_available():
        names = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            names.append(f"cuda:{index} {props.name} (sm_{props.major}{props.minor}, "
                         f"{props.total_memory / 2**30:.0f} GiB)")
        found.append(("cuda", "; ".join(names)))
    return found


def _build_description() -> str:
    try:
        from apex_lite import _build_info as info
    except ImportError:
        return "no record of a native build (installed pure Python, or built by JIT)"
    cuda = f"with CUDA kernels (nvcc {info.NVCC_VERSION})" if info.WITH_CUDA else "CPU kernels only"
    return f"built against torch {info.TORCH_VERSION}, {cuda}"


def report(require_native: bool = False) -> Tuple[str, bool]:
    """The check's text, and whether it passed (always True unless ``require_native``)."""
    cuda = torch.version.cuda or "none (CPU-only torch build)"
    lines = [f"apex_lite {apex_lite.__version__} at {apex_lite.__file__}",
             f"torch      {torch.__version__}, CUDA {cuda}",
             f"extension  {_build_description()}"]
    passed = True
    for device_type, description in _devices():
        try:
            name, why = multi_tensor.backend(device_type)
        except multi_tensor.NativeBackendUnavailable as exc:
            name, why = "python", str(exc)
        lines.append(f"{device_type:<10} {description}")
        lines.append(f"{'':<10} backend: {name} ({why})")
        if require_native and name != "native":
            passed = False
            lines.append(f"{'':<10} FAIL: --require-native, but {device_type} uses the Python "
                         f"backend")
    return "\n".join(lines), passed


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m apex_lite.check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--require-native", action="store_true",
                        help="exit 1 when a present device is served by the Python backend")
    args = parser.parse_args(argv)
    # The backend's one-time fallback warning would repeat what the report says.
    logging.getLogger("apex_lite.multi_tensor").setLevel(logging.ERROR)
    text, passed = report(args.require_native)
    print(text)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
