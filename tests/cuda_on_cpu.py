"""For the tests only: run apex-era code that names CUDA (tests/third_party/) unmodified on the
CPU, in the process that imports this, by pointing the few torch.cuda entry points it uses at
the CPU. apex_lite itself is not involved: it runs on the CPU as on a GPU.

- ``torch.cuda.IntTensor(data)`` / ``torch.cuda.FloatTensor(data)``: the CPU tensor
  (apex's noop flags, BertLAMB's per-tensor decays);
- ``torch.cuda.device(d)``: a context that does nothing for a CPU device (fairseq's FusedAdamV2
  steps ``with torch.cuda.device(p.device)``);
- ``torch.empty(..., device="cuda")``: on the CPU (BERT's flat all-reduce buffer).

Nothing else is patched; code that needs more fails as it would without a GPU.
"""
import contextlib

import torch

_patched = False


def install() -> None:
    """Patch the entry points above for the rest of the process (idempotent)."""
    global _patched
    if _patched:
        return
    _patched = True
    real_device, real_empty = torch.cuda.device, torch.empty

    def device(d):
        if isinstance(d, torch.device) and d.type == "cpu":
            return contextlib.nullcontext()
        return real_device(d)

    def empty(*size, device=None, **kwargs):
        if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
            device = "cpu"
        return real_empty(*size, device=device, **kwargs)

    torch.cuda.IntTensor = lambda *data: torch.tensor(*data, dtype=torch.int32)
    torch.cuda.FloatTensor = lambda *data: torch.tensor(*data, dtype=torch.float32)
    torch.cuda.device = device
    torch.empty = empty
