"""apex_lite.parallel.DistributedDataParallel, Reducer and flat_dist_call on 2 gloo ranks
(tests/workers/parallel_worker.py --suite ddp, run once for the module), and DDP's argument
checks in this process.

The reduced gradients are compared bit for bit with apex's formula applied to both ranks' local
gradients: ``allreduce(g * (1 / f)) * (f / world)`` in the bucket's dtype (fp32 with
``allreduce_always_fp32``).
"""
import pytest
import torch

import parallel_ranks
from apex_lite.parallel import DistributedDataParallel as DDP

pytestmark = pytest.mark.skipif(not parallel_ranks.AVAILABLE, reason=parallel_ranks.REASON)

SETTINGS = {   # name: (predivide factor, gradient_average, allreduce_always_fp32)
    "default": (1.0, True, False), "predivide": (4.0, True, False),
    "sum_predivide": (2.0, False, False), "delay": (2.0, True, False),
    "tiny_buckets": (1.0, True, False), "triggers": (1.0, True, False),
    "retain": (1.0, True, False), "bf16": (1.0, True, False), "bf16_fp32": (2.0, True, True),
    "mixed": (1.0, True, False),
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return parallel_ranks.run_suite("ddp", tmp_path_factory.mktemp("ddp"))


def apex_formula(grads, factor, average, always_fp32):
    """What apex's allreduce_bucket leaves in a gradient, computed here from each rank's own."""
    dtype = torch.float32 if always_fp32 else grads[0].dtype
    flats = [g.to(dtype) for g in grads]
    if factor != 1.0:
        flats = [g.mul(1.0 / factor) for g in flats]
    total = flats[0] + flats[1]
    if average:
        total = total.mul(factor / len(grads))
    return total.to(grads[0].dtype)


def test_parameters_not_buffers_are_broadcast_from_rank_0(ranks):
    for rank, result in enumerate(ranks):
        b = result["broadcast"]
        for after, rank0_before in zip(b["after"], ranks[0]["broadcast"]["before"]):
            assert torch.equal(after, rank0_before)
        assert torch.equal(b["running_mean"], torch.full((2,), float(rank)))
        assert b["module_is_net"]
    # The ranks really started apart: rank 1's own weights were replaced.
    assert not torch.equal(ranks[1]["broadcast"]["before"][0], ranks[1]["broadcast"]["after"][0])
    assert ranks[0]["broadcast"]["keys"] == [
        "module.0.weight", "module.0.bias", "module.1.weight", "module.1.bias",
        "module.1.running_mean", "module.1.running_var", "module.1.num_batches_tracked"]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_reduced_gradients_follow_apex_formula_bit_for_bit(ranks, name):
    factor, average, always_fp32 = SETTINGS[name]
    local = [r[name]["local"] for r in ranks]
    assert not torch.equal(local[0][0], local[1][0])   # the ranks' data differ
    for i, (g0, g1) in enumerate(zip(*local)):
        expected = apex_formula([g0, g1], factor, average, always_fp32)
        for rank, result in enumerate(ranks):
            got = result[name]["reduced"][i]
            assert got.dtype == g0.dtype
            assert torch.equal(got, expected), f"{name}: rank {rank}, parameter {i}"


def test_retained_buffers_hold_the_gradients(ranks):
    for result in ranks:
        assert all(result["retain"]["views"])


def test_predivide_keeps_an_fp16_sum_in_range(ranks):
    """40000 on each rank: the plain fp16 sum overflows; predividing by 2, or summing in fp32,
    gives the average."""
    for result in ranks:
        assert torch.isinf(result["fp16_plain"]).all()
        assert torch.equal(result["fp16_predivide"], torch.full((4,), 40000.0,
                                                                dtype=torch.float16))
        assert torch.equal(result["fp16_fp32"], torch.full((4,), 40000.0, dtype=torch.float16))


def test_disable_allreduce_leaves_gradients_local(ranks):
    for rank, result in enumerate(ranks):
        assert all(torch.equal(a, b) for a, b in zip(result["disable"]["disabled"],
                                                      result["default"]["local"]))
        assert all(torch.equal(a, b) for a, b in zip(result["disable"]["enabled"],
                                                      result["default"]["reduced"]))


def test_a_parameter_without_a_gradient_adds_zeros_and_keeps_none(ranks):
    for name in ("never.weight", "never.bias"):
        assert ranks[0]["unused"][name] is None and ranks[1]["unused"][name] is None
    # Rank 0's gradient of b.weight is (its own + rank 1's zeros) / 2; rank 1 keeps None.
    assert ranks[1]["unused"]["b.weight"] is None
    x0 = torch.randn(6, 5, generator=torch.Generator().manual_seed(10))   # rank 0's batch
    own = x0.sum(0).expand(2, 5)
    torch.testing.assert_close(ranks[0]["unused"]["b.weight"], own * 0.5)
    for name in ("a.weight", "a.bias"):
        assert torch.equal(ranks[0]["unused"][name], ranks[1]["unused"][name])


def test_apex_race_condition_test(ranks):
    """apex's tests/distributed/DDP/ddp_race_condition_test.py: with x = i + rank, the averaged
    gradients sum to val * n * (2i + 1) / 2 (a: val 2, b: val 1), every iteration."""
    for result in ranks:
        for i, (a, b) in enumerate(result["race"]):
            assert (a, b) == (2.0 * 4096 * (2 * i + 1) / 2, 1.0 * 4096 * (2 * i + 1) / 2)


def test_reducer_and_flat_dist_call_average_and_broadcast(ranks):
    for result in ranks:
        r = result["reducer"]
        for w, w0 in zip(r["weights"], ranks[0]["reducer"]["weights"]):
            assert torch.equal(w, w0)
        for g in r["grads"]:
            assert torch.equal(g, torch.full_like(g, 1.5))   # (1 + 2) / 2
        assert torch.equal(r["tensors"][0], torch.full((3,), 0.5))
        assert torch.equal(r["tensors"][1], torch.full((2,), 1.0, dtype=torch.float64))
        assert torch.equal(r["broadcast"][0], torch.full((2,), 5.0))
        assert torch.equal(r["averaged"][0], torch.full((2,), 1.5, dtype=torch.bfloat16))


# ---- in this process: what DDP refuses before it needs a process group --------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"shared_param": True}, "shared_param is no longer supported"),
    ({"delay_allreduce": True, "num_allreduce_streams": 2},
     "allreduce_different_streams may only be used if delay_allreduce=False"),
    ({"delay_allreduce": True, "allreduce_trigger_params": []},
     "allreduce_trigger_params is only valid if delay_allreduce=False"),
    ({"gradient_predivide_factor": 0.0}, "gradient_predivide_factor must be a positive finite"),
    ({"message_size": -1}, "message_size is the number of elements per bucket"),
    ({"allreduce_communicators": ([None], [None])}, "allreduce_communicators must be"),
])
def test_apex_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DDP(torch.nn.Linear(2, 2), **kwargs)


def test_without_a_process_group_the_error_says_what_to_call():
    with pytest.raises(RuntimeError, match="init_process_group"):
        DDP(torch.nn.Linear(2, 2))
