"""Two real processes on gloo: one rank's overflow makes every rank skip the same step."""
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gloo_ranks

WORKER = Path(__file__).parent / "workers" / "ddp_skip_worker.py"
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def run_ranks(tmp_path, world_size=2, timeout=50, extra=()):
    procs = gloo_ranks.start(WORKER, ["--out", str(tmp_path), *extra], world_size)
    gloo_ranks.finish(procs, "ddp", timeout)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


def test_one_ranks_overflow_skips_the_step_on_every_rank(tmp_path):
    steps, inject = 6, 2
    results = run_ranks(tmp_path, extra=("--steps", str(steps), "--inject-step", str(inject),
                                         "--inject-rank", "1"))
    expected = [step == inject for step in range(steps)]
    for r in results:
        assert r["skipped"] == expected, f"rank {r['rank']} skipped {r['skipped']}"
    assert results[0]["scales"] == results[1]["scales"]
    assert results[0]["scales"][inject] == results[0]["scales"][inject - 1] / 2
    for a, b in zip(results[0]["params"] + results[0]["masters"],
                    results[1]["params"] + results[1]["masters"]):
        assert torch.equal(a, b)
    assert results[0]["params"][0].dtype == torch.bfloat16   # O2 on CPU really ran in half


def test_without_injection_no_rank_skips(tmp_path):
    results = run_ranks(tmp_path, extra=("--steps", "3", "--inject-step", "-1"))
    for r in results:
        assert r["skipped"] == [False] * 3
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fused_step", ["true", "false"])
def test_one_ranks_overflow_skips_every_optimizer_of_the_scale_loss_on_every_rank(tmp_path,
                                                                                  fused_step):
    """apex's rule under DDP: the inf is in optimizer 0's gradient on rank 1 only; both
    optimizers given to the scale_loss skip, on both ranks."""
    steps, inject = 4, 1
    results = run_ranks(tmp_path, extra=("--steps", str(steps), "--inject-step", str(inject),
                                         "--inject-rank", "1", "--two-optimizers",
                                         "--fused-step", fused_step))
    expected = [[step != inject] * 2 for step in range(steps)]
    for r in results:
        assert r["stepped"] == expected, f"rank {r['rank']} stepped {r['stepped']}"
    for a, b in zip(results[0]["params"] + results[0]["masters"],
                    results[1]["params"] + results[1]["masters"]):
        assert torch.equal(a, b)


def test_an_explicit_process_group_is_the_one_the_overflow_flag_is_reduced_over(tmp_path):
    """Without DDP (each rank's gradients its own), each rank passes initialize(process_group=)
    a group of itself alone: rank 1's overflow skips its step only; over the default group,
    both ranks skip it."""
    own = run_ranks(tmp_path, extra=("--steps", "3", "--inject-step", "1", "--inject-rank",
                                     "1", "--own-group", "--no-ddp"))
    assert own[0]["skipped"] == [False] * 3
    assert own[1]["skipped"] == [False, True, False]
    default = run_ranks(tmp_path, extra=("--steps", "3", "--inject-step", "1", "--inject-rank",
                                         "1", "--no-ddp"))
    assert default[0]["skipped"] == default[1]["skipped"] == [False, True, False]
