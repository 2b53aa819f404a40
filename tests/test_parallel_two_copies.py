"""O2's two copies on 2 gloo ranks (issue 49, item 6 and "what must work" 1): whatever makes the
ranks' half models equal makes their masters bitwise equal, a write to the masters reaches the
half models, and a write made before amp's master broadcast survives it.

Every case runs in its own pair of processes with a deadline (tests/case_ranks.py: a hang fails
its case and kills it), all of them from one start of two workers for this module; ranks are
seeded apart; O2 and O5, the fused (default) and the unfused step; the suite runs it on both
backends.
"""
from __future__ import annotations

import pytest
import torch

import case_ranks
from amp_habits import RUNS
from workers.two_copies_cases import CASES, WRITTEN  # noqa: E402

pytestmark = pytest.mark.skipif(not case_ranks.AVAILABLE, reason=case_ranks.REASON)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return case_ranks.run("two_copies_cases", list(CASES), tmp_path_factory.mktemp("two_copies"),
                          case_seconds=60, jobs=8)


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _assert_bitwise_equal_across_ranks(r0, r1, what):
    for key in ("masters", "half"):
        for i, (a, b) in enumerate(zip(r0[key], r1[key])):
            assert torch.equal(a, b), (f"{what}: {key}[{i}] differs between the ranks by "
                                       f"{(a.float() - b.float()).abs().max():.3g}")


def _assert_half_is_the_masters_rounding(result):
    for i, (half, master) in enumerate(zip(result["half"], result["masters"])):
        assert torch.equal(half, master.to(half.dtype)), (
            f"half parameter {i} is {(half.float() - master).abs().max():.3g} away from its "
            f"master")


@pytest.mark.parametrize("level, path", RUNS)
def test_model_averaging_of_the_masters_reaches_the_half_models(cases, level, path):
    r0, r1 = cases[f"local_sgd-{level}-{path}"].results()
    for result in (r0, r1):
        _assert_half_is_the_masters_rounding(result)
    _assert_bitwise_equal_across_ranks(r0, r1, "after averaging")


@pytest.mark.parametrize("level, path", RUNS)
def test_a_checkpoint_on_rank_0_alone_keeps_the_masters_equal(cases, level, path):
    r0, r1 = cases[f"local_sgd_checkpoint_on_rank_0-{level}-{path}"].results()
    _assert_bitwise_equal_across_ranks(r0, r1, "after rank 0's state_dict()")
    for result in (r0, r1):
        _assert_half_is_the_masters_rounding(result)


WHEN = ["before_DDP", "after_DDP", "before_apex_DDP"]


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("level, path", RUNS)
def test_a_write_before_the_master_broadcast_survives_it(cases, level, path, when):
    r0, r1 = cases[f"write_{when}-{level}-{path}"].results()
    written = torch.tensor(WRITTEN).to(r0["half"][0].dtype)
    for rank, result in enumerate((r0, r1)):
        assert torch.equal(result["half"][0], torch.full_like(result["half"][0], written)), rank
        assert torch.equal(result["saved"], torch.full_like(result["saved"], written.float()))
    _assert_bitwise_equal_across_ranks(r0, r1, "after training at lr 0")


@pytest.mark.parametrize("level, path", RUNS)
def test_a_hand_broadcast_of_the_parameters_reaches_the_masters(cases, level, path):
    ranks = cases[f"sync_by_dist.broadcast-{level}-{path}"].results()
    for result in ranks:
        for master, rank0 in zip(result["synced"]["masters"], result["rank0_half"]):
            assert torch.equal(master.to(rank0.dtype), rank0)
    # Training goes on from rank 0's weights on both ranks: the same model, to bf16's precision.
    for m0, m1 in zip(ranks[0]["trained"]["masters"], ranks[1]["trained"]["masters"]):
        torch.testing.assert_close(m0, m1, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("how", ["p.copy_", "Reducer", "average"])
@pytest.mark.parametrize("level, path", RUNS)
def test_a_sync_init_of_the_half_models_makes_the_masters_bitwise_equal(cases, level, path,
                                                                        how):
    r0, r1 = cases[f"sync_by_{how}-{level}-{path}"].results()
    for result in (r0, r1):
        assert _equal(result["synced"]["half"], r0["rank0_half"]) or how == "average"
        _assert_half_is_the_masters_rounding(result["synced"])
    _assert_bitwise_equal_across_ranks(r0["synced"], r1["synced"], "after the sync")
    _assert_bitwise_equal_across_ranks(r0["trained"], r1["trained"], "after training")
