#!/usr/bin/python3
"""Peer for bench/allreduce.cc: torch.distributed allreduce with the gloo
backend, ranks in separate processes on loopback, float32.

--serve (what the benchmark uses): starts the ranks once, then reads trial
commands "<bytes> <iters> <warmups>" from stdin, one per line, and answers
each with one JSON line on stdout: {"bytes": ..., "seconds_per_op": ...,
"checked": ...}, the max over ranks of the mean time per op. A trial is
`warmups` allreduces, a barrier, then `iters` timed allreduces, exactly as
on troupe's side: the buffer starts at 2^-k (k = half the trial's
operations) so that the in-place sums neither overflow nor go subnormal,
and "checked" says every element on every rank came out exactly the
expected power of two. EOF
on stdin ends the ranks: they leave with os._exit(0), skipping torch 1.13's
ProcessGroupGloo destructor (it can deadlock at exit), and a rank that has
not left within a few seconds is killed. The benchmark kills the process
group besides, so nothing here can keep it waiting.

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


def serve_rank(rank, world, port):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    buffers = {}
    for line in sys.stdin:
        nbytes, iters, warmups = (int(x) for x in line.split())
        t = buffers.get(nbytes)
        if t is None:
            t = buffers[nbytes] = torch.empty(nbytes // 4, dtype=torch.float32)
        ops = warmups + iters
        assert world == 2, "the start and end values assume each sum doubles"
        t.fill_(2.0 ** -((ops + 1) // 2))
        for _ in range(warmups):
            dist.all_reduce(t)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        elapsed = (time.perf_counter() - start) / iters
        good = bool(torch.all(t == 2.0 ** (ops - (ops + 1) // 2)))
        # The slower rank bounds the collective: report the max over ranks;
        # a wrong result on any rank fails the trial.
        worst = torch.tensor([elapsed, 0.0 if good else 1.0], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(json.dumps({"bytes": nbytes, "seconds_per_op": worst[0].item(), "checked": worst[1].item() == 0.0}),
                  flush=True)
    sys.stdout.flush()
    os._exit(0)  # no ProcessGroupGloo destructor: it can deadlock at exit


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--serve", action="store_true", help="take trial commands on stdin")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank >= 0:
        serve_rank(a.rank, a.world, a.port)
        return
    if not a.serve:
        p.error("only --serve is supported")
    port = free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = []
    for r in range(a.world):
        cmd = [sys.executable, os.path.abspath(__file__), "--world", str(a.world), "--rank", str(r),
               "--port", str(port)]
        procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, text=True,
                                      stdout=None if r == 0 else subprocess.DEVNULL))
    # Forward every command to every rank; rank 0 answers on our stdout.
    for line in sys.stdin:
        for proc in procs:
            proc.stdin.write(line)
            proc.stdin.flush()
    code = 0
    for proc in procs:
        proc.stdin.close()
    for proc in procs:
        try:
            code = code or proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = 1
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
