"""fp8 under amp across processes (tests/workers/fp8_worker.py): N steps, a checkpoint loaded
with ``weights_only=True`` into a fresh process and model, N more steps, bit for bit the 2N
steps of one run; and two gloo ranks on the CPU under DDP and FSDP2, whose fp8 state and
weights stay equal on every rank."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gloo_ranks

WORKER = Path(__file__).parent / "workers" / "fp8_worker.py"
RECIPES = ("current", "delayed")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8_resume")
    for job in ("train", "resume"):
        done = subprocess.run([sys.executable, str(WORKER), job, str(out)], capture_output=True,
                              text=True, timeout=300)   # the apex_lite the tests import
        assert done.returncode == 0, f"{job}:\n{done.stdout}\n{done.stderr}"
    return torch.load(out / "train.pt"), torch.load(out / "resume.pt")


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_resume_in_a_fresh_process_is_bitwise_the_uninterrupted_run(resumed, recipe):
    full, resumed_run = resumed[0][recipe], resumed[1][recipe]
    for a, b in zip(full["params"], resumed_run["params"]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    for key in full["model_state"]:
        torch.testing.assert_close(resumed_run["model_state"][key], full["model_state"][key],
                                   rtol=0, atol=0)
    assert full["loss_scaler0"] == resumed_run["loss_scaler0"]
    assert full["fp8"]["models"][0]["steps"] == resumed_run["fp8"]["models"][0]["steps"]
    for name, layer in full["fp8"]["models"][0]["layers"].items():
        for key, value in layer.items():
            torch.testing.assert_close(resumed_run["fp8"]["models"][0]["layers"][name][key],
                                       value, rtol=0, atol=0)
    assert full["report"] == resumed_run["report"]
    if recipe == "delayed":   # the big input before the checkpoint was clipped and counted
        assert full["report"]["fc1"]["input"]["saturated"] > 0
        assert full["fp8"]["models"][0]["steps"] == 10


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8_dist")
    procs = gloo_ranks.start(WORKER, ["dist", str(out)], 2)
    gloo_ranks.finish(procs, "fp8 dist", 300)
    return [torch.load(out / f"dist_rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("case", ["ddp_current", "ddp_delayed", "fsdp_delayed"])
def test_two_ranks_train_in_fp8_and_keep_one_state(ranks, case):
    first, second = ranks[0][case], ranks[1][case]
    assert first["calls"] == second["calls"] == 6 * 5          # fc1: 2 matmuls, fc2: 3
    assert first["losses"] != second["losses"]                 # each rank its own data
    for a, b in zip(first["params"], second["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    layers = [run["fp8"]["models"][0]["layers"] for run in (first, second)]
    for name in layers[0]:
        for key, value in layers[0][name].items():
            if key != "counts":                                  # counts are each rank's own
                torch.testing.assert_close(layers[1][name][key], value, rtol=0, atol=0)
    if case.endswith("delayed"):
        assert first["fp8"]["models"][0]["steps"] == 6
        assert layers[0]["fc1"]["amax_history"][:, :6].gt(0).all()


def test_rank_0s_checkpoint_resumes_every_rank_bitwise(ranks):
    """The delayed recipe's state is all-reduced at each step, so rank 0's checkpoint (saved
    after a step) is every rank's."""
    for rank in ranks:
        full, resumed_run = rank["ddp_delayed"], rank["ddp_delayed_resumed"]
        assert resumed_run["losses"] == full["losses"][3:]
        for a, b in zip(full["params"], resumed_run["params"]):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        for name, layer in full["fp8"]["models"][0]["layers"].items():
            for key in ("amax_history", "scale", "pending_amax"):
                torch.testing.assert_close(
                    resumed_run["fp8"]["models"][0]["layers"][name][key], layer[key],
                    rtol=0, atol=0)


def test_fsdp2_and_ddp_compute_alike(ranks):
    """The same data, model and fp8 scaling, sharded or replicated: the same losses."""
    for rank in ranks:
        assert rank["fsdp_delayed"]["losses"] == pytest.approx(rank["ddp_delayed"]["losses"],
                                                               rel=1e-3)
    assert "fp8: 2 Linear layer(s) in fp8" in ranks[0]["fsdp_delayed"]["report"]
