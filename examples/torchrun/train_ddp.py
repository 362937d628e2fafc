"""A torchrun-style DDP training script, unmodified for troupe.

Run it with either launcher:

    torchrun --nproc-per-node 2 --max-restarts 3 examples/torchrun/train_ddp.py
    troupe torchrun --nproc-per-node 2 --max-restarts 3 --python /usr/bin/python3 examples/torchrun/train_ddp.py

The shape of the seeds' DDP guides: process group from torchrun's
environment (gloo on CPU, nccl on GPU), a DistributedSampler with
set_epoch, rank 0 saving a checkpoint after every epoch (written to a
temporary name and renamed), and every rank resuming from it after a
restart. --kill-rank/--kill-step make that rank SIGKILL itself once, in
the first attempt, to show a restart; --step-log appends one line per
completed step (time, step, restart) for bench/run py_train.
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--checkpoint", default="checkpoint.pt")
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--step-log", default="")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--pid-dir", default="")
    return p.parse_args()


def save_checkpoint(path, model, optimizer, epoch, step):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "epoch": epoch, "step": step}, tmp)
    os.replace(tmp, path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")

    torch.manual_seed(0)
    x = torch.randn(args.samples, 16)
    y = (x.sum(1, keepdim=True) > 0).float()
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    ddp = DDP(model, device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loss_fn = nn.BCEWithLogitsLoss()

    start_epoch, step = 0, 0
    if os.path.exists(args.checkpoint):
        ck = torch.load(args.checkpoint, map_location=device)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch, step = ck["epoch"] + 1, ck["step"]
        print(f"rank {rank}: resumed from epoch {ck['epoch']} step {step} (restart {restart})", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad()
            loss = loss_fn(ddp(xb), yb)
            loss.backward()
            optimizer.step()
            step += 1
            if args.step_log:
                with open(args.step_log, "a") as f:
                    f.write(f"{time.time():.6f} {rank} {step} {restart}\n")
            if restart == 0 and rank == args.kill_rank and step == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.step_sleep:
                time.sleep(args.step_sleep)
        if rank == 0:
            save_checkpoint(args.checkpoint, model, optimizer, epoch, step)
        dist.barrier()
        print(f"rank {rank}: epoch {epoch} step {step} loss {loss.item():.4f} "
              f"world {world} restart {restart}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
