#!/usr/bin/python3
"""Peer for bench/allreduce.cc: torch.distributed allreduce with the gloo
backend, 2 processes on loopback, float32, the same sizes and iteration
schedule as troupe's run. Prints one JSON object per size (rank 0 only).

Run with Debian's interpreter, /usr/bin/python3 (python3-torch)."""
import argparse
import json
import os
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank, world, port, sizes, iters, warmups, trials):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for nbytes, n_iter, n_warm in zip(sizes, iters, warmups):
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        for _ in range(n_warm):
            dist.all_reduce(t)
        best = None
        for _ in range(trials):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(n_iter):
                dist.all_reduce(t)
            elapsed = (time.perf_counter() - start) / n_iter
            best = elapsed if best is None else min(best, elapsed)
        # The slower rank bounds the collective: report the max over ranks.
        worst = torch.tensor([best], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if rank == 0:
            busbw = 2.0 * (world - 1) / world * nbytes / worst.item() / 1e9
            print(json.dumps({"bench": "allreduce", "case": "torch_gloo", "bytes": nbytes,
                              "value": round(busbw, 4), "unit": "GB/s",
                              "seconds_per_op": worst.item()}), flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", required=True, help="comma-separated byte counts")
    p.add_argument("--iters", required=True, help="comma-separated iterations per size")
    p.add_argument("--warmups", required=True, help="comma-separated warm-up iterations per size")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    iters = [int(x) for x in a.iters.split(",")]
    warmups = [int(x) for x in a.warmups.split(",")]
    if a.rank >= 0:
        run_rank(a.rank, a.world, a.port, sizes, iters, warmups, a.trials)
        return
    port = free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = []
    for r in range(a.world):
        cmd = [sys.executable, os.path.abspath(__file__), "--sizes", a.sizes, "--iters", a.iters,
               "--warmups", a.warmups, "--trials", str(a.trials), "--world", str(a.world),
               "--rank", str(r), "--port", str(port)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=None if r == 0 else subprocess.DEVNULL))
    code = 0
    for proc in procs:
        try:
            code = code or proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
