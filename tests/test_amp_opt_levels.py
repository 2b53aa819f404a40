"""Opt levels: apex's property table (ROCm apex's for O4 and O5), override validation with
ROCm apex's rules for O4, O5 and patch_torch_functions_type, apex's argparse strings."""
import pytest
import torch

from apex_lite import amp
from apex_lite.amp.opt_levels import OPT_LEVELS, resolve_properties


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# apex's properties per level, ROCm apex's for O4 and O5 (its frontend.py): cast_model_type,
# patch_torch_functions, patch_torch_functions_type, keep_batchnorm_fp32, master_weights,
# loss_scale; then the run's half dtype. "half" is the device's: bf16 on CPU, fp16 on CUDA (so
# O1's patch type is ROCm's float16 on CUDA only); O4 and O5 are bf16 on every device.
DEFAULTS = {
    "O0": (FP32, False, None, None, False, 1.0, "half"),
    "O1": (None, True, "half", None, None, "dynamic", "half"),
    "O2": ("half", False, None, True, True, "dynamic", "half"),
    "O3": ("half", False, None, False, False, 1.0, "half"),
    "O4": (None, True, BF16, None, None, 1.0, BF16),
    "O5": (BF16, None, None, True, True, 1.0, BF16),
}


@pytest.mark.parametrize("device_type, half", [("cpu", BF16), ("cuda", FP16)])
@pytest.mark.parametrize("level", list(DEFAULTS))
def test_defaults(level, device_type, half):
    expected = tuple(half if v == "half" else v for v in DEFAULTS[level])
    p = resolve_properties(level, device_type=device_type)
    got = (p.cast_model_type, p.patch_torch_functions, p.patch_torch_functions_type,
           p.keep_batchnorm_fp32, p.master_weights, p.loss_scale, p.half_dtype)
    assert got == expected
    assert all(type(a) is type(b) for a, b in zip(got, expected))   # None is not False
    assert OPT_LEVELS[level].brief
    # The fused step's rule: the levels that keep fp32 masters of a half model.
    assert p.keeps_master_weights == (level in ("O2", "O5"))


def test_o4_and_o5_are_o1_and_o2_in_bf16_with_a_static_scale():
    for level, like in (("O4", "O1"), ("O5", "O2")):
        rocm = resolve_properties(level, device_type="cuda")
        nvidia = resolve_properties(like, device_type="cuda", half_dtype=BF16, loss_scale=1.0)
        differ = {f for f in vars(rocm) if getattr(rocm, f) != getattr(nvidia, f)}
        # O5's patch_torch_functions is None where O2's is False, as in ROCm apex.
        assert differ == {"opt_level"} | ({"patch_torch_functions"} if level == "O5" else set())
        assert bool(rocm.patch_torch_functions) == bool(nvidia.patch_torch_functions)


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


@pytest.mark.parametrize("level", ["0", "o1", "01", "O6", "o5", "05", 4, 1, None])
def test_unknown_opt_level_lists_the_valid_ones(level):
    with pytest.raises(ValueError) as err:
        resolve_properties(level, device_type="cpu")
    assert "Options are 'O0', 'O1', 'O2', 'O3', 'O4', 'O5'." in str(err.value)
    assert isinstance(err.value, RuntimeError)   # what apex raised: code catching it still does
    assert "the letter O, not the number zero" in str(err.value)


# Each refusal and the words its message must hold: what is wrong and the fix.
REFUSALS = [
    ("O1", dict(cast_model_type=FP16), ["cast_model_type must stay None", "'O2' or 'O3'"]),
    ("O1", dict(keep_batchnorm_fp32=True), ["keep_batchnorm_fp32 must be None"]),
    ("O1", dict(master_weights=True), ["doesn't make sense to use master_weights with O1"]),
    ("O2", dict(patch_torch_functions=True), ["belongs to opt_level='O1' or 'O4'"]),
    ("O0", dict(keep_batchnorm_fp32=False), ["keeps the whole model in fp32"]),
    ("O2", dict(half_dtype=BF16, cast_model_type=FP16), ["contradicts"]),
    ("O2", dict(half_dtype=FP32), ["half_dtype must be one of"]),
    ("O2", dict(cast_model_type=torch.int8), ["cast_model_type must be one of"]),
    ("O2", dict(keep_batchnorm_fp32="yes"), ["keep_batchnorm_fp32 must be True, False"]),
    ("O2", dict(loss_scale="big"), ["loss_scale must be a positive number"]),
    ("O2", dict(loss_scale=0.0), ["loss_scale must be positive and finite"]),
    ("O2", dict(loss_scale=float("inf")), ["loss_scale must be positive and finite"]),
    # ROCm apex's rules for O4 (those of O1) and for patch_torch_functions_type.
    ("O4", dict(cast_model_type=BF16), ["O4 runs the forward under torch.autocast",
                                        "cast_model_type must stay None", "'O5'"]),
    ("O4", dict(cast_model_type=FP16), ["cast_model_type must stay None"]),
    ("O4", dict(keep_batchnorm_fp32=False), ["With opt_level O4",
                                             "keep_batchnorm_fp32 must be None"]),
    ("O4", dict(keep_batchnorm_fp32=True), ["keep_batchnorm_fp32 must be None"]),
    ("O4", dict(master_weights=False), ["master_weights with O1 and O4", "'O5'"]),
    ("O4", dict(master_weights=True), ["master_weights with O1 and O4"]),
    ("O5", dict(patch_torch_functions=True), ["belongs to opt_level='O1' or 'O4'", "O5"]),
    ("O0", dict(patch_torch_functions="True"), ["belongs to opt_level='O1' or 'O4'"]),
    ("O3", dict(patch_torch_functions=True), ["belongs to opt_level='O1' or 'O4'"]),
    ("O1", dict(patch_torch_functions_type=BF16), ["must be torch.float16 at opt_level 'O1'",
                                                   "opt_level='O4'"]),
    ("O1", dict(patch_torch_functions_type=FP32), ["must be torch.float16 at opt_level 'O1'"]),
    ("O4", dict(patch_torch_functions_type=FP16), ["must be torch.bfloat16 at opt_level 'O4'",
                                                   "opt_level='O1'"]),
    ("O4", dict(patch_torch_functions_type=FP32), ["must be torch.bfloat16 at opt_level 'O4'"]),
    ("O1", dict(patch_torch_functions_type=FP16, half_dtype=BF16), ["contradicts"]),
] + [(level, dict(patch_torch_functions_type=dtype),
      ["patch_torch_functions_type", "should only be set by selecting opt_level='O1' or 'O4'",
       f"{level} runs no autocast"])
     for level in ("O0", "O2", "O3", "O5") for dtype in (FP16, BF16)] + [
    # The level names its half type: another half_dtype is refused (decided here; ROCm apex has
    # no half_dtype).
    ("O4", dict(half_dtype=FP16), ["O4 is O1 in torch.bfloat16", "opt_level='O1' with "
                                   "half_dtype=torch.float16"]),
    ("O5", dict(half_dtype=FP16), ["O5 is O2 in torch.bfloat16", "opt_level='O2' with "
                                   "half_dtype=torch.float16"]),
    ("O5", dict(half_dtype=BF16, cast_model_type=FP16), ["contradicts"]),
    ("O5", dict(cast_model_type=FP32, keep_batchnorm_fp32=False), ["keeps the whole model"]),
]


@pytest.mark.parametrize("level, kwargs, words", REFUSALS,
                         ids=[f"{lv}-{'-'.join(f'{k}={v}' for k, v in kw.items())}"
                              for lv, kw, _ in REFUSALS])
def test_contradictory_overrides_raise_with_the_reason(level, kwargs, words):
    with pytest.raises(ValueError) as err:
        resolve_properties(level, device_type="cpu", **kwargs)
    for word in words:
        assert word in str(err.value), str(err.value)
    assert isinstance(err.value, RuntimeError)


ACCEPTED = [
    ("O3", dict(keep_batchnorm_fp32=True), {}),      # apex's documented speed baseline
    ("O3", dict(master_weights=True), {}),
    ("O2", dict(loss_scale=128.0), {}),
    ("O1", dict(loss_scale=1.0, patch_torch_functions=False), dict(patch_torch_functions_type=None)),
    ("O0", dict(keep_batchnorm_fp32=True), {}),
    # ROCm apex accepts these at O1, O4 and O5.
    ("O1", dict(patch_torch_functions_type=FP16), dict(half_dtype=FP16)),
    ("O1", dict(cast_model_type=FP32), dict(patch_torch_functions=True,
                                            patch_torch_functions_type=BF16)),
    ("O4", dict(patch_torch_functions_type=BF16), dict(patch_torch_functions=True)),
    ("O4", dict(loss_scale="dynamic"), {}),
    ("O4", dict(loss_scale="128.0"), dict(loss_scale=128.0)),
    ("O4", dict(cast_model_type=FP32), dict(patch_torch_functions=True,
                                            patch_torch_functions_type=BF16)),
    ("O4", dict(cast_model_type=False), dict(cast_model_type=None,
                                             patch_torch_functions_type=BF16)),
    ("O4", dict(patch_torch_functions=False), dict(patch_torch_functions_type=None)),
    ("O4", dict(half_dtype=BF16), {}),
    ("O5", dict(loss_scale="dynamic"), {}),
    ("O5", dict(loss_scale=1024), dict(loss_scale=1024.0)),
    ("O5", dict(keep_batchnorm_fp32="False"), dict(keep_batchnorm_fp32=False)),
    ("O5", dict(master_weights=False), dict(keeps_master_weights=False)),
    ("O5", dict(patch_torch_functions=False), {}),
    ("O5", dict(cast_model_type=FP32), dict(keeps_master_weights=True)),
    ("O5", dict(half_dtype=BF16), {}),
    # ROCm apex accepts an fp16 O5 (with O5's static scale 1.0; amp.initialize warns).
    ("O5", dict(cast_model_type=FP16), dict(half_dtype=FP16, loss_scale=1.0)),
]


@pytest.mark.parametrize("level, kwargs, also", ACCEPTED,
                         ids=[f"{lv}-{'-'.join(f'{k}={v}' for k, v in kw.items())}"
                              for lv, kw, _ in ACCEPTED])
def test_sensible_overrides_are_accepted(level, kwargs, also):
    properties = resolve_properties(level, device_type="cpu", **kwargs)
    # apex's argparse strings ("128.0", "False") and cast_model_type=False come with their
    # parsed value in ``also``.
    expected = {name: value for name, value in kwargs.items()
                if value == "dynamic" or not (isinstance(value, str) or value is False)}
    expected.update(also)
    for name, value in expected.items():
        assert getattr(properties, name) == value, name


def test_initialize_reports_an_unknown_level_without_touching_the_model():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    forward = model.forward
    with pytest.raises(ValueError, match="letter O"):
        amp.initialize(model, opt, opt_level="02")
    assert model.weight.dtype == torch.float32 and model.forward == forward
    assert not hasattr(opt, "_apex_lite_amp")
