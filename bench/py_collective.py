#!/usr/bin/python3
"""bench/run py_collective: allreduce between two processes, troupe's Python
collective groups (troupe.util.collective, Ray's ray.util.collective API)
against torch.distributed's gloo backend, on the same machine in one run.

Cases `allreduce_4KiB`, `allreduce_1MiB`, `allreduce_16MiB`: a float32
numpy array (troupe) and a float32 CPU tensor (torch) summed between two
processes (troupe: two actors of an embedded cluster; torch: two processes
of torch.multiprocessing, init_process_group("gloo") on loopback). Each
side runs 3 warm-up rounds, then --rounds timed rounds, each after a
barrier; a round's time is the slower rank's. Both sides check every
element of the result on both ranks. The sides run --trials times in
alternating order (troupe first, then torch first, ...), and the medians
are over all their rounds. `value` is troupe's median in ms, `torch` the
peer's, `ratio` = torch's median / troupe's (above 1: troupe faster), with
the GB/s of the data reduced. A side that fails or times out prints a row
with an `error` key for each case instead.

    bench/py_collective.py [--rounds 20] [--trials 2] [--only 4KiB,1MiB,16MiB]

One JSON object per line on stdout.
"""
import argparse
import json
import os
import statistics
import sys
import time

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
WARMUP = 3


def rounds_of(allreduce, barrier, rounds):
    """Times of `rounds` allreduces (after WARMUP), each after a barrier."""
    for _ in range(WARMUP):
        allreduce()
    times = []
    for _ in range(rounds):
        barrier()
        t0 = time.perf_counter()
        allreduce()
        times.append(time.perf_counter() - t0)
    return times


def check(data, expected, side):
    """Every element of an allreduced array is what the sums make."""
    import numpy as np

    values = np.asarray(data)
    wrong = np.flatnonzero(values != expected)
    if wrong.size:
        raise RuntimeError(f"{side}: {wrong.size} of {values.size} elements are not {expected} "
                           f"(first: [{wrong[0]}] = {values[wrong[0]]})")


def troupe_side(sizes, rounds):
    import numpy as np

    import troupe
    import troupe.util.collective as col

    troupe.init(num_cpus=2, log_to_driver=False)

    @troupe.remote(num_cpus=1)
    class Member:
        def __init__(self, rank):
            col.init_collective_group(2, rank, backend="gloo", group_name="bench")

        def run(self, nbytes, rounds):
            data = np.ones(nbytes // 4, dtype=np.float32)
            times = rounds_of(lambda: col.allreduce(data, "bench"), lambda: col.barrier("bench"), rounds)
            check(data, 2.0 ** (WARMUP + rounds), "troupe")
            return times

    try:
        members = [Member.remote(r) for r in range(2)]
        out = {}
        for name, nbytes in sizes.items():
            a, b = troupe.get([m.run.remote(nbytes, rounds) for m in members], timeout=600)
            out[name] = [max(x, y) for x, y in zip(a, b)]
        return out
    finally:
        troupe.shutdown()


def _torch_rank(rank, port, sizes, rounds, queue):
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        out = {}
        for name, nbytes in sizes.items():
            data = torch.ones(nbytes // 4, dtype=torch.float32)
            out[name] = rounds_of(lambda: dist.all_reduce(data), dist.barrier, rounds)
            check(data.numpy(), 2.0 ** (WARMUP + rounds), "torch")
        queue.put((rank, out))
        dist.destroy_process_group()
    except BaseException as e:  # said by the parent, as a row
        queue.put((rank, f"rank {rank}: {type(e).__name__}: {e}"))


def torch_side(sizes, rounds):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_torch_rank, args=(r, port, sizes, rounds, queue)) for r in range(2)]
    for p in procs:
        p.start()
    import queue as queues

    results = {}
    try:
        # A rank that failed says why; the other may then wait for it until
        # the deadline: what came is kept, so the failure's reason is too.
        for _ in procs:
            rank, got = queue.get(timeout=600)
            results[rank] = got
            if isinstance(got, str):
                raise RuntimeError(got)
    except queues.Empty:
        raise RuntimeError(f"a torch rank sent nothing within 600 s (received: {sorted(results)})")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        if isinstance(results[rank], str):
            raise RuntimeError(results[rank])
    return {name: [max(x, y) for x, y in zip(results[0][name], results[1][name])] for name in sizes}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--trials", type=int, default=2, help="runs of each side, in alternating order")
    p.add_argument("--only", default=",".join(SIZES))
    a = p.parse_args()
    if not 1 <= a.rounds <= 100:
        # Each round doubles the buffer: past 2^127 float32 is inf.
        p.error(f"--rounds must be between 1 and 100, got {a.rounds}")
    sizes = {n: SIZES[n] for n in a.only.split(",")}
    ours = {n: [] for n in sizes}
    theirs = {n: [] for n in sizes}
    errors = {}
    for trial in range(a.trials):
        sides = [("troupe", troupe_side, ours), ("torch", torch_side, theirs)]
        for side, run, into in (sides if trial % 2 == 0 else sides[::-1]):
            if side in errors:
                continue
            try:
                for name, times in run(sizes, a.rounds).items():
                    into[name] += times
            except Exception as e:
                errors[side] = f"{side}: {type(e).__name__}: {e}"
    if errors:
        for name in sizes:
            print(json.dumps({"bench": "py_collective", "case": f"allreduce_{name}",
                              "error": "; ".join(errors.values())}), flush=True)
        return 1
    for name, nbytes in sizes.items():
        mine, peer = statistics.median(ours[name]), statistics.median(theirs[name])
        print(json.dumps({"bench": "py_collective", "case": f"allreduce_{name}", "value": round(mine * 1e3, 4),
                          "unit": "ms", "torch": round(peer * 1e3, 4), "ratio": round(peer / mine, 3),
                          "gbps": round(nbytes / mine / 1e9, 3), "torch_gbps": round(nbytes / peer / 1e9, 3),
                          "rounds": a.rounds, "trials": a.trials}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
