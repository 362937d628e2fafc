"""train_ddp.py's training, on troupe's own TrainJob, from Python.

The same model and data as train_ddp.py; the training loop, the sampler
(every sample exactly once per epoch, whatever fails), the checkpoints and
the recovery are the C++ TrainJob's: a trainer that dies is healed from its
live peer without going back to a checkpoint. The model is written as a step
module (forward(batch) returns the loss), scripted for the C++ side.

    PYTHONPATH=build-ci/python /usr/bin/python3 examples/torchrun/train_trainjob.py \\
        --epochs 3 --kill-after-steps 20

--kill-after-steps N SIGKILLs one trainer process once N steps are done, to
show the heal (the example finds it in the cluster's status).
"""

import argparse
import json
import os
import signal
import socket
import sys
import time
from typing import Dict

import torch
import torch.nn as nn

import troupe
from troupe.train import TrainJob


class Step(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        logits = self.net(batch["x"])
        accuracy = ((logits > 0).float() == batch["y"]).float().mean()
        return {"loss": self.loss_fn(logits, batch["y"]), "accuracy": accuracy.detach()}


def job_trainers(before):
    """(pid, killable here) of the trainers this job placed: TrainerActors
    alive now that were not there before it started (`before`: their ids
    then). os.kill reaches only those on a node of this machine whose pid
    is a troupe worker here (a container with the host's name has pids of
    its own)."""
    status = json.loads(troupe._client().status_json())
    here = {n["id"] for n in status["nodes"] if n.get("hostname") == socket.gethostname()}

    def troupe_worker(pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().startswith(b"troupe-worker")
        except OSError:
            return False

    return [(a["pid"], a["node"] in here and troupe_worker(a["pid"])) for a in status["actors"]
            if a["class"] == "troupe::trainer::TrainerActor" and a["state"] == "ALIVE" and a["id"] not in before]


def trainer_ids():
    status = json.loads(troupe._client().status_json())
    return {a["id"] for a in status["actors"] if a["class"] == "troupe::trainer::TrainerActor"}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-failures", type=int, default=3)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--kill-after-steps", type=int, default=-1)
    p.add_argument("--address", default=None, help="HOST:PORT of a cluster, or local for an embedded one (default: $TROUPE_ADDRESS, else the cluster troupe start runs on this machine, else an embedded one)")
    a = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(a.samples, 16)
    y = (x.sum(1, keepdim=True) > 0).float()
    troupe.init(address=a.address)
    before = trainer_ids() if a.kill_after_steps > 0 else set()
    job = TrainJob(Step(), {"x": x, "y": y}, workers=a.workers, epochs=a.epochs, batch_size=a.batch_size,
                   optimizer="sgd", lr=0.1, momentum=0.0,  # torch.optim.SGD(lr=0.1), as train_ddp.py
                   max_failures=a.max_failures, checkpoint_dir=a.checkpoint_dir).start()
    if a.kill_after_steps > 0:
        deadline = time.time() + 300
        while time.time() < deadline and job._proc.poll() is None and \
                (len(job.progress()) < a.kill_after_steps or len(job_trainers(before)) < 2):
            time.sleep(0.02)
        pids = [pid for pid, here in job_trainers(before) if here]
        if not pids:
            print("no trainer of this job runs on this host (or the job had finished): nothing to kill", flush=True)
        else:
            print(f"killing trainer pid {pids[-1]} after {len(job.progress())} steps", flush=True)
            try:
                os.kill(pids[-1], signal.SIGKILL)
            except ProcessLookupError:
                print("the job had finished already: nothing to kill", flush=True)
    result = job.wait()
    last = result.history[-1]
    print(f"done: {last['step']} steps, loss {last['loss']:.4f}, {result.recoveries} recovery(ies), "
          f"checkpoint {result.checkpoint}", flush=True)
    troupe.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
