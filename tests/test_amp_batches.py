"""What amp's casts reach (issue 51): the input cast at O2/O3/O5 looks into Mappings
(``collections.UserDict`` and transformers' ``BatchEncoding`` / ``BatchFeature``, which are one),
lists, tuples, namedtuples and dataclasses, and calls a custom batch's own ``.to(dtype)`` (apex's
contract), floating tensors only; the output cast rebuilds a model's ``defaultdict``,
``OrderedDict``, ``ModelOutput``, namedtuple or dataclass as its type; ``scale_loss`` yields a
tensor of the loss's shape on every step path; the cast decorators reach tensors inside list and
tuple arguments.

transformers is not a dependency: ``BatchEncodingLike`` / ``BatchFeatureLike`` / ``ModelOutputLike``
below copy what its classes do that matters here (transformers 4.57.6, tokenization_utils_base.py,
feature_extraction_utils.py, utils/generic.py); the same tests run on the real classes where
transformers is installed."""
import collections
import dataclasses
import logging
import types
from typing import Any, NamedTuple, Optional

import numpy as np
import pytest
import torch

from apex_lite import amp

HALF = {"O2": torch.bfloat16, "O3": torch.bfloat16, "O5": torch.bfloat16}
LEVELS = list(HALF)


class BatchEncodingLike(collections.UserDict):
    """transformers' BatchEncoding: a UserDict (not a dict) whose ``.to`` takes a device only;
    given a dtype (what apex called) it logs that this is not supported and casts nothing."""

    def __init__(self, data=None, encoding=None):
        super().__init__(data)
        self._encodings = encoding
        self.to_calls = []

    def __getattr__(self, item):
        try:
            return self.data[item]
        except KeyError:
            raise AttributeError(item) from None

    def to(self, device, *, non_blocking=False):
        self.to_calls.append(device)
        if isinstance(device, (str, int, torch.device)):
            self.data = {k: v.to(device=device, non_blocking=non_blocking)
                         if callable(getattr(v, "to", None)) else v
                         for k, v in self.data.items()}
        else:
            logging.getLogger("transformers").warning(
                "Attempting to cast a BatchEncoding to type %s. This is not supported.", device)
        return self


class BatchFeatureLike(collections.UserDict):
    """transformers' BatchFeature: its ``.to(dtype)`` casts the floating tensors in place."""

    def to(self, *args, **kwargs):
        self.data = {k: v.to(*args, **kwargs) if isinstance(v, torch.Tensor)
                     and v.is_floating_point() else v for k, v in self.items()}
        return self


@dataclasses.dataclass
class ModelOutputLike(collections.OrderedDict):
    """transformers' ModelOutput: a dataclass and an OrderedDict of its fields that are set,
    kept in step by ``__setitem__``."""

    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    hidden_states: Optional[Any] = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __reduce__(self):
        callable_, _args, *rest = super().__reduce__()
        return (callable_, tuple(getattr(self, f.name) for f in dataclasses.fields(self)),
                *rest)


def _transformers():
    try:
        import transformers
    except ImportError:
        return None
    return transformers


BATCH_TYPES = [BatchEncodingLike, BatchFeatureLike]
OUTPUT_TYPES = [ModelOutputLike]
if _transformers() is not None:   # the real classes, where transformers is installed
    from transformers import BatchEncoding, BatchFeature
    from transformers.modeling_outputs import SequenceClassifierOutput
    BATCH_TYPES += [BatchEncoding, BatchFeature]
    OUTPUT_TYPES += [SequenceClassifierOutput]


class Point(NamedTuple):
    features: torch.Tensor
    ids: torch.Tensor


@dataclasses.dataclass
class Batch:
    features: torch.Tensor
    ids: torch.Tensor
    name: str = "batch"


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    features: torch.Tensor
    ids: torch.Tensor


class ApexStyleBatch:
    """A custom batch class with apex's contract: ``.to(dtype)`` casts its floating tensors."""

    def __init__(self, features, ids):
        self.features, self.ids = features, ids
        self.cast_to = []

    def to(self, dtype):
        self.cast_to.append(dtype)
        return ApexStyleBatch(self.features.to(dtype), self.ids)


class Probe(torch.nn.Module):
    """A half Linear over every floating tensor it is given; what it was given, recorded."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.seen = []

    def forward(self, batch, extra=None):
        self.seen.append((batch, extra))
        features, ids = _parts(batch)
        out = self.linear(features)   # "mat1 and mat2 must have the same dtype" if not cast
        if extra is not None:   # ([tensor], "tag")
            out = out + self.linear(extra[0][0]).sum()
        return out.sum(-1) + ids.float()


def _parts(batch):
    if isinstance(batch, (Point, Batch, FrozenBatch, ApexStyleBatch)):
        return batch.features, batch.ids
    if isinstance(batch, collections.abc.Mapping):
        return batch["features"], batch["ids"]
    return batch[0], batch[1]


def _initialize(level, model=None):
    model = model or Probe()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, optimizer, opt_level=level, verbosity=0)


def _features():
    return torch.randn(3, 4), torch.tensor([1, 2, 3])


MAKERS = {
    "UserDict": lambda f, i: collections.UserDict(features=f, ids=i),
    "dict": lambda f, i: {"features": f, "ids": i},
    "defaultdict": lambda f, i: collections.defaultdict(list, features=f, ids=i),
    "mappingproxy": lambda f, i: types.MappingProxyType({"features": f, "ids": i}),
    "list": lambda f, i: [f, i],
    "tuple": lambda f, i: (f, i),
    "namedtuple": lambda f, i: Point(f, i),
    "dataclass": lambda f, i: Batch(f, i),
    "frozen_dataclass": lambda f, i: FrozenBatch(f, i),
    "apex_style_to": lambda f, i: ApexStyleBatch(f, i),
}
MAKERS.update({cls.__name__: (lambda cls: lambda f, i: cls({"features": f, "ids": i}))(cls)
               for cls in BATCH_TYPES})


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("level", LEVELS)
def test_inputs_are_cast_inside_batches(level, kind, caplog):
    """Floating tensors reach the half model in its dtype, token ids stay int64, the batch keeps
    its type and what else it holds, and the caller's batch is unchanged."""
    model, _ = _initialize(level)
    features, ids = _features()
    batch = MAKERS[kind](features, ids)
    with caplog.at_level(logging.WARNING):
        out = model(batch)
    assert out.dtype == torch.float32
    given, _ = model.seen[-1]
    got_features, got_ids = _parts(given)
    assert got_features.dtype == HALF[level] and torch.equal(got_features, features.to(HALF[level]))
    assert got_ids is ids
    if kind == "mappingproxy":
        assert type(given) is dict   # read-only: a plain dict, as apex made of every Mapping
    elif kind != "apex_style_to":
        assert type(given) is type(batch)
    if kind == "defaultdict":
        assert given.default_factory is list
    if kind == "dataclass":
        assert given.name == "batch"
    if hasattr(batch, "_encodings"):
        assert given._encodings is batch._encodings
    if kind == "apex_style_to":
        assert batch.cast_to == [HALF[level]]
    else:
        assert _parts(batch)[0] is features   # not changed in place
    assert getattr(batch, "to_calls", []) == []
    assert "not supported" not in caplog.text


@pytest.mark.parametrize("level", LEVELS)
def test_keyword_and_nested_inputs(level):
    model, _ = _initialize(level)
    features, ids = _features()
    extra = [torch.randn(2, 4)]
    model({"features": features, "ids": ids}, extra=(extra, "tag"))
    given, given_extra = model.seen[-1]
    assert given_extra[0][0].dtype == HALF[level] and given_extra[1] == "tag"
    assert isinstance(given_extra, tuple) and isinstance(given_extra[0], list)
    assert extra[0].dtype == torch.float32


def test_what_is_not_a_floating_tensor_is_left_alone():
    """Integer and bool tensors, strings, numbers, None, numpy arrays, and a module passed as an
    argument (apex's ``.to(dtype)`` would have cast the module itself)."""
    seen = {}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x, **kwargs):
            seen.update(kwargs)
            return self.linear(x)

    model, _ = _initialize("O2", Model())
    side = torch.nn.Linear(2, 2)
    array = np.ones(3, dtype=np.float32)
    kwargs = dict(mask=torch.ones(3, dtype=torch.bool), ids=torch.arange(3), text="a", n=3,
                  scale=0.5, nothing=None, array=array, module=side, size=torch.Size([2, 3]))
    model(torch.randn(3, 4), **kwargs)
    for key, value in kwargs.items():
        assert seen[key] is value, key
    assert side.weight.dtype == torch.float32


def test_a_custom_batch_whose_to_refuses_a_dtype_is_named():
    class DeviceOnly:
        def to(self, device):
            if isinstance(device, torch.dtype):
                raise ValueError("a device, please")
            return self

    model, _ = _initialize("O2")
    with pytest.raises(TypeError, match=r"DeviceOnly.to\(torch.bfloat16\) raised ValueError: "
                                        r"a device, please.*dataclass"):
        model(DeviceOnly())


# ---- outputs ---------------------------------------------------------------------------------

def _output_makers():
    """{kind: (make(logits, ids), the type it is)}."""
    makers = {
        "defaultdict": (lambda l, i: collections.defaultdict(list, logits=l, ids=i),
                        collections.defaultdict),
        "OrderedDict": (lambda l, i: collections.OrderedDict(logits=l, ids=i),
                        collections.OrderedDict),
        "UserDict": (lambda l, i: collections.UserDict(logits=l, ids=i), collections.UserDict),
        "namedtuple": (lambda l, i: Point(l, i), Point),
        "dataclass": (lambda l, i: Batch(l, i), Batch),
        "tuple": (lambda l, i: (l, [l, i], i), tuple),
    }
    for cls in OUTPUT_TYPES:
        makers[cls.__name__] = ((lambda cls: lambda l, i: cls(loss=l.sum(), logits=l))(cls), cls)
    return makers


OUTPUTS = _output_makers()


@pytest.mark.parametrize("kind", list(OUTPUTS))
@pytest.mark.parametrize("level", LEVELS + ["O1", "O4"])
def test_outputs_leave_in_fp32_as_their_type(level, kind):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return OUTPUTS[kind][0](self.linear(x), torch.tensor([1, 2, 3]))

    model, _ = _initialize(level, Model())
    out = model(torch.randn(3, 4))
    assert _dtypes(out) and all(d == torch.float32 for d in _dtypes(out))
    assert type(out) is OUTPUTS[kind][1]
    if kind == "defaultdict":
        assert out.default_factory is list
        out["missing"].append(1)
    if kind == "tuple":
        assert isinstance(out[1], list) and out[2].dtype == torch.int64
    if kind in [cls.__name__ for cls in OUTPUT_TYPES]:
        assert out.logits is out["logits"] and out.logits.dtype == torch.float32
        assert out.loss.dtype == torch.float32 and list(out.keys()) == ["loss", "logits"]


# ---- scale_loss ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=str)
@pytest.mark.parametrize("level,fused_step", [("O0", None), ("O1", None), ("O2", True),
                                              ("O2", False), ("O3", None), ("O4", None),
                                              ("O5", True), ("O5", False)])
def test_scale_loss_yields_a_tensor_of_the_losss_shape(level, fused_step, shape):
    """apex's scaled loss is the loss times a Python float: the loss's shape; the fused step's
    device scale is [1], and ``scaled_loss.backward(torch.ones_like(loss))`` must still work."""
    model = Probe()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0,
                                      fused_step=fused_step)
    before = [p.detach().clone() for p in amp.master_params(optimizer)]
    features, ids = _features()
    out = model((features, ids))
    loss = out.float().pow(2).mean().reshape(shape)   # amp takes a loss of one element
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        assert scaled_loss.shape == loss.shape and scaled_loss.dtype == torch.float32
        scaled_loss.backward(torch.ones_like(loss))
    optimizer.step()
    after = list(amp.master_params(optimizer))
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


# ---- the cast decorators ---------------------------------------------------------------------

def _recorder():
    seen = []

    def fn(tensors, pair=None, *, named=None):
        seen.append((tensors, pair, named))
        return tensors[0]

    return fn, seen


def _dtypes(value):
    found = []
    amp.casting.apply_to_floats(value, lambda t: found.append(t.dtype) or t)
    return found


@pytest.mark.parametrize("decorator,inputs,expected", [
    ("float_function", (torch.bfloat16, torch.bfloat16), torch.float32),
    ("half_function", (torch.float32, torch.float32), torch.bfloat16),
    ("bfloat16_function", (torch.float32, torch.float16), torch.bfloat16),
    ("promote_function", (torch.bfloat16, torch.float32), torch.float32),
], ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.parametrize("register", [False, True], ids=["decorator", "register"])
def test_decorators_cast_tensors_inside_lists_and_tuples(decorator, inputs, expected, register):
    """apex's casted_args cast the tensors of a list or tuple argument, positional or keyword;
    here too, with token ids left int64, and nothing cast outside autocast."""
    fn, seen = _recorder()
    if register:
        namespace = types.SimpleNamespace(fn=fn)
        getattr(amp, "register_" + decorator)(namespace, "fn")
        wrapped = namespace.fn
    else:
        wrapped = getattr(amp, decorator)(fn)
    a, b = (torch.randn(2, 2).to(d) for d in inputs)
    ids = torch.arange(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wrapped([a, b], pair=(b, ids), named=[a])
    tensors, pair, named = seen[-1]
    assert _dtypes(tensors) == [expected] * 2
    assert _dtypes(pair) == _dtypes(named) == [expected]
    assert pair[1] is ids and isinstance(tensors, list) and isinstance(pair, tuple)
    wrapped([a, b])   # outside autocast: as given
    assert seen[-1][0][0] is a and seen[-1][0][1] is b


def test_a_float_function_in_an_o4_forward_gets_fp32_from_a_list():
    """The issue's case: under O4 (bf16 autocast) a float function given a list got bf16."""
    got = []

    @amp.float_function
    def stable_sum(tensors):
        got.append([t.dtype for t in tensors])
        return torch.stack(tensors).sum(0)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x):
            return stable_sum([self.a(x), self.b(x)])

    model, _ = _initialize("O4", Model())
    out = model(torch.randn(3, 4))
    assert got == [[torch.float32, torch.float32]] and out.dtype == torch.float32
