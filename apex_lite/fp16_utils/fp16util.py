"""apex.fp16_utils' model helpers: half models with BatchNorm kept fp32, and fp32 master
parameters kept by hand (apex's ``fp16util``, same names, signatures and defaults).

``convert_network`` and ``prep_param_lists`` work for bf16 as for fp16 (``convert_network(model,
torch.bfloat16)``); ``tofp16``, ``network_to_half`` and ``FP16Model`` are fp16 by name, as apex's.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["tofp16", "BN_convert_float", "network_to_half", "convert_module", "convert_network",
           "FP16Model", "prep_param_lists", "model_grads_to_master_grads",
           "master_params_to_model_params", "to_python_float", "clip_grad_norm"]

# apex's name for torch's in-place clipping.
clip_grad_norm = torch.nn.utils.clip_grad_norm_


def _is_affine_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine is True


class tofp16(nn.Module):   # noqa: N801 (apex's name)
    """A module that returns its input as fp16 (``input.half()``)."""

    def __init__(self):
        super().__init__()

    def forward(self, input):
        """``input.half()``."""
        return input.half()


def BN_convert_float(module):   # noqa: N802 (apex's name)
    """Cast every affine BatchNorm inside ``module`` (itself included) back to fp32, in place;
    returns ``module``."""
    if _is_affine_batchnorm(module):
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network):
    """``network`` in fp16 with its affine BatchNorms in fp32, behind a ``tofp16`` that casts the
    input: ``nn.Sequential(tofp16(), network)``. ``network`` itself is converted in place."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module, dtype):
    """Cast ``module``'s own floating parameters (and their gradients) and buffers to ``dtype``,
    in place; the Parameter objects stay the same (optimizers holding them keep working)."""
    for param in module.parameters(recurse=False):
        if param is not None:
            if param.data.dtype.is_floating_point:
                param.data = param.data.to(dtype=dtype)
            if param._grad is not None and param._grad.data.dtype.is_floating_point:
                param._grad.data = param._grad.data.to(dtype=dtype)
    for buf in module.buffers(recurse=False):
        if buf is not None and buf.data.dtype.is_floating_point:
            buf.data = buf.data.to(dtype=dtype)


def convert_network(network, dtype):
    """Cast every module of ``network`` to ``dtype`` (``convert_module``) except affine
    BatchNorms, which stay as they are; RNNs re-flatten their weights. Returns ``network``."""
    for module in network.modules():
        if _is_affine_batchnorm(module):
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """``network`` converted to fp16 in place (``convert_network``; affine BatchNorms stay fp32),
    with its floating inputs cast to fp16 (apex cast every input; integer inputs such as token
    ids are passed unchanged here). The network is ``self.network``."""

    def __init__(self, network):
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs):
        """The network's output for the inputs, floating ones cast to fp16."""
        inputs = tuple(t.half() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                       for t in inputs)
        return self.network(*inputs)


def prep_param_lists(model, flat_master=False):
    """fp32 master copies of ``model``'s trainable parameters.

    Args:
        model: the (half, or partly half) model.
        flat_master: one flat fp32 master for all parameters, with its gradient allocated
            (zeros); needs all trainable parameters to have one dtype.
    Returns:
        ``(model_params, master_params)``: the model's parameters that require grad, and their
        fp32 masters (a list of one flat Parameter with ``flat_master``).
    Raises:
        TypeError: ``flat_master`` with parameters of several dtypes (nothing is made).
    """
    model_params = [param for param in model.parameters() if param.requires_grad]
    if flat_master:
        dtypes = sorted({str(p.dtype) for p in model_params})
        if len(dtypes) > 1:
            raise TypeError(f"prep_param_lists(flat_master=True) needs the model's parameters "
                            f"to have one dtype; they have {', '.join(dtypes)}. Use "
                            f"flat_master=False, or FP16_Optimizer.")
        master = nn.Parameter(_flatten_dense_tensors([p.detach() for p in model_params]).float())
        master.grad = torch.zeros_like(master)
        return model_params, [master]
    master_params = [param.detach().clone().float() for param in model_params]
    for param in master_params:
        param.requires_grad = True
    return model_params, master_params


def _copy_pairs(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair, in one fused call (torch's foreach copy)."""
    if destinations:
        torch._foreach_copy_(list(destinations), list(sources))


def model_grads_to_master_grads(model_params, master_params, flat_master=False):
    """Copy the model's gradients into the masters' (fp32) gradients, unscaled.

    Args:
        model_params, master_params: as ``prep_param_lists`` returned them.
        flat_master: the masters are one flat tensor (as made by ``prep_param_lists``); a model
            parameter without a gradient counts as zeros there.
    A master whose model parameter has no gradient gets none (``None``).
    """
    if flat_master:
        grads = [p.grad.detach() if p.grad is not None else torch.zeros_like(p)
                 for p in model_params]
        master_params[0].grad.data.copy_(_flatten_dense_tensors(grads))
        return
    sources, destinations = master_grad_pairs(model_params, master_params)
    _copy_pairs(destinations, sources)


def master_grad_pairs(model_params, master_params) -> Tuple[List[torch.Tensor],
                                                            List[torch.Tensor]]:
    """``(model_grads, master_grads)`` for the pairs whose model parameter has a gradient,
    allocating the master's where missing; a master whose parameter has none gets ``None``."""
    sources, destinations = [], []
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        sources.append(model.grad.detach())
        destinations.append(master.grad)
    return sources, destinations


def master_params_to_model_params(model_params, master_params, flat_master=False):
    """Copy the masters' values into the model's parameters (rounded to their dtype).

    Args:
        model_params, master_params: as ``prep_param_lists`` returned them.
        flat_master: the masters are one flat tensor.
    """
    with torch.no_grad():
        if flat_master:
            sources: List[torch.Tensor] = list(_unflatten_dense_tensors(master_params[0].data,
                                                                        model_params))
        else:
            sources = [master.detach() for master in master_params]
        _copy_pairs([p.data for p in model_params], sources)


def to_python_float(t):
    """``t`` as a Python number: ``t.item()``, or ``t[0]`` for what has no ``item``."""
    if hasattr(t, "item"):
        return t.item()
    return t[0]
