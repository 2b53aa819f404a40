"""apex_lite: mixed-precision training for PyTorch with apex.amp's API."""
__version__ = "0.1.0"

from . import amp  # noqa: E402  (``from apex_lite import amp``)
