"""apex_lite.apex_compat.apex_c, what ``import apex_C`` gives: apex's flatten/unflatten, torch's
_flatten_dense_tensors and _unflatten_dense_tensors with apex's list result and clear errors."""
import pytest
import torch
from torch._utils import _flatten_dense_tensors

from apex_lite.apex_compat import apex_c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_flatten_and_unflatten_round_trip(dtype):
    tensors = [torch.randn(3, 5).to(dtype), torch.randn(0).to(dtype), torch.randn(7).to(dtype),
               torch.randn(4, 6).to(dtype).t()]   # non-contiguous
    flat = apex_c.flatten(tensors)
    assert flat.shape == (15 + 7 + 24,) and flat.dtype == dtype and flat.is_contiguous()
    assert torch.equal(flat, _flatten_dense_tensors(tensors))
    pieces = apex_c.unflatten(flat, tensors)
    assert isinstance(pieces, list) and len(pieces) == 4
    for piece, tensor in zip(pieces, tensors):
        assert piece.shape == tensor.shape and torch.equal(piece, tensor)
    pieces[0].fill_(1.0)   # views into flat
    assert torch.equal(flat[:15], torch.ones(15, dtype=dtype))


def test_misuse_is_named():
    with pytest.raises(TypeError, match="must be a list or tuple of tensors, got Tensor"):
        apex_c.flatten(torch.ones(3))
    with pytest.raises(TypeError, match=r"tensors\[1\] is a float, not a tensor"):
        apex_c.flatten([torch.ones(1), 2.0])
    with pytest.raises(ValueError, match="the list of tensors is empty"):
        apex_c.flatten([])
    with pytest.raises(TypeError, match="sparse"):
        apex_c.flatten([torch.ones(2).to_sparse()])
    with pytest.raises(ValueError, match="1-D with 5 elements"):
        apex_c.unflatten(torch.ones(4), [torch.ones(2), torch.ones(3)])
    with pytest.raises(TypeError, match="flat must be a tensor"):
        apex_c.unflatten([1.0], [torch.ones(1)])
