"""Shared fixtures: every test gets a fresh default amp handle (as a fresh process would)."""
import pytest
import torch

from apex_lite import amp


@pytest.fixture(autouse=True)
def fresh_amp_handle(monkeypatch):
    handle = amp.AmpHandle()
    monkeypatch.setattr(amp, "_default_handle", handle)
    torch.manual_seed(0)
    return handle


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
