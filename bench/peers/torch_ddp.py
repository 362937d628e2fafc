#!/usr/bin/python3
"""Peer for bench/train_throughput.cc: the same training job under PyTorch
DDP with the gloo backend, one torch thread per process, N processes on
loopback, per-worker batch B of in-memory data:
  --model mlp: MLP 784→H→H→10 (ReLU), cross-entropy, SGD with momentum 0.9;
  --model lm: examples/train_lm/model.py's TinyGPT (--block, --width,
    --layers, --heads) on random byte tokens, its own loss, AdamW; with
    --amp bf16 the forward runs under torch.autocast("cpu", bfloat16).
Prints one JSON object (samples/s over all ranks, timed by the slowest
rank; tokens/s too for lm), or one with an "error".

Bounded end to end: torch 1.13's ProcessGroupGloo destructor can deadlock at
interpreter exit, so ranks leave with os._exit(0) once they have reported,
and this process kills any rank still there and leaves the same way
(multiprocessing would otherwise join them at exit). The benchmark also
kills the whole process group once the result is in.

Run with Debian's interpreter, /usr/bin/python3 (python3-torch)."""
import argparse
import json
import os
import socket
import sys
import time


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compress(ddp, compression):
    """The gradient wire troupe's --compression picks: torch's own
    compression hooks (16-bit on the wire, averaged back in float32)."""
    if compression == "none":
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = default_hooks.bf16_compress_hook if compression == "bf16" else default_hooks.fp16_compress_hook
    ddp.register_comm_hook(None, hook)


def run_rank(rank, world, port, args, queue):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    if args.model == "lm":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                                        "train_lm"))
        from model import TinyGPT

        ddp = nn.parallel.DistributedDataParallel(
            TinyGPT(block_size=args.block, width=args.width, layers=args.layers, heads=args.heads),
            bucket_cap_mb=args.bucket_mb)
        compress(ddp, args.compression)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.0)
        torch.manual_seed(1000 + rank)
        tokens = torch.randint(0, 256, (args.batch, args.block + 1))
        batch = {"input": tokens[:, :-1].contiguous(), "target": tokens[:, 1:].contiguous()}

        def loss_of():
            if args.amp == "bf16":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return ddp(batch)["loss"]
            return ddp(batch)["loss"]
    else:
        model = nn.Sequential(nn.Linear(784, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                              nn.ReLU(), nn.Linear(args.hidden, 10))
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
        compress(ddp, args.compression)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        torch.manual_seed(1000 + rank)
        x = torch.randn(args.batch, 784)
        y = torch.randint(0, 10, (args.batch,))
        loss_fn = nn.CrossEntropyLoss()

        def loss_of():
            return loss_fn(ddp(x), y)

    def step():
        opt.zero_grad()
        loss = loss_of()
        loss.backward()
        opt.step()
        return loss

    for _ in range(args.warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    loss.item()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put(elapsed.item())
        # The queue's feeder thread must hand the value over before we leave.
        queue.close()
        queue.join_thread()
    sys.stdout.flush()
    os._exit(0)  # no ProcessGroupGloo destructor: it can deadlock at exit


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--model", choices=["mlp", "lm"], default="mlp")
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--amp", choices=["none", "bf16"], default="none")
    p.add_argument("--bucket-mb", type=float, default=25, help="DDP's bucket_cap_mb (troupe's --bucket-mb)")
    p.add_argument("--compression", choices=["none", "bf16", "fp16"], default="none",
                   help="a compression hook on the gradients (troupe's --compression)")
    args = p.parse_args()
    if args.model == "mlp":
        case = f"torch_ddp_{args.workers}"
    else:
        case = f"torch_ddp_lm_{'bf16_' if args.amp == 'bf16' else ''}{args.workers}"
    if args.compression == "bf16":
        # torch's bf16 hook needs CUDA and NCCL, and gloo has no bfloat16
        # allreduce: no like-for-like peer here, said as the row's error.
        print(json.dumps({"bench": "train_throughput", "case": case, "error":
                          "no peer for --compression bf16 on the CPU: torch's bf16_compress_hook needs CUDA and "
                          "NCCL, and gloo has no bfloat16 allreduce"}), flush=True)
        return 1
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=run_rank, args=(r, args.workers, port, args, queue)) for r in range(args.workers)]
    for pr in procs:
        pr.start()
    # Bounded wait that notices a rank dying (the others would wait for it
    # in init_process_group or a collective for a long time).
    import queue as queue_mod
    deadline = time.monotonic() + 600
    elapsed = None
    while elapsed is None:
        try:
            elapsed = queue.get(timeout=1)
        except queue_mod.Empty:
            dead = [pr for pr in procs if pr.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for pr in procs:
                    pr.kill()
                why = f"rank exit codes {[pr.exitcode for pr in procs]}" if dead else "timed out"
                print(json.dumps({"bench": "train_throughput", "case": case, "error": why}), flush=True)
                return 1
    for pr in procs:
        pr.join(timeout=10)
        if pr.is_alive():
            pr.kill()
    samples = args.steps * args.batch * args.workers
    row = {"bench": "train_throughput", "case": case, "value": samples / elapsed, "unit": "samples/s",
           "batch": args.batch, "workers": args.workers, "steps": args.steps, "bucket_mb": args.bucket_mb,
           "compression": args.compression}
    if args.model == "lm":
        row["tokens_per_s"] = samples * args.block / elapsed
    else:
        row["hidden"] = args.hidden
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # multiprocessing's exit handler would join ranks again
