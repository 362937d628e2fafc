#!/usr/bin/python3
"""For the language-model cases of bench/train_throughput.cc: writes into
DIR the TorchScript step module troupe's trainers run (examples/train_lm's
TinyGPT, scripted, seed 0) and a token stream of random bytes (uint16) with
enough windows of --block for every worker's batch. Prints one JSON object
naming the files, or one with an "error"."""
import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "train_lm"))
from model import TinyGPT  # noqa: E402


def write_lm(directory, block, width, layers, heads, windows):
    """Writes DIR/lm_step.pt (TinyGPT, scripted, seed 0) and DIR/tokens.bin
    (random bytes as uint16, windows × block + 1 of them); returns their
    paths and the parameter count."""
    torch.manual_seed(0)
    model = torch.jit.script(TinyGPT(block_size=block, width=width, layers=layers, heads=heads))
    step = os.path.join(directory, "lm_step.pt")
    torch.jit.save(model, step)
    tokens = os.path.join(directory, "tokens.bin")
    np.random.default_rng(0).integers(0, 256, windows * block + 1, dtype=np.uint16).tofile(tokens)
    return {"step": step, "tokens": tokens, "parameters": sum(p.numel() for p in model.parameters())}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--windows", type=int, default=256)
    a = p.parse_args()
    print(json.dumps(write_lm(a.dir, a.block, a.width, a.layers, a.heads, a.windows)), flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # the benchmark prints it as the case's error row
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        sys.exit(1)
