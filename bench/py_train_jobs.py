"""bench/run py_train, the cases of training from Python (imported by
bench/py_train.py): trainjob_recovery_s and trainjob_lost_steps (the C++
TrainJob driven by troupe.train.TrainJob, a trainer SIGKILLed mid-run,
healed from its live peer) and trainer_recovery_s (troupe.train's
TorchTrainer, a worker SIGKILLed mid-run, the group restarted from the last
reported checkpoint).

Time = from the SIGKILL (wall clock, taken right before os.kill) to the first
completed step after it, seen by polling the job's step log every 2 ms (the
TrainJob's metrics file, flushed per line; the TorchTrainer loop's own log).
Lost steps = steps run again after the failure (step numbers seen twice).
"""
import json
import os
import signal
import sys
import tempfile
import time

STEP_SLEEP_S = 0.01  # TorchTrainer loop: a step's stand-in compute
POOL_SIZE = 2  # idle workers a node agent keeps per executable (the default)


def poll(pred, timeout, what, every=0.002):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise TimeoutError(f"no {what} within {timeout} s")


def _actor_pids(troupe, class_name):
    status = json.loads(troupe._client().status_json())
    return [a["pid"] for a in status["actors"] if a["class"] == class_name and a["state"] == "ALIVE"]


def _trainjob_model(torch):
    from typing import Dict, List

    class Step(torch.nn.Module):
        summed_metrics: List[str]

        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                           torch.nn.ReLU(), torch.nn.Linear(256, 1))
            self.summed_metrics = []

        def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
            err = self.net(batch["x"]).squeeze(1) - batch["y"]
            return {"loss": (err * err).mean()}

    torch.manual_seed(0)
    return Step()


def trainjob_once(troupe, TrainJob, torch, np, args):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.samples, 32)).astype(np.float32)
    data = {"x": x, "y": (x.sum(axis=1) / 8).astype(np.float32)}
    troupe.init(num_cpus=4)
    try:
        job = TrainJob(_trainjob_model(torch), data, workers=2, epochs=args.epochs, batch_size=32, lr=0.01,
                       max_failures=1, verbose=False).start()
        pids = poll(lambda: len(job.progress()) >= args.warm_steps and
                    len(_actor_pids(troupe, "troupe::trainer::TrainerActor")) == 2 and
                    _actor_pids(troupe, "troupe::trainer::TrainerActor"), args.timeout, "warm steps", every=0.05)
        last = job.progress()[-1]["step"]
        t0 = time.time()
        os.kill(pids[1], signal.SIGKILL)
        poll(lambda: any(s["step"] > last for s in job.progress()), args.timeout, "a step after the kill")
        recovery = time.time() - t0
        result = job.wait(timeout=args.timeout)
    finally:
        troupe.shutdown()
    steps = [h["step"] for h in result.history]
    lost = len(steps) - len(set(steps))
    if result.recoveries != 1:
        raise RuntimeError(f"expected one recovery, the job saw {result.recoveries}: {result.events}")
    return recovery, lost, [e["event"] for e in result.events if e["event"] not in ("checkpoint", "epoch")]


def trainjob_cases(args, log):
    sys.path.insert(0, os.path.join(args.build_dir, "python"))
    os.environ.setdefault("TROUPE_TRAIN", os.path.join(args.build_dir, "launcher", "troupe-train"))
    os.environ.setdefault("TROUPE_LOG_LEVEL", "error")
    import numpy as np
    import torch
    import troupe
    from troupe.train import TrainJob

    recoveries, lost = [], []
    for i in range(args.runs):
        r, n, events = trainjob_once(troupe, TrainJob, torch, np, args)
        log(f"trainjob run {i + 1}: recovery {r:.3f} s, {n} lost steps; events {events}")
        recoveries.append(r)
        lost.append(n)
    common = {"bench": "py_train", "workers": 2, "runs_n": args.runs,
              "how": "troupe.train.TrainJob (C++ TrainJob via troupe-train), heal from the live peer"}
    import statistics

    return [dict(common, case="trainjob_recovery_s", value=round(statistics.median(recoveries), 4), unit="s",
                 runs=[round(v, 4) for v in recoveries], target="<= 1"),
            dict(common, case="trainjob_lost_steps", value=max(lost), unit="steps", runs=lost, target="0")]


def _torch_trainer_loop(config):
    """A DDP loop that logs every step (time rank step restart) and its pid,
    reports a checkpoint every `report_every` steps from rank 0, and resumes
    from the last one."""
    import torch
    from troupe import train
    from troupe.train.torch import prepare_model

    ctx = train.get_context()
    rank = ctx.get_world_rank()
    with open(os.path.join(config["pids"], f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    model = prepare_model(torch.nn.Linear(32, 1))
    start = 0
    ck = train.get_checkpoint()
    if ck is not None:
        with ck.as_directory() as d:
            state = torch.load(os.path.join(d, "model.pt"))
            start = state.pop("__step")
            getattr(model, "module", model).load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for step in range(start + 1, config["steps"] + 1):
        x = torch.randn(32, 32, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
        time.sleep(STEP_SLEEP_S)
        with open(config["log"], "a") as f:
            f.write(f"{time.time()} {rank} {step} {ctx.get_restart_count()}\n")
        if step % config["report_every"] == 0:
            if rank == 0:
                with tempfile.TemporaryDirectory() as d:
                    state = dict(getattr(model, "module", model).state_dict(), __step=step)
                    torch.save(state, os.path.join(d, "model.pt"))
                    train.report({"step": step}, checkpoint=train.Checkpoint.from_directory(d))
            else:
                train.report({"step": step})


def _read_log(path):
    try:
        with open(path) as f:
            return [tuple(float(v) for v in line.split()) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def trainer_once(troupe, train, TorchTrainer, args):
    with tempfile.TemporaryDirectory(prefix="troupe-trainer-bench-") as d:
        pids = os.path.join(d, "pids")
        os.mkdir(pids)
        log_path = os.path.join(d, "steps")
        config = {"steps": args.trainer_steps, "report_every": 10, "log": log_path, "pids": pids}
        trainer = TorchTrainer(_torch_trainer_loop, train_loop_config=config,
                               scaling_config=train.ScalingConfig(num_workers=2),
                               run_config=train.RunConfig(name="bench", storage_path=os.path.join(d, "runs"),
                                                          failure_config=train.FailureConfig(max_failures=1)))
        import threading

        out = {}
        th = threading.Thread(target=lambda: out.setdefault("result", trainer.fit()), daemon=True)
        th.start()
        poll(lambda: len(_read_log(log_path)) >= 2 * args.warm_steps, args.timeout, "warm steps", every=0.05)
        # The workers came from the warm pool; the kill waits until the pool
        # has refilled (its new workers import torch first), as in a cluster
        # that has been up a while, so the replacement is a ready worker.
        poll(lambda: all(n.get("IdleWorkers", 0) >= POOL_SIZE for n in troupe.nodes() if n["Alive"]),
             60, "the warm pool refilled", every=0.05)
        with open(os.path.join(pids, "rank1.pid")) as f:
            victim = int(f.read())
        seen = len(_read_log(log_path))
        t0 = time.time()
        os.kill(victim, signal.SIGKILL)
        # The first step logged by a process started after the kill (rank 0's
        # old process may log a step or two before it is stopped).
        def restarted():
            new = [row for row in _read_log(log_path)[seen:] if row[3] >= 1]
            return new and min(row[0] for row in new)
        first = poll(restarted, args.timeout, "a step after the restart")
        th.join(args.timeout)
        if "result" not in out:
            raise RuntimeError("TorchTrainer.fit() did not return")
        return first - t0


def trainer_case(args, log):
    sys.path.insert(0, os.path.join(args.build_dir, "python"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(args.build_dir, "python"),
                                                              os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("TROUPE_LOG_LEVEL", "error")
    import cloudpickle
    import troupe
    from troupe import train
    from troupe.train.torch import TorchTrainer

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    values = []
    troupe.init(num_cpus=4)
    try:
        for i in range(args.runs):
            v = trainer_once(troupe, train, TorchTrainer, args)
            log(f"TorchTrainer run {i + 1}: {v:.3f} s")
            values.append(v)
    finally:
        troupe.shutdown()
    import statistics

    return [{"bench": "py_train", "case": "trainer_recovery_s", "value": round(statistics.median(values), 4),
             "unit": "s", "runs": [round(v, 4) for v in values], "workers": 2,
             "how": "troupe.train.TorchTrainer, gloo DDP, restart from the last reported checkpoint "
                    "(every 10 steps); the kill waits for the warm pool to refill"}]
