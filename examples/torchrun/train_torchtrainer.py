"""train_ddp.py's training, the Ray Train way: troupe.train.TorchTrainer.

The same model, data, DistributedSampler and per-epoch rank-0 checkpoint as
train_ddp.py, written as a Ray Train loop (`ray.train` -> `troupe.train`):
TorchTrainer starts the workers as troupe actors, sets up gloo/nccl, and
after a worker dies restarts them all from the last reported checkpoint.

    PYTHONPATH=build-ci/python /usr/bin/python3 examples/torchrun/train_torchtrainer.py \\
        --epochs 3 --kill-rank 1 --kill-step 20

--kill-rank/--kill-step make that rank SIGKILL itself once, in the first
attempt, to show the restart.
"""

import argparse
import os
import signal
import sys
import tempfile

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import troupe
from troupe import train
from troupe.train.torch import TorchTrainer, prepare_data_loader, prepare_model


def loop(config):
    ctx = train.get_context()
    torch.manual_seed(0)
    x = torch.randn(config["samples"], 16)
    y = (x.sum(1, keepdim=True) > 0).float()
    loader = prepare_data_loader(DataLoader(TensorDataset(x, y), batch_size=config["batch_size"], shuffle=True))
    model = prepare_model(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.BCEWithLogitsLoss()
    start_epoch, step = 0, 0
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            ck = torch.load(os.path.join(d, "checkpoint.pt"))
        getattr(model, "module", model).load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch, step = ck["epoch"] + 1, ck["step"]
        print(f"rank {ctx.get_world_rank()}: resumed from epoch {ck['epoch']} step {step} "
              f"(restart {ctx.get_restart_count()})", flush=True)
    for epoch in range(start_epoch, config["epochs"]):
        for xb, yb in loader:  # prepare_data_loader calls set_epoch for us
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
            step += 1
            if (ctx.get_restart_count() == 0 and ctx.get_world_rank() == config["kill_rank"]
                    and step == config["kill_step"]):
                os.kill(os.getpid(), signal.SIGKILL)
        metrics = {"epoch": epoch, "step": step, "loss": loss.item()}
        if ctx.get_world_rank() == 0:
            with tempfile.TemporaryDirectory() as d:
                torch.save({"model": getattr(model, "module", model).state_dict(),
                            "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step},
                           os.path.join(d, "checkpoint.pt"))
                train.report(metrics, checkpoint=train.Checkpoint.from_directory(d))
        else:
            train.report(metrics)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-failures", type=int, default=3)
    p.add_argument("--storage", default=None, help="where checkpoints go (default: a new temporary directory)")
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--address", default=None, help="HOST:PORT of a cluster, or local for an embedded one (default: $TROUPE_ADDRESS, else the cluster troupe start runs on this machine, else an embedded one)")
    a = p.parse_args()
    a.storage = a.storage or tempfile.mkdtemp(prefix="troupe-torchtrainer-")
    troupe.init(address=a.address)
    trainer = TorchTrainer(
        loop,
        train_loop_config={"epochs": a.epochs, "samples": a.samples, "batch_size": a.batch_size,
                           "kill_rank": a.kill_rank, "kill_step": a.kill_step},
        scaling_config=train.ScalingConfig(num_workers=a.workers),
        run_config=train.RunConfig(name="train_ddp", storage_path=a.storage,
                                   failure_config=train.FailureConfig(max_failures=a.max_failures)))
    result = trainer.fit()
    print(f"done: {result.metrics}, checkpoint {result.checkpoint}", flush=True)
    troupe.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
