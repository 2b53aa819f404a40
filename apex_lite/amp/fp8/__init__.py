"""fp8 matmuls under amp (``amp.initialize(..., opt_level="O2", fp8=True)``): the eligible
``nn.Linear`` layers of a half model run their forward and both backward matmuls in fp8.

    config.py      ``amp.FP8``, the options (one frozen config), and the default min_features
    scaled_mm.py   the scaled fp8 matmul on every device and torch release; devices without one
    cast.py        one tensor's cast to fp8: amax, power-of-two scale, clip and flush counts
    state.py       a model's fp8 scaling state on the device, and the delayed recipe's fold
    linear.py      the fp8 forward of a Linear and its autograd (the three matmuls)
    install.py     which layers are eligible, putting them in fp8, the run's fp8 part
    saved.py       the fp8 state in amp.state_dict(), and loading it

The guide (docs/guides/fp8.md) says when fp8 helps and how to read its counts.
"""
from .config import FP8

__all__ = ["FP8"]
