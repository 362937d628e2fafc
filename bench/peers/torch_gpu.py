#!/usr/bin/python3
"""The PyTorch side of bench/gpu_train.cc (issue 17), on the same GPU, run by
the benchmark in the same invocation. Four jobs:

  torch_gpu.py write DIR [--width W ...]
      writes DIR/cnn_step.pt (ResNet18Step below, scripted, seed 0) and
      DIR/lm_step.pt (examples/train_lm's TinyGPT, scripted, seed 0) plus a
      random byte token stream DIR/tokens.bin: the modules troupe's trainers
      run. Prints {"cnn": path, "lm": path, "tokens": path}.

  torch_gpu.py run --case cnn_compute|cnn_loader|lm [...]
      trains the same model in PyTorch eager on cuda:0, as a user's script
      does: torch.autocast(bf16), SGD with momentum (cnn) or AdamW (lm).
      Every step's loss is kept and read back from the GPU every
      --loss-every steps (default 1, loss.item() each step), as troupe's
      trainer does: after every step in TrainerActor::benchmark, once per
      train() call (gpu_train.cc passes that cadence) in the loader-bound
      cases.
      cnn_compute: one batch already on the GPU, reused (no loading).
      cnn_loader:  uint8 3×H×W records cropped and flipped per sample by
                   DataLoader(num_workers=--workers, pin_memory=True), the
                   uint8 batch copied with non_blocking=True and normalised
                   on the GPU (x.float() / 255 - mean) / std, as troupe's
                   defer_normalize does; --normalize-in-loader normalises
                   to float32 in the workers instead (troupe's
                   --normalize-in-loader). One sampler over all the steps
                   (a fresh permutation of the records per pass), so the
                   iterator never restarts at an epoch's end.
      lm:          one batch of random token windows on the GPU.
      --cnn-width W trains ResNet18Step(width=W) (64: ResNet-18).
      Prints {"value": samples/s, "tokens_per_s": ..., "gpu_busy": ...}:
      gpu_busy is NVML's utilization.gpu averaged over the timed steps
      (pynvml, when present).

  torch_gpu.py calibrate --cnn-widths 64,48,... [run's options]
      how fast this PyTorch's DataLoader feeds the GPU (cnn_loader with the
      probe model, --steps steps) and how fast the GPU trains
      ResNet18Step at each width on one in-memory batch (cnn_compute,
      --width-steps steps after 3 warm-up steps each), so that the
      benchmark can pick a model the DataLoader cannot keep busy. Prints
      {"feed": images/s, "compute": {"64": images/s, ...}}.

  torch_gpu.py write_cnn DIR --cnn-width W
      writes DIR/cnn_wW_step.pt, ResNet18Step(width=W) scripted (seed 0).
      Prints {"cnn": path}.

On failure it prints {"error": ...} and exits non-zero."""
import argparse
import contextlib
import json
import os
import sys
import threading
import time
from typing import Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "train_lm"))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = nn.Sequential()
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.down(x))


class ResNet18Step(nn.Module):
    """ResNet-18 (torchvision's layout: 7×7 stem, 4 stages of 2 basic blocks)
    with its cross-entropy step: forward(batch) -> {"loss", "accuracy"}."""

    def __init__(self, num_classes: int = 1000, width: int = 64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks = []
        cin = width
        for i, cout in enumerate([width, 2 * width, 4 * width, 8 * width]):
            blocks.append(BasicBlock(cin, cout, 1 if i == 0 else 2))
            blocks.append(BasicBlock(cout, cout, 1))
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        logits = self.logits(batch["input"])
        loss = F.cross_entropy(logits.float(), batch["target"])
        accuracy = (logits.argmax(-1) == batch["target"]).float().mean()
        return {"loss": loss, "accuracy": accuracy.detach()}


class PoolStep(nn.Module):
    """The feeding probe: each image's channel means through one linear layer.
    Its step costs next to nothing, so a loader-fed run of it measures how
    fast batches reach the device, not the model."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.fc = nn.Linear(3, num_classes)

    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        loss = F.cross_entropy(self.fc(batch["input"].float().mean(dim=(2, 3))).float(), batch["target"])
        return {"loss": loss}


MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


class Records(torch.utils.data.Dataset):
    """uint8 [N, 3, H, W] records; a sample is a random crop and a flip with
    probability 1/2 (torchvision's RandomCrop + RandomHorizontalFlip on a
    uint8 tensor image), left uint8 for the GPU to normalise; with
    normalize, also (x / 255 - mean) / std in float32 here (+ ToTensor +
    Normalize)."""

    def __init__(self, size: int, height: int, crop: int, classes: int, normalize: bool):
        g = torch.Generator().manual_seed(0)
        self.records = torch.randint(0, 256, (size, 3, height, height), dtype=torch.uint8, generator=g)
        self.labels = torch.randint(0, classes, (size,), generator=g)
        self.crop = crop
        self.normalize = normalize
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self):
        return self.records.size(0)

    def __getitem__(self, i):
        r = self.records[i]
        h = r.size(1)
        top, left = torch.randint(0, h - self.crop + 1, (2,)).tolist()
        x = r[:, top:top + self.crop, left:left + self.crop]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        if self.normalize:
            x = (x.float().div_(255) - self.mean) / self.std
        else:
            x = x.contiguous()  # the crop alone, uint8
        return x, self.labels[i]


class GpuBusy:
    """NVML utilization.gpu sampled every 100 ms in a thread."""

    def __init__(self, on: bool):
        self.samples = []
        self.stop = threading.Event()
        self.nvml = None
        if not on:
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:
            self.nvml = None

    def __enter__(self):
        if self.nvml:
            self.thread = threading.Thread(target=self.run, daemon=True)
            self.thread.start()
        return self

    def run(self):
        while not self.stop.wait(0.1):
            self.samples.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)

    def __exit__(self, *exc):
        self.stop.set()
        if self.nvml:
            self.thread.join()

    def fraction(self):
        return sum(self.samples) / len(self.samples) / 100.0 if self.samples else None


def write(a):
    from lm_files import write_lm  # the language-model files train_throughput uses too
    os.makedirs(a.dir, exist_ok=True)
    torch.manual_seed(0)
    cnn = os.path.join(a.dir, "cnn_step.pt")
    torch.jit.save(torch.jit.script(ResNet18Step(a.classes, a.cnn_width)), cnn)
    probe = os.path.join(a.dir, "probe_step.pt")
    torch.jit.save(torch.jit.script(PoolStep(a.classes)), probe)
    lm = write_lm(a.dir, a.block, a.width, a.layers, a.heads, a.windows)
    print(json.dumps({"cnn": cnn, "probe": probe, "lm": lm["step"], "tokens": lm["tokens"]}), flush=True)


def write_cnn(a):
    os.makedirs(a.dir, exist_ok=True)
    torch.manual_seed(0)
    cnn = os.path.join(a.dir, f"cnn_w{a.cnn_width}_step.pt")
    torch.jit.save(torch.jit.script(ResNet18Step(a.classes, a.cnn_width)), cnn)
    print(json.dumps({"cnn": cnn}), flush=True)


def calibrate(a):
    widths = [int(w) for w in a.cnn_widths.split(",") if w]
    if not widths or min(widths) < 1:
        raise ValueError(f"--cnn-widths {a.cnn_widths!r}: give positive widths, comma-separated")
    feed = measure(argparse.Namespace(**{**vars(a), "case": "cnn_loader", "probe": True}))["value"]
    compute = {}
    for w in widths:
        c = argparse.Namespace(**{**vars(a), "case": "cnn_compute", "probe": False, "cnn_width": w,
                                  "steps": a.width_steps, "warmup": 3})
        compute[str(w)] = measure(c)["value"]
    print(json.dumps({"feed": feed, "compute": compute, "torch": torch.__version__}), flush=True)


def run(a):
    print(json.dumps(measure(a)), flush=True)


def measure(a):
    dev = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    pin = a.device == "cuda"
    torch.set_num_threads(4)
    torch.manual_seed(0)
    if a.case == "lm":
        from model import TinyGPT
        model = TinyGPT(block_size=a.block, width=a.width, layers=a.layers, heads=a.heads).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        w = torch.randint(0, 256, (a.batch, a.block + 1), generator=g)
        fixed = {"input": w[:, :-1].to(dev), "target": w[:, 1:].to(dev)}
        batches = None
    else:
        model = (PoolStep(a.classes) if a.probe else ResNet18Step(a.classes, a.cnn_width)).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if a.case == "cnn_compute":
            g = torch.Generator().manual_seed(1)
            fixed = {"input": torch.randn(a.batch, 3, a.crop, a.crop, generator=g).to(dev),
                     "target": torch.randint(0, a.classes, (a.batch,), generator=g).to(dev)}
            batches = None
        else:
            data = Records(a.records, a.height, a.crop, a.classes, a.normalize_in_loader)
            # Every step's samples from one sampler: a fresh permutation of
            # the records per pass, without the iterator (and its workers'
            # prefetch) restarting at each pass's end.
            sampler = torch.utils.data.RandomSampler(data, num_samples=(a.warmup + a.steps + 1) * a.batch)
            loader = torch.utils.data.DataLoader(data, batch_size=a.batch, sampler=sampler, num_workers=a.workers,
                                                 pin_memory=pin, drop_last=True, persistent_workers=True)
            batches = iter(loader)
            fixed = None
    model.train()
    mean = torch.tensor(MEAN, device=dev).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=dev).view(1, 3, 1, 1)

    def next_batch():
        if fixed is not None:
            return fixed
        x, y = next(batches)
        x = x.to(dev, non_blocking=True)
        if x.dtype == torch.uint8:
            x = x.float().div_(255).sub_(mean).div_(std)
        return {"input": x, "target": y.to(dev, non_blocking=True)}

    losses = []

    def read_losses():
        # One read-back of the steps' losses since the last (a sync).
        values = torch.stack(losses).tolist() if losses else []
        losses.clear()
        return values[-1] if values else None

    def step(i):
        b = next_batch()
        with torch.autocast("cuda", dtype=torch.bfloat16) if pin else contextlib.nullcontext():
            out = model(b)
        out["loss"].backward()
        opt.step()
        opt.zero_grad()
        losses.append(out["loss"].detach())
        return read_losses() if (i + 1) % a.loss_every == 0 else None

    for i in range(a.warmup):
        step(i)
    read_losses()
    sync = torch.cuda.synchronize if pin else (lambda: None)
    sync()
    loss = None
    with GpuBusy(pin) as busy:
        t0 = time.perf_counter()
        for i in range(a.steps):
            last = step(i)
            loss = last if last is not None else loss
        last = read_losses()
        loss = last if last is not None else loss
        sync()
        seconds = time.perf_counter() - t0
    samples = a.steps * a.batch
    row = {"value": samples / seconds, "samples": samples, "seconds": seconds, "final_loss": loss,
           "gpu_busy": busy.fraction(), "gpu": torch.cuda.get_device_name(0) if pin else "none",
           "torch": torch.__version__}
    if a.case == "lm":
        row["tokens_per_s"] = samples * a.block / seconds
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="job", required=True)
    for name in ("write", "write_cnn", "run", "calibrate"):
        s = sub.add_parser(name)
        if name.startswith("write"):
            s.add_argument("dir")
            s.add_argument("--windows", type=int, default=1024)
        else:
            if name == "run":
                s.add_argument("--case", choices=["cnn_compute", "cnn_loader", "lm"], required=True)
            else:
                s.add_argument("--cnn-widths", default="64,56,48,40,32,24,16,8",
                               help="the ResNet18Step widths to time, comma-separated")
                s.add_argument("--width-steps", type=int, default=20, help="timed steps per width")
            s.add_argument("--batch", type=int, default=128)
            s.add_argument("--steps", type=int, default=30)
            s.add_argument("--warmup", type=int, default=5)
            s.add_argument("--workers", type=int, default=8)
            s.add_argument("--records", type=int, default=2048)
            s.add_argument("--height", type=int, default=256)
            s.add_argument("--crop", type=int, default=224)
            s.add_argument("--probe", action="store_true", help="cnn_loader: train PoolStep, not ResNet-18")
            s.add_argument("--normalize-in-loader", action="store_true",
                           help="cnn_loader: normalise to float32 in the workers, not on the device")
            s.add_argument("--loss-every", type=int, default=1,
                           help="read the kept losses back from the device every N steps (1: every step)")
            s.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                           help="cpu: fp32 on the CPU, a dry run without a GPU")
        s.add_argument("--classes", type=int, default=1000)
        s.add_argument("--cnn-width", type=int, default=64)
        s.add_argument("--block", type=int, default=256)
        s.add_argument("--width", type=int, default=512)
        s.add_argument("--layers", type=int, default=8)
        s.add_argument("--heads", type=int, default=8)
    a = p.parse_args()
    if a.job in ("run", "calibrate") and a.loss_every < 1:
        p.error("--loss-every must be at least 1")
    {"write": write, "write_cnn": write_cnn, "run": run, "calibrate": calibrate}[a.job](a)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # the benchmark prints it as the case's error row
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        sys.exit(1)
