"""Opt levels: apex's property table, override validation, apex's argparse strings."""
import pytest
import torch

from apex_lite import amp
from apex_lite.amp.opt_levels import OPT_LEVELS, resolve_properties


@pytest.mark.parametrize("level, cast, patch, keep_bn, masters, scale", [
    ("O0", torch.float32, False, None, False, 1.0),
    ("O1", None, True, None, False, "dynamic"),
    ("O2", torch.bfloat16, False, True, True, "dynamic"),
    ("O3", torch.bfloat16, False, False, False, 1.0),
])
def test_defaults_on_cpu(level, cast, patch, keep_bn, masters, scale):
    p = resolve_properties(level, device_type="cpu")
    assert (p.cast_model_type, p.patch_torch_functions, p.keep_batchnorm_fp32, p.master_weights,
            p.loss_scale) == (cast, patch, keep_bn, masters, scale)
    assert p.half_dtype == torch.bfloat16
    assert OPT_LEVELS[level].brief


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_cuda_models_default_to_fp16(level):
    p = resolve_properties(level, device_type="cuda")
    assert p.half_dtype == torch.float16 and p.cast_model_type == torch.float16


@pytest.mark.parametrize("kwargs, half, cast", [
    (dict(half_dtype=torch.float16), torch.float16, torch.float16),
    (dict(cast_model_type=torch.float16), torch.float16, torch.float16),
    (dict(half_dtype=torch.bfloat16, cast_model_type=torch.bfloat16), torch.bfloat16,
     torch.bfloat16),
])
def test_half_dtype_choice(kwargs, half, cast):
    p = resolve_properties("O2", device_type="cpu", **kwargs)
    assert (p.half_dtype, p.cast_model_type) == (half, cast)


@pytest.mark.parametrize("kwargs, attr, value", [
    (dict(keep_batchnorm_fp32="True"), "keep_batchnorm_fp32", True),
    (dict(keep_batchnorm_fp32="False"), "keep_batchnorm_fp32", False),
    (dict(loss_scale="128.0"), "loss_scale", 128.0),
    (dict(loss_scale="dynamic"), "loss_scale", "dynamic"),
    (dict(loss_scale=512), "loss_scale", 512.0),
    (dict(master_weights=False), "master_weights", False),
])
def test_apex_argparse_strings(kwargs, attr, value):
    assert getattr(resolve_properties("O2", device_type="cpu", **kwargs), attr) == value


@pytest.mark.parametrize("level", ["0", "o1", "01", "O4", 1, None])
def test_unknown_opt_level_lists_the_valid_ones(level):
    with pytest.raises(ValueError) as err:
        resolve_properties(level, device_type="cpu")
    assert "'O0', 'O1', 'O2', 'O3'" in str(err.value)
    assert "the letter O, not the number zero" in str(err.value)


@pytest.mark.parametrize("level, kwargs, reason", [
    ("O1", dict(cast_model_type=torch.float16), "cast_model_type must stay None"),
    ("O1", dict(keep_batchnorm_fp32=True), "keep_batchnorm_fp32 must be None"),
    ("O1", dict(master_weights=True), "doesn't make sense to use master_weights with O1"),
    ("O2", dict(patch_torch_functions=True), "belongs to opt_level='O1'"),
    ("O0", dict(keep_batchnorm_fp32=False), "keeps the whole model in fp32"),
    ("O2", dict(half_dtype=torch.bfloat16, cast_model_type=torch.float16), "contradicts"),
    ("O2", dict(half_dtype=torch.float32), "half_dtype must be one of"),
    ("O2", dict(cast_model_type=torch.int8), "cast_model_type must be one of"),
    ("O2", dict(keep_batchnorm_fp32="yes"), "keep_batchnorm_fp32 must be True, False"),
    ("O2", dict(loss_scale="big"), "loss_scale must be a positive number"),
    ("O2", dict(loss_scale=0.0), "loss_scale must be positive and finite"),
    ("O2", dict(loss_scale=float("inf")), "loss_scale must be positive and finite"),
])
def test_contradictory_overrides_raise_with_the_reason(level, kwargs, reason):
    with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        resolve_properties(level, device_type="cpu", **kwargs)


@pytest.mark.parametrize("level, kwargs", [
    ("O3", dict(keep_batchnorm_fp32=True)),      # apex's documented speed baseline
    ("O3", dict(master_weights=True)),
    ("O2", dict(loss_scale=128.0)),
    ("O1", dict(loss_scale=1.0, patch_torch_functions=False)),
    ("O0", dict(keep_batchnorm_fp32=True)),
])
def test_sensible_overrides_are_accepted(level, kwargs):
    properties = resolve_properties(level, device_type="cpu", **kwargs)
    for name, value in kwargs.items():
        assert getattr(properties, name) == value, name


def test_initialize_reports_an_unknown_level_without_touching_the_model():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    forward = model.forward
    with pytest.raises(ValueError, match="letter O"):
        amp.initialize(model, opt, opt_level="02")
    assert model.weight.dtype == torch.float32 and model.forward == forward
    assert not hasattr(opt, "_apex_lite_amp")
