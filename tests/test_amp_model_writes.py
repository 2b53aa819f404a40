"""O2's masters and the model never disagree silently (issue 41).

At O2 the fp32 masters are a second copy of the model's weights. Wherever something other than
amp changes the model (DDP's broadcast, a module's forward, a re-initialisation, unfreezing),
the masters follow, on both step paths, as fp32 training would; and a parameter that no
optimizer holds keeps no fp32 copy (apex's rule).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gloo_ranks
from apex_lite import amp

PATHS = {"fused": True, "unfused": False}


# ---- item 1: DDP, ranks seeded differently ------------------------------------------------------

@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
@pytest.mark.parametrize("path", PATHS)
def test_ddp_ranks_seeded_differently_train_the_same_model(tmp_path, path):
    worker = Path(__file__).parent / "workers" / "ddp_masters_worker.py"
    procs = gloo_ranks.start(worker, ["--out", str(tmp_path), "--fused-step",
                                      "true" if PATHS[path] else "false"], 2)
    gloo_ranks.finish(procs, "ddp masters", 60)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["path"].startswith("fused" if PATHS[path] else "unfused")
    assert not all(torch.equal(a, b) for a, b in zip(ranks[0]["initial"], ranks[1]["initial"]))
    # Rank 0's own fp32 values on every rank, not the upcast of its half weights.
    for rank in ranks:
        for master, initial in zip(rank["first_forward"], ranks[0]["initial"]):
            assert torch.equal(master, initial)
    for step0, step1 in zip(ranks[0]["steps"], ranks[1]["steps"]):
        for a, b in zip(step0["masters"] + step0["params"], step1["masters"] + step1["params"]):
            assert torch.equal(a, b)
    for key, value in ranks[0]["state_dict"].items():
        assert torch.equal(value, ranks[1]["state_dict"][key])


# ---- item 2: writes to the half model that amp did not make ---------------------------------------

def _embedding_run(level, fused_step=None):
    torch.manual_seed(0)
    model = torch.nn.Embedding(10, 8, max_norm=1.0)
    with torch.no_grad():
        model.weight.mul_(3.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if level is not None:
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0,
                                    fused_step=fused_step)
    idx = torch.tensor([1, 2, 3])
    target = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(idx).float(), target)
        if level is None:
            loss.backward()
        else:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
    weight = model.state_dict()["weight"]
    return float(loss), weight[idx].norm(dim=1)


@pytest.mark.parametrize("path", PATHS)
def test_embedding_max_norm_trains_at_o2_as_in_fp32(path):
    fp32_loss, fp32_norms = _embedding_run(None)
    amp.default_handle().__init__()
    loss, norms = _embedding_run("O2", PATHS[path])
    assert abs(loss - fp32_loss) < 0.05 * fp32_loss
    torch.testing.assert_close(norms, fp32_norms, rtol=0.02, atol=0.02)


def test_state_dict_after_a_renorm_shows_the_renormalised_rows():
    model = torch.nn.Embedding(10, 8, max_norm=1.0)
    with torch.no_grad():
        model.weight.mul_(3.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    model(torch.tensor([1, 2]))
    rows = model.state_dict()["weight"][[1, 2]]
    assert rows.dtype == torch.float32
    assert torch.all(rows.norm(dim=1) <= 1.0 + 1e-2)
    assert torch.equal(model.state_dict()["weight"][[1, 2]].bfloat16(), model.weight[[1, 2]])
    assert model.state_dict()["weight"][5].norm() > 1.5     # a row not looked up: untouched


WRITES = {
    "fill_ under no_grad": lambda p, w: p.fill_(0.25),
    "copy_ under no_grad": lambda p, w: p.copy_(w),
    "nn.init under no_grad": lambda p, w: torch.nn.init.constant_(p, 0.3),
    ".data = a new tensor": lambda p, w: setattr(p, "data", w.to(p.dtype)),
}


@pytest.mark.parametrize("how", WRITES)
@pytest.mark.parametrize("path", PATHS)
def test_a_write_after_initialize_reaches_the_masters_as_in_fp32(path, how):
    def run(level):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if level:
            model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0,
                                        fused_step=PATHS[path])
        w = torch.full((8, 8), 0.5)
        with torch.no_grad():
            WRITES[how](model[0].weight, w)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
        loss = model(x).float().sum()
        if level:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        else:
            loss.backward()
        opt.step()
        return model.state_dict()["0.weight"]
    fp32 = run(None)
    amp.default_handle().__init__()
    torch.testing.assert_close(run("O2"), fp32, rtol=2e-2, atol=2e-2)


def test_a_checkpoint_holds_an_in_place_write_through_data():
    """``p.data += d`` (how peft merges an adapter) bypasses the version counter: no step sees
    it, but the model's and amp's state_dict() compare every parameter with its master."""
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    merged = (model.weight.float() + 0.25).bfloat16()
    model.weight.data += 0.25
    assert torch.equal(model.state_dict()["weight"], merged.float())
    assert torch.equal(amp.state_dict()["apex_lite"]["master_weights"][0][0], merged.float())


def test_a_write_outside_a_forward_is_taken_whole():
    """A write made outside a forward (a user's, through a view of part of the tensor too) is
    taken whole: the master becomes the upcast of the written half tensor, also where a value
    did not change, so that ranks whose half models a write made equal have equal masters (issue
    49). Only a module's own write in its forward keeps the fp32 bits elsewhere (the Embedding
    test above)."""
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    exact = model.weight.detach().clone()
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with torch.no_grad():
        model.weight[0].fill_(2.0)
    state = model.state_dict()["weight"]
    assert torch.equal(state[0], torch.full((8,), 2.0))
    assert torch.equal(state[1:], exact[1:].bfloat16().float())
    assert not torch.equal(state[1:], exact[1:])


# ---- item 3: unfreezing --------------------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
def test_masters_follow_requires_grad_both_ways(path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0,
                                fused_step=PATHS[path])
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert [m.requires_grad for m in masters] == [False, False, True, True]
    x = torch.randn(4, 8)
    model[0].requires_grad_(True)
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    # What mmengine's and mmcv's clip keep of param_groups.
    clipped = [p for p in masters if p.requires_grad and p.grad is not None]
    assert len(clipped) == 4
    opt.step()
    opt.zero_grad()
    model[1].requires_grad_(False)
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    assert [m.requires_grad for m in masters] == [True, True, False, False]


def test_an_unfrozen_layers_clip_norm_is_fp32s():
    def run(level):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        model[0].requires_grad_(False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if level:
            model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
        model[0].requires_grad_(True)
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(3))).float().sum()
        if level:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        else:
            loss.backward()
        params = [p for g in opt.param_groups for p in g["params"]
                  if p.requires_grad and p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, 1.0)
    fp32 = run(None)
    amp.default_handle().__init__()
    torch.testing.assert_close(run("O2"), fp32, rtol=2e-2, atol=1e-3)


# ---- item 4: frozen weights keep no master --------------------------------------------------------

def _frozen_backbone(frozen_master_weights=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64),
                                torch.nn.Linear(64, 4))
    exact = {k: v.clone() for k, v in model.state_dict().items()}
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    opt = torch.optim.AdamW(model[2].parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0,
                                frozen_master_weights=frozen_master_weights)
    return model, opt, exact


def test_frozen_weights_no_optimizer_holds_keep_no_master():
    model, opt, exact = _frozen_backbone()
    run = amp.default_handle()._run
    assert len(run.pairs) == 2                       # the head's weight and bias
    with amp.scale_loss(model(torch.randn(2, 64)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    report = amp.report()
    assert report.tensors["master weights"] == {torch.float32: (2, (64 * 4 + 4) * 4)}
    # 2 bytes for each frozen weight, 16 for the head with AdamW: far below fp32's.
    frozen = 2 * (64 * 64 + 64)
    head = 64 * 4 + 4
    assert report.bytes_per_parameter < 2.2 + 14 * head / (frozen + head)
    state = model.state_dict()
    assert state["0.weight"].dtype == torch.float32
    assert torch.equal(state["0.weight"], exact["0.weight"].bfloat16().float())


def test_frozen_master_weights_keeps_exact_fp32_copies():
    model, opt, exact = _frozen_backbone(frozen_master_weights=True)
    assert len(amp.default_handle()._run.pairs) == 6
    assert torch.equal(model.state_dict()["0.weight"], exact["0.weight"])
    assert "master weights: 6 torch.float32 tensors" in str(amp.report())


def test_a_parameter_that_joins_later_gets_its_master_then():
    model, opt, exact = _frozen_backbone()
    model[1].requires_grad_(True)
    opt.add_param_group({"params": model[1].parameters(), "lr": 1e-3})
    masters = opt.param_groups[1]["params"]
    assert all(m.dtype == torch.float32 for m in masters)
    assert torch.equal(masters[0], exact["1.weight"].bfloat16().float())
    before = masters[0].clone()
    with amp.scale_loss(model(torch.randn(2, 64)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(masters[0], before)
    assert torch.equal(model.state_dict()["1.weight"], masters[0])
    assert torch.equal(model[1].weight, masters[0].bfloat16())
