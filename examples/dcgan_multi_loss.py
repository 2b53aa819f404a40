"""A small DCGAN with apex_lite.amp: two models, two optimizers, three losses.

As in apex's DCGAN example, ``amp.initialize`` takes both models and both optimizers with
``num_losses=3`` so that every loss has its own dynamic loss scale:

    loss_id 0  errD_real  D on real images      -> backward into D's gradients
    loss_id 1  errD_fake  D on generated images -> backward, accumulated onto errD_real's
               optimizerD.step()                   one step for the sum of both
    loss_id 2  errG       D's verdict on G's images, with "real" labels -> optimizerG.step()

The real images are synthetic: bright Gaussian blobs at random places on a dark 16x16 field.

    python examples/dcgan_multi_loss.py                  # O1, a few hundred iterations
    python examples/dcgan_multi_loss.py --opt-level O2 --device cuda
"""
from __future__ import annotations

import argparse
import logging
import math
import sys

import torch
import torch.nn as nn

from apex_lite import amp

LOG = logging.getLogger("apex_lite.examples.dcgan_multi_loss")
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
IMAGE = 16


class Generator(nn.Module):
    """z (nz x 1 x 1) -> 1 x 16 x 16 image in [-1, 1]: transposed convs with BatchNorm."""

    def __init__(self, nz: int, ngf: int):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False),        # 4 x 4
            nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),       # 8 x 8
            nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, 1, 4, 2, 1, bias=False),             # 16 x 16
            nn.Tanh())

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    """1 x 16 x 16 image -> one logit (BCEWithLogitsLoss: safe under autocast, unlike BCE)."""

    def __init__(self, ndf: int):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(1, ndf, 4, 2, 1, bias=False),                      # 8 x 8
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),                # 4 x 4
            nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False))                  # 1 x 1

    def forward(self, x):
        return self.main(x).view(-1)


def init_weights(m: nn.Module) -> None:
    """DCGAN's initialisation: N(0, 0.02) convs, N(1, 0.02) BatchNorm scales."""
    if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif isinstance(m, nn.BatchNorm2d):
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


def real_images(batch_size: int, generator: torch.Generator, device) -> torch.Tensor:
    """Gaussian blobs (random centre, fixed width) scaled to [-1, 1]."""
    coords = torch.arange(IMAGE, dtype=torch.float32)
    centres = torch.rand(batch_size, 2, generator=generator) * (IMAGE - 6) + 3
    dy = (coords.view(1, IMAGE, 1) - centres[:, 0].view(-1, 1, 1)) ** 2
    dx = (coords.view(1, 1, IMAGE) - centres[:, 1].view(-1, 1, 1)) ** 2
    blobs = torch.exp(-(dx + dy) / (2 * 2.0 ** 2))
    return (2 * blobs - 1).unsqueeze(1).to(device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--opt-level", default="O1")
    p.add_argument("--half-dtype", choices=sorted(HALF_DTYPES),
                   help="default: fp16 on CUDA, bf16 on CPU")
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--nz", type=int, default=32, help="size of the latent vector")
    p.add_argument("--ngf", type=int, default=32)
    p.add_argument("--ndf", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--threads", type=int, help="torch threads on CPU (default: torch's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    half_dtype = HALF_DTYPES[args.half_dtype] if args.half_dtype else None

    torch.manual_seed(0)
    netG = Generator(args.nz, args.ngf).to(device)
    netD = Discriminator(args.ndf).to(device)
    netG.apply(init_weights)
    netD.apply(init_weights)
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(0.5, 0.999))
    [netD, netG], [optimizerD, optimizerG] = amp.initialize(
        [netD, netG], [optimizerD, optimizerG], opt_level=args.opt_level, num_losses=3,
        half_dtype=half_dtype, verbosity=0)

    criterion = nn.BCEWithLogitsLoss()
    data_generator = torch.Generator().manual_seed(1)
    real_label, fake_label = 1.0, 0.0
    history = []
    for iteration in range(1, args.iterations + 1):
        real = real_images(args.batch_size, data_generator, device)
        noise = torch.randn(args.batch_size, args.nz, 1, 1, device=device)

        # (1) Update D: maximise log(D(x)) + log(1 - D(G(z))), two losses, one step.
        optimizerD.zero_grad(set_to_none=True)
        output = netD(real)
        errD_real = criterion(output, torch.full_like(output, real_label))
        with amp.scale_loss(errD_real, optimizerD, loss_id=0) as errD_real_scaled:
            errD_real_scaled.backward()
        D_x = torch.sigmoid(output.float()).mean().item()

        fake = netG(noise)
        output = netD(fake.detach())
        errD_fake = criterion(output, torch.full_like(output, fake_label))
        with amp.scale_loss(errD_fake, optimizerD, loss_id=1) as errD_fake_scaled:
            errD_fake_scaled.backward()
        D_G_z1 = torch.sigmoid(output.float()).mean().item()
        errD = errD_real + errD_fake
        optimizerD.step()

        # (2) Update G: maximise log(D(G(z))).
        optimizerG.zero_grad(set_to_none=True)
        output = netD(fake)
        errG = criterion(output, torch.full_like(output, real_label))
        with amp.scale_loss(errG, optimizerG, loss_id=2) as errG_scaled:
            errG_scaled.backward()
        D_G_z2 = torch.sigmoid(output.float()).mean().item()
        optimizerG.step()

        history.append((errD.item(), errG.item()))
        if iteration % args.log_every == 0 or iteration == args.iterations:
            LOG.info("[%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f",
                     iteration, args.iterations, errD.item(), errG.item(), D_x, D_G_z1, D_G_z2)

    scales = {key: value["loss_scale"] for key, value in amp.state_dict().items()
              if key.startswith("loss_scaler")}
    final_d, final_g = history[-1]
    print(f"final Loss_D: {final_d:.4f}  Loss_G: {final_g:.4f}")
    print("loss scales: " + ", ".join(f"{key}={value:g}" for key, value in scales.items()))
    if not all(math.isfinite(d) and math.isfinite(g) for d, g in history):
        LOG.error("a loss was not finite")
        return 1
    print("losses finite: yes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
