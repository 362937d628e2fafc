#!/usr/bin/python3
"""PyTorch's DataLoader on the data_loader benchmark's workload, as the peer
that bench/data_loader.cc reports its ratio against.

3x64x64 uint8 images held in memory (--image), random crop to 56 (--crop),
horizontal flip, ToTensor-style scaling and Normalize, batch 64, shuffled, --workers
worker processes (the benchmark passes its --threads); with --defer-normalize
the workers ship uint8 crops and the main loop scales and normalises each
batch, as troupe's consumer does then: what torchvision's RandomCrop + RandomHorizontalFlip + ToTensor +
Normalize do, written with plain tensor ops (Debian has no torchvision).
Prints one JSON line, then leaves with os._exit(0): the DataLoader's worker
processes are not joined (the benchmark kills the process group once the
result is in). Run with Debian's python3-torch: /usr/bin/python3.
"""
import argparse
import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


class Images(Dataset):
    def __init__(self, size, image, crop, seed, defer=False):
        self.defer = defer
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (size, 3, image, image), dtype=torch.uint8, generator=g)
        self.labels = torch.randint(0, 10, (size,), generator=g)
        self.crop = crop
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = self.images[i]
        h, w = img.shape[1:]
        # RandomCrop(crop)
        top = int(torch.randint(0, h - self.crop + 1, (1,)))
        left = int(torch.randint(0, w - self.crop + 1, (1,)))
        img = img[:, top:top + self.crop, left:left + self.crop]
        # RandomHorizontalFlip()
        if torch.rand(1) < 0.5:
            img = img.flip(-1)
        if self.defer:
            return img.contiguous(), self.labels[i]
        # ToTensor() then Normalize(MEAN, STD)
        x = img.float().div(255)
        x = x.sub_(self.mean).div_(self.std)
        return x, self.labels[i]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--image", type=int, default=64)
    p.add_argument("--crop", type=int, default=56)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--defer-normalize", action="store_true")
    args = p.parse_args()
    # One thread for the main loop's work, as the benchmark gives troupe's
    # consumer (at::set_num_threads(1)); the workers have one each anyway.
    torch.set_num_threads(1)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)

    def finish(x):
        # The consumer's half of a deferred normalisation.
        return x.float().div_(255).sub_(mean).div_(std) if args.defer_normalize else x

    ds = Images(args.size, args.image, args.crop, seed=0, defer=args.defer_normalize)
    loader = DataLoader(ds, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                        persistent_workers=args.workers > 0, drop_last=False)
    checksum = 0.0
    for x, y in loader:  # warm-up epoch: starts the workers
        checksum += float(finish(x)[0, 0, 0, 0])
    batches = samples = 0
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        for x, y in loader:
            checksum += float(finish(x)[0, 0, 0, 0])
            batches += 1
            samples += x.shape[0]
    elapsed = time.perf_counter() - start
    print(json.dumps({
        "bench": "data_loader",
        "case": "torch_dataloader",
        "value": samples / elapsed,
        "unit": "samples/s",
        "batches_per_s": batches / elapsed,
        "batch": args.batch,
        "workers": args.workers,
        "defer_normalize": args.defer_normalize,
        "samples": samples,
        "seconds": elapsed,
        "torch": torch.__version__,
    }, separators=(",", ":")), flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
