"""Apex programs with only the import changed (`from apex_lite import amp`): apex's DCGAN example
(two models, two optimizers, num_losses=3, loss_id, module.zero_grad()), an ImageNet-style loop
driven by argparse strings, and a checkpoint in apex's amp.state_dict() format."""
import argparse

import pytest
import torch
import torch.nn as nn

from apex_lite import amp

NZ, NGF, NDF, NC, SIZE = 8, 8, 8, 3, 8


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(NZ, NGF * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(NGF * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 2, NC, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, x):
        return self.main(x)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(NC, NDF, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(NDF * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 2, 1, 2, 1, 0, bias=False))

    def forward(self, x):
        return self.main(x).view(-1, 1).squeeze(1)


def dcgan(opt_level, iterations=3):
    """apex/examples/dcgan/main_amp.py's loop (opt_level None: plain torch, no amp)."""
    torch.manual_seed(0)
    netG, netD = Generator(), Discriminator()
    criterion = nn.BCEWithLogitsLoss()
    optimizerD = torch.optim.SGD(netD.parameters(), lr=0.05)
    optimizerG = torch.optim.SGD(netG.parameters(), lr=0.05)
    if opt_level is not None:
        [netD, netG], [optimizerD, optimizerG] = amp.initialize(
            [netD, netG], [optimizerD, optimizerG], opt_level=opt_level, num_losses=3,
            verbosity=0)
    g = torch.Generator().manual_seed(1)
    for i in range(iterations):
        real = torch.rand(4, NC, SIZE, SIZE, generator=g) * 2 - 1
        noise = torch.randn(4, NZ, 1, 1, generator=g)
        # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        output = netD(real)
        errD_real = criterion(output.float(), torch.full((4,), 1.0))
        if opt_level is None:
            errD_real.backward()
        else:
            with amp.scale_loss(errD_real, optimizerD, loss_id=0) as errD_real_scaled:
                errD_real_scaled.backward()
        fake = netG(noise)
        output = netD(fake.detach())
        errD_fake = criterion(output.float(), torch.full((4,), 0.0))
        if opt_level is None:
            errD_fake.backward()
        else:
            with amp.scale_loss(errD_fake, optimizerD, loss_id=1) as errD_fake_scaled:
                errD_fake_scaled.backward()
        optimizerD.step()
        # (2) Update G: maximize log(D(G(z)))
        netG.zero_grad()
        output = netD(fake)
        errG = criterion(output.float(), torch.full((4,), 1.0))
        if opt_level is None:
            errG.backward()
        else:
            with amp.scale_loss(errG, optimizerG, loss_id=2) as errG_scaled:
                errG_scaled.backward()
        optimizerG.step()
    params = [p for net in (netD, netG) for p in net.parameters()]
    masters = params if opt_level is None else \
        list(amp.master_params(optimizerD)) + list(amp.master_params(optimizerG))
    return [m.detach().float() for m in masters]


def test_dcgan_o0_is_plain_torch_bit_for_bit():
    reference = dcgan(None)
    for a, b in zip(dcgan("O0"), reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [s.steps for s in amp.loss_scalers()] == [3, 3, 3]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_dcgan_mixed_precision_follows_fp32(level):
    reference = dcgan(None)
    got = dcgan(level)
    # bf16 arithmetic on an adversarial pair drifts (up to ~0.32 of the change training made
    # here); gradients accumulated across iterations, as when module.zero_grad() left O2's
    # master gradients in place, put it above 1.
    start = dcgan(None, iterations=0)
    for a, b, s in zip(got, reference, start):
        assert (a - b).norm() <= 0.4 * (b - s).norm() + 1e-3
    assert [s.steps for s in amp.loss_scalers()] == [3, 3, 3]


def imagenet_style(argv):
    """apex/examples/imagenet/main_amp.py's setup: argparse strings straight into initialize."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", type=str)
    parser.add_argument("--keep-batchnorm-fp32", type=str, default=None)
    parser.add_argument("--loss-scale", type=str, default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      keep_batchnorm_fp32=args.keep_batchnorm_fp32,
                                      loss_scale=args.loss_scale, verbosity=0)
    criterion = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(2)
    for i in range(3):
        images = torch.randn(4, 3, 8, 8, generator=g)
        target = torch.randint(0, 4, (4,), generator=g)
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("argv, bn_dtype, scale", [
    (["--opt-level", "O2", "--keep-batchnorm-fp32", "True", "--loss-scale", "128.0"],
     torch.float32, 128.0),
    (["--opt-level", "O2", "--keep-batchnorm-fp32", "False", "--loss-scale", "dynamic"],
     torch.bfloat16, 65536.0),
    (["--opt-level", "O2"], torch.float32, 65536.0),
    (["--opt-level", "O1", "--loss-scale", "dynamic"], torch.float32, 65536.0),
    (["--opt-level", "O3", "--keep-batchnorm-fp32", "True"], torch.float32, 1.0),
])
def test_imagenet_style_argparse_strings(argv, bn_dtype, scale):
    model = imagenet_style(argv)
    assert model[1].weight.dtype == bn_dtype
    assert amp.loss_scalers()[0].loss_scale == scale and amp.loss_scalers()[0].steps == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_checkpoint_in_apex_format_loads(tmp_path):
    # What apex's amp.state_dict() wrote (apex 0.1, two losses), saved with torch.save.
    apex_state = {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 17},
                  "loss_scaler1": {"loss_scale": 8192.0, "unskipped": 3}}
    torch.save({"epoch": 4, "amp": apex_state}, tmp_path / "apex.pt")
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", num_losses=2,
                                      verbosity=0)
    checkpoint = torch.load(tmp_path / "apex.pt")
    amp.load_state_dict(checkpoint["amp"])
    assert [(s.loss_scale, s.unskipped) for s in amp.loss_scalers()] == [(1024.0, 17),
                                                                        (8192.0, 3)]
    # What apex_lite writes back keeps apex's keys, so apex itself can read the loss scalers.
    state = amp.state_dict()
    assert {k: state[k] for k in apex_state} == apex_state
