"""train_lm: a byte-level transformer language model trained by troupe.

The corpus is real text found on every Debian machine: the Python standard
library's own source files (the top-level modules of this interpreter's
stdlib, in name order, up to --corpus-bytes), one byte per token, split 95%
for training and 5% for validation, written as uint16 token streams. The
model (model.py, a small GPT) is scripted with torch.jit.script and trained
by the C++ TrainJob with data-parallel workers: AdamW, linear warmup then
cosine decay, gradient clipping, gradients travelling between workers as
bf16, heal from a live peer when a trainer dies. Validation loss and
perplexity are printed after every epoch; at the end a sample is generated
from the final checkpoint (model.pt, read with torch.load).

    PYTHONPATH=build-ci/python /usr/bin/python3 examples/train_lm/train_lm.py \\
        [--workers 2] [--epochs 2] [--corpus-bytes 1000000] [--kill-after-steps N] [--amp bf16]

--amp bf16 runs the forward pass under bf16 autocast (weights and optimizer
in fp32): about twice the tokens/s on a CPU with AVX512-BF16 or AMX.

--kill-after-steps N SIGKILLs one trainer once N steps are done: the job
heals and goes on (at most --max-failures times).
"""

import argparse
import glob
import json
import math
import os
import shutil
import signal
import socket
import sys
import sysconfig
import tempfile
import time

import numpy as np
import torch

import troupe
from troupe.exceptions import ConfigError, TroupeError
from troupe.train import TrainJob
from troupe.train.trainer import TrainingFailedError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import TinyGPT, generate  # noqa: E402


def stdlib_corpus(max_bytes):
    """The stdlib's top-level .py files, concatenated, up to max_bytes."""
    root = sysconfig.get_paths()["stdlib"]
    text, used = bytearray(), 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            text += f.read()
        used += 1
        if len(text) >= max_bytes:
            break
    if len(text) < 10000:
        raise SystemExit(f"train_lm: found only {len(text)} bytes of Python source under {root}")
    return bytes(text[:max_bytes]), root, used


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


def kill_one_trainer_after(job, before, steps):
    deadline = time.time() + 600
    while time.time() < deadline and job._proc.poll() is None and \
            (len(job.progress()) < steps or len(job_trainers(before)) < 2):
        time.sleep(0.05)
    pids = [pid for pid, here in job_trainers(before) if here]
    if not pids:
        print("no trainer of this job runs on this host (or the job had finished): nothing to kill", flush=True)
        return
    print(f"killing trainer pid {pids[-1]} after {len(job.progress())} steps", flush=True)
    try:
        os.kill(pids[-1], signal.SIGKILL)
    except ProcessLookupError:
        print("the job had finished already: nothing to kill", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--corpus-bytes", type=int, default=1_000_000)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per worker per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--max-failures", type=int, default=3)
    p.add_argument("--kill-after-steps", type=int, default=-1)
    p.add_argument("--amp", choices=["none", "bf16"], default="none", help="bf16 autocast for the forward pass")
    p.add_argument("--sample-bytes", type=int, default=300)
    p.add_argument("--out", default=None, help="corpus, checkpoints (default: a new temp dir)")
    p.add_argument("--address", default=None, help="HOST:PORT of a cluster, or local for an embedded one (default: $TROUPE_ADDRESS, else the cluster troupe start runs on this machine, else an embedded one)")
    a = p.parse_args()
    for name in ("workers", "epochs", "corpus_bytes", "block_size", "width", "layers", "heads", "batch_size"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if not (a.lr > 0 and math.isfinite(a.lr)):
        p.error(f"--lr must be a positive number, got {a.lr}")
    made = a.out is None
    out = a.out or tempfile.mkdtemp(prefix="train_lm-")
    try:
        os.makedirs(out, exist_ok=True)
        return train(a, out)
    except (TroupeError, TrainingFailedError, OSError) as e:
        # A one-line reason, not a traceback; a folder made for this run goes with it.
        print(f"train_lm: {e}", file=sys.stderr, flush=True)
        if made:
            shutil.rmtree(out, ignore_errors=True)
        return 2 if isinstance(e, ConfigError) else 1
    except KeyboardInterrupt:
        print("train_lm: interrupted", file=sys.stderr, flush=True)
        if made:
            shutil.rmtree(out, ignore_errors=True)
        return 130


def train(a, out):
    text, root, files = stdlib_corpus(a.corpus_bytes)
    tokens = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
    split = int(len(tokens) * 0.95)
    tokens[:split].tofile(os.path.join(out, "train.bin"))
    tokens[split:].tofile(os.path.join(out, "val.bin"))
    print(f"corpus: {len(text):,} bytes of {files} Python source files under {root} "
          f"({split:,} for training, {len(tokens) - split:,} for validation)", flush=True)

    torch.manual_seed(0)
    model = TinyGPT(block_size=a.block_size, width=a.width, layers=a.layers, heads=a.heads)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: byte-level GPT, {a.layers} layers, width {a.width}, {a.heads} heads, context {a.block_size}, "
          f"{params:,} parameters; {a.workers} workers, AdamW, warmup {a.warmup_steps} + cosine, clip 1.0, "
          f"bf16 gradients{', bf16 autocast' if a.amp == 'bf16' else ''}", flush=True)

    troupe.init(address=a.address)
    try:
        result = run_job(a, out, model)
    finally:
        troupe.shutdown()
    return report(a, model, result)


def run_job(a, out, model):
    before = trainer_ids() if a.kill_after_steps > 0 else set()
    job = TrainJob(model, os.path.join(out, "train.bin"), val_data=os.path.join(out, "val.bin"),
                   block_size=a.block_size, workers=a.workers, epochs=a.epochs, batch_size=a.batch_size,
                   optimizer="adamw", lr=a.lr, weight_decay=0.01, warmup_steps=a.warmup_steps,
                   schedule="cosine", min_lr_factor=0.1, grad_clip=1.0, compression="bf16",
                   max_failures=a.max_failures, amp=a.amp, log_every=20, checkpoint_dir=os.path.join(out, "checkpoints"),
                   name="train_lm").start()
    if a.kill_after_steps > 0:
        kill_one_trainer_after(job, before, a.kill_after_steps)
    return job.wait()


def report(a, model, result):
    for e in result.epochs:
        if e.get("val_loss") is not None:
            print(f"epoch {e['epoch'] + 1}/{len(result.epochs)}: train loss {e['train_loss']:.3f}, validation loss {e['val_loss']:.3f}, "
                  f"perplexity {math.exp(e['val_loss']):.2f}", flush=True)
    last = result.history[-1]
    print(f"done: {last['step']} steps, {result.recoveries} recovery(ies), checkpoint {result.checkpoint}",
          flush=True)

    model.load_state_dict(result.state_dict())
    prompt = b"def "
    sample = generate(model, prompt, a.sample_bytes)
    print("sample from the final checkpoint:\n" + "-" * 60)
    print(sample.decode("utf-8", errors="replace"))
    print("-" * 60, flush=True)
    first, final = result.epochs[0].get("val_loss"), result.epochs[-1].get("val_loss")
    return 0 if first is not None and final is not None and final <= first and final < math.log(256) else 1


if __name__ == "__main__":
    sys.exit(main())
