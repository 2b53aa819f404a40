"""The arguments of apex's ``amp_C`` ops, checked and converted as apex_lite's kernels take them:
apex's tensor lists (their number, alignment, dtypes, devices), its noop flag (an int32 tensor in
apex) as the kernels' fp32 ``found_inf``, fp32 staging of half optimizer state, host numbers and
step counts. Shared by the ops of ``multi_tensor`` (amp_C's module) and ``lamb_stages``."""
from __future__ import annotations

from typing import List, Sequence

import torch

__all__ = ["STEPPED", "arg_lists", "check_aligned", "check_noop", "noop_as_found_inf", "set_noop",
           "flag_where", "fp32_state", "write_back", "host_number", "step_counts",
           "scalar_tensor"]

STEPPED = (torch.float32, torch.float16, torch.bfloat16)


def arg_lists(op: str, tensor_lists, layouts: Sequence[str]) -> List[List[torch.Tensor]]:
    """``tensor_lists`` as lists, after checking their number against apex's layouts."""
    counts = {len(layout.split(",")) for layout in layouts}
    if not isinstance(tensor_lists, (list, tuple)) or len(tensor_lists) not in counts:
        got = (f"{len(tensor_lists)} lists" if isinstance(tensor_lists, (list, tuple))
               else f"a {type(tensor_lists).__name__}")
        raise ValueError(f"amp_C.{op} takes the tensor lists [{'] or ['.join(layouts)}], got "
                         f"{got}")
    for i, tensors in enumerate(tensor_lists):
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"amp_C.{op}: tensor_lists[{i}] is a {type(tensors).__name__}, not a "
                            f"list of tensors")
    return [list(tensors) for tensors in tensor_lists]


def check_aligned(op: str, names: Sequence[str], lists: List[List[torch.Tensor]]) -> None:
    """One tensor per parameter in every list (``lists[1]`` holds the parameters), on the
    parameters' device, of their shape, and fp32, fp16 or bf16 (state that is not fp32 is
    staged through fp32)."""
    params = lists[1]
    for name, tensors in zip(names, lists):
        if len(tensors) != len(params):
            raise ValueError(f"amp_C.{op}: {name} has {len(tensors)} tensors but params has "
                             f"{len(params)}; apex's lists are aligned, one entry per parameter")
    device = params[0].device if params else None
    for index, (name, tensors) in enumerate(zip(names, lists)):
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"amp_C.{op}: {name}[{i}] is a {type(t).__name__}, not a tensor")
            if t.dtype not in STEPPED:
                what = ("apex's double-precision path is not provided"
                        if t.dtype == torch.float64 else "apex_lite steps float32, float16 and "
                        "bfloat16 tensors")
                raise TypeError(f"amp_C.{op}: {name}[{i}] is {t.dtype}; {what}")
            if t.device != device:
                raise ValueError(f"amp_C.{op}: {name}[{i}] is on {t.device} but params[0] is on "
                                 f"{device}; call once per device")
            if t.shape != params[i].shape:
                raise ValueError(f"amp_C.{op}: {name}[{i}] has shape {tuple(t.shape)} but "
                                 f"params[{i}] has {tuple(params[i].shape)}")


def check_noop(op: str, noop_flag, device: torch.device) -> None:
    if not isinstance(noop_flag, torch.Tensor) or noop_flag.numel() != 1:
        got = (f"{noop_flag.numel()} elements" if isinstance(noop_flag, torch.Tensor)
               else type(noop_flag).__name__)
        raise TypeError(f"amp_C.{op}: noop_flag must be a 1-element tensor, as apex's "
                        f"torch.zeros(1, dtype=torch.int, device=...); got {got}")
    if noop_flag.is_complex():
        raise TypeError(f"amp_C.{op}: noop_flag is {noop_flag.dtype}; use an integer (apex: "
                        f"torch.int), bool or float tensor")
    if noop_flag.device != device:
        raise ValueError(f"amp_C.{op}: noop_flag is on {noop_flag.device} but the tensors are "
                         f"on {device}; create it on their device, as apex does "
                         f"(torch.zeros(1, dtype=torch.int, device={str(device)!r}))")


def noop_as_found_inf(op: str, noop_flag, device: torch.device) -> torch.Tensor:
    """``noop_flag`` as the 1-element fp32 flag the kernels take: itself when it is fp32, else
    an fp32 copy on the device (no host sync); ``_set_noop`` copies it back."""
    check_noop(op, noop_flag, device)
    if noop_flag.dtype == torch.float32:
        return noop_flag.view(1)
    return noop_flag.reshape(1).to(torch.float32)


def set_noop(noop_flag: torch.Tensor, found_inf: torch.Tensor) -> None:
    if noop_flag.dtype != torch.float32:
        noop_flag.copy_(found_inf.view(noop_flag.shape))


def flag_where(found_inf: torch.Tensor, bad: torch.Tensor) -> None:
    """Set ``found_inf`` where the bool ``bad`` is true; never writes 0; no host sync."""
    torch.maximum(found_inf, bad.to(torch.float32).reshape(1), out=found_inf)


def fp32_state(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """The kernels keep optimizer state in fp32; apex's lists may hold half state (of half
    parameters): fp32 copies of those, written back rounded once by ``_write_back``."""
    return [t if t.dtype == torch.float32 else t.float() for t in tensors]


def write_back(tensors: List[torch.Tensor], staged: List[torch.Tensor]) -> None:
    for t, s in zip(tensors, staged):
        if s is not t:
            t.copy_(s)


def host_number(op: str, name: str, value, kind=float):
    if isinstance(value, torch.Tensor):
        raise TypeError(f"amp_C.{op}: {name} is a tensor; apex_lite provides apex's "
                        f"non-capturable form, where {name} is a Python number (the capturable "
                        f"variants, with lr and step on the device, are not provided: use "
                        f"apex_lite.optimizers.FusedAdam)")
    return kind(value)


def step_counts(op: str, step, count: int, device: torch.device) -> List[torch.Tensor]:
    """apex passes the step being taken (1 for the first) for all tensors; the kernels take one
    count per parameter and add 1 before using it: views of one buffer holding ``step - 1``."""
    step = host_number(op, "step", step, int)
    if step < 1:
        raise ValueError(f"amp_C.{op}: step={step}; apex passes the number of the step being "
                         f"taken, 1 for the first (its bias correction divides by 1 - beta**step)")
    return list(torch.full((count,), float(step - 1), dtype=torch.float32,
                           device=device).unbind(0))


def scalar_tensor(op: str, name: str, value, device: torch.device) -> torch.Tensor:
    """A number or 1-element tensor on ``device`` as the 1-element fp32 tensor the ops take."""
    if not isinstance(value, torch.Tensor):
        return torch.full((1,), float(value), dtype=torch.float32, device=device)
    if value.numel() != 1 or value.is_complex():
        raise TypeError(f"amp_C.{op}: {name} must be a 1-element real tensor (or a number), got "
                        f"{value.numel()} elements of {value.dtype}")
    if value.device != device:
        raise ValueError(f"amp_C.{op}: {name} is on {value.device} but the tensors are on "
                         f"{device}; apex's kernel reads it there")
    return value.reshape(1).to(torch.float32)
