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



@pytest.fixture(autouse=True)
def cpu_with_half_units(monkeypatch):
    """Tests see a CPU with bf16/fp16 matrix units, so that what amp logs does not depend on the
    machine the suite runs on (amp.initialize warns on CPUs without them; a test of that warning
    patches these probes itself)."""
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported",
                  "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: True, raising=False)


@pytest.fixture
def python_backend(monkeypatch):
    """The Python backend for this test (APEX_LITE_DISABLE_EXT=1), whatever the run chose: what
    a pure install gets (torch's fused kernels carry amp's O2 step there)."""
    from apex_lite.multi_tensor import _backend
    monkeypatch.setenv("APEX_LITE_DISABLE_EXT", "1")
    monkeypatch.delenv("APEX_LITE_REQUIRE_EXT", raising=False)
    _backend.reset()
    yield
    _backend.reset()
