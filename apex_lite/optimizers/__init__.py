"""Fused optimizers, and the fused update amp's O2 step runs through (``amp_kernels``)."""
