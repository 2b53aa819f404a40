"""A small conv net with BatchNorm trained under apex_lite.amp O2 on synthetic images.

O2 casts the model to half (bf16 on CPU, fp16 on CUDA) but keeps BatchNorm in fp32
(``keep_batchnorm_fp32``): its weights, biases and running statistics stay fp32, because
batch statistics summed in half precision lose too much. The optimizer steps fp32 master
copies of the half weights. This script prints the dtypes to show it, then trains and reports
the loss and accuracy falling.

    python examples/cnn_batchnorm.py
    python examples/cnn_batchnorm.py --device cuda --steps 300 --batch-size 128 --image-size 32
"""
from __future__ import annotations

import argparse
import logging
import math
import sys

import torch
import torch.nn as nn

from apex_lite import amp

LOG = logging.getLogger("apex_lite.examples.cnn_batchnorm")
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def make_model(channels, classes: int) -> nn.Module:
    """Conv-BatchNorm-ReLU-MaxPool blocks, global average pooling, a linear classifier."""
    layers, in_ch = [], 3
    for out_ch in channels:
        layers += [nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False), nn.BatchNorm2d(out_ch),
                   nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        in_ch = out_ch
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, classes)]
    return nn.Sequential(*layers)


class SyntheticImages:
    """Each class is a fixed random 3-channel pattern; a sample is its pattern plus noise."""

    def __init__(self, classes: int, size: int, noise: float, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(classes, 3, size, size, generator=self.generator)
        self.noise = noise

    def batch(self, batch_size: int, device):
        labels = torch.randint(len(self.templates), (batch_size,), generator=self.generator)
        images = self.templates[labels] + self.noise * torch.randn(
            (batch_size,) + self.templates.shape[1:], generator=self.generator)
        return images.to(device), labels.to(device)


def dtype_report(model: nn.Module, optimizer) -> list:
    """(module, parameter or buffer, dtype) rows for the first conv and first BatchNorm."""
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    master = next(iter(amp.master_params(optimizer)))
    return [("Conv2d", "weight", conv.weight.dtype),
            ("BatchNorm2d", "weight", bn.weight.dtype),
            ("BatchNorm2d", "bias", bn.bias.dtype),
            ("BatchNorm2d", "running_mean", bn.running_mean.dtype),
            ("BatchNorm2d", "running_var", bn.running_var.dtype),
            ("optimizer", "master param", master.dtype)]


def evaluate(model, data: SyntheticImages, batches: int, batch_size: int, device) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for _ in range(batches):
            images, labels = data.batch(batch_size, device)
            correct += (model(images).argmax(dim=1) == labels).sum().item()
            total += labels.numel()
    model.train()
    return correct / total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--opt-level", default="O2")
    p.add_argument("--half-dtype", choices=sorted(HALF_DTYPES),
                   help="default: fp16 on CUDA, bf16 on CPU")
    # Small defaults: on CPUs without bf16 arithmetic (AVX512-BF16, AMX) bf16 convolutions
    # run several times slower than fp32 ones.
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--channels", default="16,32,64", help="output channels of the conv blocks")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--noise", type=float, default=1.0, help="noise std added to the patterns")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--threads", type=int, help="torch threads on CPU (default: torch's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    half_dtype = HALF_DTYPES[args.half_dtype] if args.half_dtype else None

    torch.manual_seed(0)
    model = make_model([int(c) for c in args.channels.split(",")], args.classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      half_dtype=half_dtype, verbosity=0)

    print(f"{'module':<13}{'tensor':<14}dtype")
    for module, tensor, dtype in dtype_report(model, optimizer):
        print(f"{module:<13}{tensor:<14}{dtype}")
    bn_dtypes = {dtype for module, _, dtype in dtype_report(model, optimizer)
                 if module == "BatchNorm2d"}
    if args.opt_level == "O2" and bn_dtypes != {torch.float32}:
        LOG.error("BatchNorm is not fp32 under O2: %s", bn_dtypes)
        return 1

    data = SyntheticImages(args.classes, args.image_size, args.noise)
    loss_fn = nn.CrossEntropyLoss()
    window = max(1, min(10, args.steps // 5))
    losses = []
    for step in range(args.steps):
        images, labels = data.batch(args.batch_size, device)
        loss = loss_fn(model(images), labels)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % max(1, args.steps // 5) == 0:
            LOG.info("step %d: loss %.4f", step + 1, loss.item())

    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    accuracy = evaluate(model, data, 4, args.batch_size, device)
    print(f"loss (mean of {window} steps): first {first:.4f}, last {last:.4f}")
    print(f"accuracy on fresh batches: {accuracy:.1%} (chance {1 / args.classes:.1%})")
    if not math.isfinite(last) or last > 0.5 * first:
        LOG.error("training did not converge: the loss did not fall to half its first value")
        return 1
    print("converged: yes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
