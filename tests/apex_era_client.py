"""Third-party apex-era code, unmodified (tests/third_party/, ORIGINS.md), driven the way its
own training scripts drive it, through ``import apex``. Run by tests/test_apex_era_scripts.py,
one case per process, under ``python -m apex_lite.apex_alias``; it writes what happened (losses,
loss scales, ...) as JSON. Each case trains the same small model twice: as the project's fp32
run does, and through apex's amp, so that the test can compare them.

    python -m apex_lite.apex_alias apex_era_client.py --case gnmt --out result.json

cuda_on_cpu.py points the few torch.cuda entry points the code calls at the CPU.
"""
import argparse
import json
import os
import sys
import tempfile
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "third_party"))
import cuda_on_cpu  # noqa: E402

cuda_on_cpu.install()

STEPS = 12


def mlp(seed=0, d_in=16, width=32, d_out=8):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, d_out))


def batches(count, d_in=16, d_out=8, n=32, seed=7):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(d_in, d_out, generator=g)
    for _ in range(count):
        x = torch.randn(n, d_in, generator=g)
        yield x, (x @ teacher).argmax(1)


def params_of(model):
    return [p.detach().float().flatten().tolist() for p in model.parameters()]


# ---- fairseq: fairseq/optim/fused_adam.py --------------------------------------------------

def case_fairseq(args):
    import fairseq_fused_adam
    from apex.optimizers import FusedAdam

    fused_adam_cls = fairseq_fused_adam.get_fused_adam_class()
    result = {"class": fused_adam_cls.__name__ if fused_adam_cls else None}

    def train(make, dtype=torch.float32):
        model = mlp().to(dtype)
        optimizer = make(model.parameters())
        losses = []
        for x, y in batches(STEPS):
            loss = torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return {"losses": losses, "params": params_of(model)}

    # What fairseq's FairseqAdam passes (lr, betas, eps, weight_decay); FusedAdam's default
    # adam_w_mode=True is AdamW.
    hyper = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    for name, make, dtype in [
            ("fairseq_adamw", lambda p: fused_adam_cls(p, **hyper), torch.float32),
            ("torch_adamw", lambda p: torch.optim.AdamW(p, **hyper), torch.float32),
            ("apex_fused_adamw", lambda p: FusedAdam(p, **hyper), torch.float32),
            ("fairseq_adam", lambda p: fused_adam_cls(p, adam_w_mode=False, **hyper),
             torch.float32),
            ("torch_adam", lambda p: torch.optim.Adam(p, **hyper), torch.float32),
            # --memory-efficient-fp16 hands it fp16 parameters (its g_16/p_16 lists).
            ("fairseq_adamw_fp16", lambda p: fused_adam_cls(p, **hyper), torch.float16),
            ("apex_fused_adamw_fp16", lambda p: FusedAdam(p, **hyper), torch.float16)]:
        result[name] = train(make, dtype)
    probe = fused_adam_cls(mlp().parameters(), **hyper)
    result["attributes"] = {"adam_w_mode": probe.adam_w_mode,
                            "buf": [str(probe._dummy_overflow_buf.dtype),
                                    probe._dummy_overflow_buf.tolist()]}
    return result


# ---- DeepLearningExamples GNMT: seq2seq/train/fp_optimizers.py ----------------------------

class Seq2SeqLike(torch.nn.Module):
    """Embedding, LSTM, a classifier over the vocabulary: GNMT's kinds of layers, small."""

    def __init__(self, vocab=40, width=32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, width)
        self.rnn = torch.nn.LSTM(width, width, batch_first=True)
        self.classifier = torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.classifier(self.rnn(self.embed(tokens))[0])


def gnmt_batches(count, vocab=40, n=8, length=6):
    """A translation the model can learn: each target token a fixed function of its source."""
    g = torch.Generator().manual_seed(3)
    table = torch.randperm(vocab, generator=g)
    for _ in range(count):
        tokens = torch.randint(0, vocab, (n, length), generator=g)
        yield tokens, table[tokens]


def case_gnmt(args):
    import apex
    import gnmt_fp_optimizers as fp_optimizers
    from apex import amp

    iter_size = 2   # the trainer's --train-iter-size: update=False on all but the last

    def run(math):
        model = Seq2SeqLike()
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        if math == "fp32":
            fp_optimizer = fp_optimizers.FP32Optimizer(model, grad_clip=5.0)
        else:   # seq2seq/train/trainer.py's math == 'fp16'
            model, optimizer = amp.initialize(model, optimizer,
                                              cast_model_outputs=torch.float16,
                                              keep_batchnorm_fp32=False, opt_level='O2',
                                              **args.amp_options)
            fp_optimizer = fp_optimizers.AMPOptimizer(model, grad_clip=5.0, loss_scale=4096,
                                                      dls_upscale_interval=3)
        losses, scales = [], []
        for i, (src, tgt) in enumerate(gnmt_batches(2 * STEPS)):
            output = model(src)
            loss = torch.nn.functional.cross_entropy(output.float().flatten(0, 1),
                                                     tgt.flatten(), reduction="sum")
            losses.append(loss.item() / tgt.numel())
            loss = loss / (src.shape[0] * iter_size)
            if math != "fp32" and i == 0:
                scales.append(apex.amp._amp_state.loss_scalers[0].loss_scale())
            fp_optimizer.step(loss, optimizer, scheduler, update=(i + 1) % iter_size == 0)
            if math != "fp32" and (i + 1) % iter_size == 0:
                scales.append(amp.loss_scalers()[0].loss_scale)
        out = {"losses": losses, "params": params_of(model)}
        if math != "fp32":
            out.update(scales=scales, scale_window=amp.loss_scalers()[0].scale_window,
                       decisions=amp.loss_scalers()[0].steps,
                       dtype=str(model.classifier.weight.dtype))
        return out

    return {"fp32": run("fp32"), "amp": run("amp")}


# ---- DeepLearningExamples BERT: optimization.py (BertAdam), fine-tuning -------------------

def case_bert_finetune(args):
    import bert_optimization
    from apex import amp

    def run(use_amp):
        model = mlp()
        no_decay = ["bias"]
        named = list(model.named_parameters())
        groups = [{"params": [p for n, p in named if not any(nd in n for nd in no_decay)],
                   "weight_decay": 0.01},
                  {"params": [p for n, p in named if any(nd in n for nd in no_decay)],
                   "weight_decay": 0.0}]
        optimizer = bert_optimization.BertAdam(groups, lr=5e-3, warmup=0.1, t_total=STEPS)
        if use_amp:   # run_squad.py's --fp16
            model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
                                              keep_batchnorm_fp32=False, loss_scale="dynamic",
                                              **args.amp_options)
        losses = []
        for x, y in batches(STEPS):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            if use_amp:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            else:
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return {"losses": losses, "params": params_of(model)}

    looked_up = {name: getattr(bert_optimization, name).__name__
                 for name in ("multi_tensor_l2norm", "lamb_compute_update", "lamb_apply_update",
                              "scale")}
    return {"looked_up": looked_up, "fp32": run(False), "amp": run(True)}


# ---- DeepLearningExamples BERT, 2019: BertLAMB through the LAMB stage ops -------------------

def _process_group():
    if not torch.distributed.is_initialized():
        store = os.path.join(tempfile.mkdtemp(), "store")
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0,
                                             world_size=1)


def lamb_reference(params, grads_per_step, *, lr, decay_of, max_norm, b1=0.9, b2=0.999,
                   eps=1e-6, warmup=0.1, t_total):
    """BertLAMB's update in float64, from its source and apex's stage kernels: the step count it
    passes is the one it just incremented, which the kernel corrects for as step + 1."""
    p = [t.detach().double().clone() for t in params]
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    for step, grads in enumerate(grads_per_step, start=1):
        g = [t.double() for t in grads]
        norm = float(torch.sqrt(sum((t * t).sum() for t in g)))
        clip = norm / max_norm if norm > max_norm else 1.0
        x = step / t_total
        lr_now = lr * (x / warmup if x < warmup else (1.0 - x) ** 0.5)
        for i in range(len(p)):
            gi = g[i] / clip
            m[i] = m[i] * b1 + (1 - b1) * gi
            v[i] = v[i] * b2 + (1 - b2) * gi * gi
            update = (m[i] / (1 - b1 ** (step + 1))) / ((v[i] / (1 - b2 ** (step + 1))).sqrt()
                                                        + eps) + decay_of[i] * p[i]
            pn, un = float(p[i].norm()), float(update.norm())
            ratio = lr_now * pn / un if pn != 0 and un != 0 else lr_now
            p[i] = p[i] - ratio * update
    return p


def case_bert_lamb_2019(args):
    import bert_optimization_2019
    from apex import amp
    _process_group()

    def run(use_amp):
        model = mlp()
        named = list(model.named_parameters())
        groups = [{"params": [p for n, p in named if "bias" not in n], "weight_decay": 0.01},
                  {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0}]
        optimizer = bert_optimization_2019.BertLAMB(groups, lr=2e-2, warmup=0.1,
                                                    t_total=STEPS + 1)
        if use_amp:
            model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
                                              loss_scale="dynamic", **args.amp_options)
        losses, grads_per_step = [], []
        start = [p.detach().clone() for group in optimizer.param_groups
                 for p in group["params"]]
        for x, y in batches(STEPS):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            if use_amp:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            else:
                loss.backward()
            grads_per_step.append([p.grad.detach().clone() for group in optimizer.param_groups
                                   for p in group["params"]])
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        out = {"losses": losses, "params": params_of(model)}
        if not use_amp:
            decays = [group["weight_decay"] for group in optimizer.param_groups
                      for _ in group["params"]]
            reference = lamb_reference(start, grads_per_step, lr=2e-2, decay_of=decays,
                                       max_norm=1.0, t_total=STEPS + 1)
            stepped = [p for group in optimizer.param_groups for p in group["params"]]
            out["worst_vs_float64"] = max(float((a.double() - r).abs().max() /
                                                (r.abs().max() + 1e-12))
                                          for a, r in zip(stepped, reference))
        return out

    return {"fp32": run(False), "amp": run(True)}


# ---- DeepLearningExamples BERT: run_pretraining.py --allreduce_post_accumulation -----------

def case_bert_pretraining(args):
    logged = []
    sys.modules["dllogger"] = types.SimpleNamespace(
        log=lambda step, data, **kw: logged.append([step, data]))
    import bert_pretraining_excerpt as run_pretraining
    from apex import amp
    from apex.optimizers import FusedLAMB
    _process_group()
    accumulation = 2

    def run(fp16, overflow_at=None):
        run_pretraining.skipped_steps = 0
        model = mlp()
        named = list(model.named_parameters())
        optimizer = FusedLAMB(
            [{"params": [p for n, p in named if "bias" not in n], "weight_decay": 0.01},
             {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0}], lr=2e-2)
        opts = types.SimpleNamespace(fp16=fp16, allreduce_post_accumulation=True,
                                     allreduce_post_accumulation_fp16=False,
                                     gradient_accumulation_steps=accumulation,
                                     init_loss_scale=2 ** 20, loss_scale=0)
        if fp16:   # prepare_model_and_optimizer, lines 388-394
            model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
                                              loss_scale="dynamic",
                                              cast_model_outputs=torch.float16,
                                              **args.amp_options)
            amp._amp_state.loss_scalers[0]._loss_scale = opts.init_loss_scale
        overflow_buf = torch.cuda.IntTensor([0])   # main(), for allreduce_post_accumulation
        global_step, losses, scaled_over_loss, scales = 0, [], [], []
        for training_steps, (x, y) in enumerate(batches(2 * STEPS), start=1):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            hook = None
            if overflow_at is not None and training_steps == overflow_at:
                hook = model[2].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
            if fp16:   # the training loop, lines 604-606
                with amp.scale_loss(loss, optimizer,
                                    delay_overflow_check=opts.allreduce_post_accumulation
                                    ) as scaled_loss:
                    scaled_loss.backward()
                scaled_over_loss.append(scaled_loss.item() / loss.item())
            else:
                loss.backward()
            if hook is not None:
                hook.remove()
            losses.append(loss.item())
            if training_steps % accumulation == 0:
                global_step = run_pretraining.take_optimizer_step(opts, optimizer, model,
                                                                  overflow_buf, global_step)
                if fp16:
                    scales.append(amp.loss_scalers()[0].loss_scale)
        out = {"losses": losses, "params": params_of(model), "global_step": global_step,
               "skipped_steps": run_pretraining.skipped_steps}
        if fp16:
            scaler = amp._amp_state.loss_scalers[0]
            out.update(scaled_over_loss=scaled_over_loss, scales=scales,
                       typo_kept=scaler._overfloat_buf is not None,
                       finite=all(torch.isfinite(p).all().item() for p in model.parameters()))
        return out

    return {"fp32": run(False), "amp": run(True), "amp_overflow": run(True, overflow_at=5),
            "logged": logged}


CASES = {"fairseq": case_fairseq, "gnmt": case_gnmt, "bert_finetune": case_bert_finetune,
         "bert_lamb_2019": case_bert_lamb_2019, "bert_pretraining": case_bert_pretraining}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    parser.add_argument("--fused-step", choices=["default", "on", "off"], default="default")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    args.amp_options = {"default": {}, "on": {"fused_step": True},
                        "off": {"fused_step": False}}[args.fused_step]
    args.amp_options["verbosity"] = 0
    result = CASES[args.case](args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
