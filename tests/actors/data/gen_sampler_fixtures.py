#!/usr/bin/python3
"""Writes sampler_orders.txt: the index lists of PyTorch's own
torch.utils.data.DistributedSampler, which tests/actors/sampler_test.cc
compares DistributedSampler against. Run with Debian's python3-torch:

    /usr/bin/python3 tests/actors/data/gen_sampler_fixtures.py > tests/actors/data/sampler_orders.txt

Line format: n world seed epoch shuffle drop_last rank : i0 i1 ...
(the test also runs the same cases live through /usr/bin/python3 when it
has torch, so a LibTorch/PyTorch upgrade that changed randperm shows up)."""
import sys

import torch
from torch.utils.data import DistributedSampler

CASES = []
for n in (1, 5, 7, 10, 17, 100):
    for world in (1, 2, 3, 4, 8):
        for seed, epoch in ((0, 0), (42, 3)):
            for shuffle in (True, False) if (n, seed) == (10, 0) else (True,):
                for drop_last in (False, True):
                    CASES.append((n, world, seed, epoch, shuffle, drop_last))
CASES += [(1000, 3, 7, 11, True, False), (5000, 1, 123, 0, True, False), (33, 4, -3, 1, True, False)]


def main(cases=CASES, out=sys.stdout):
    print(f"# torch {torch.__version__}", file=out)
    for n, world, seed, epoch, shuffle, drop_last in cases:
        for rank in range(world):
            s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                   drop_last=drop_last)
            s.set_epoch(epoch)
            idx = " ".join(str(i) for i in s)
            print(f"{n} {world} {seed} {epoch} {int(shuffle)} {int(drop_last)} {rank} : {idx}", file=out)


if __name__ == "__main__":
    main()
