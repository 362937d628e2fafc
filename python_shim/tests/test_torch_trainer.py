"""troupe.train.TorchTrainer (issue 16, part 2): Ray Train's API on troupe's
actors. The same tests run against Ray's actors (TROUPE_TEST_AGAINST=ray,
with an interpreter that imports ray: build/ray-venv) to show that the
trainer's own code is right whatever runtime places its workers; by default
they run against troupe.

Two CPU workers train a tiny model with gloo DDP. Loops that must die do so
with SIGKILL on themselves, so deaths are real process deaths. Every test is
bounded (alarm, then faulthandler ends the run if a native call hangs).
"""

import importlib
import json
import math
import os
import random
import signal
import sys
import tempfile
import time

import numpy as np
import pytest
import torch
from timebox import bounded_fixture
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SubsetRandomSampler

AGAINST = os.environ.get("TROUPE_TEST_AGAINST", "troupe")
SHIM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Against Ray, workers import troupe.train from the shim's folder (inherited
# environment). troupe's own build already holds it; putting the source
# folder first there would make every later subprocess of the pytest run
# (test_cli.py's) import a troupe without its native module.
if AGAINST != "troupe":
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [SHIM_DIR, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, SHIM_DIR)

rt = importlib.import_module(AGAINST)
from troupe import train  # noqa: E402
from troupe.train import trainer as trainer_module  # noqa: E402
from troupe.train.checkpoint import CheckpointStore  # noqa: E402
from troupe.train.torch import (TorchConfig, TorchTrainer, backward, enable_reproducibility, get_devices,  # noqa: E402
                                prepare_data_loader, prepare_model, prepare_optimizer)
from troupe.exceptions import ConfigError  # noqa: E402

TEST_TIMEOUT_S = 240


def _pickle_this_module_by_value():
    """The loops below are module functions; workers cannot import this test
    module, so they travel by value (for whichever cloudpickle the runtime
    uses)."""
    picklers = [importlib.import_module("cloudpickle")]
    if AGAINST == "ray":
        picklers.append(importlib.import_module("ray.cloudpickle"))
    for p in picklers:
        p.register_pickle_by_value(sys.modules[__name__])


_pickle_this_module_by_value()


@pytest.fixture(scope="module", autouse=True)
def cluster():
    trainer_module.use_runtime(AGAINST)
    rt.init(num_cpus=4)
    yield
    rt.shutdown()


bounded = bounded_fixture(TEST_TIMEOUT_S)


def run_config(tmp_path, **kwargs):
    return train.RunConfig(name="run", storage_path=str(tmp_path), **kwargs)


# ------------------------------------------------------------ the loops


def _dataset(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))


def _gather(value):
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def _report_epoch(epoch, model, metrics):
    """Every rank reports; rank 0 with a checkpoint of the model."""
    if train.get_context().get_world_rank() != 0:
        train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as d:
        torch.save(model.state_dict(), os.path.join(d, "model.pt"))
        with open(os.path.join(d, "state.json"), "w") as f:
            json.dump({"epoch": epoch}, f)
        train.report(metrics, checkpoint=train.Checkpoint.from_directory(d))


def ddp_loop(config):
    """A DDP step loop that resumes from its checkpoint; with config
    `die_at` = (rank, epoch, attempts) that rank SIGKILLs itself at that
    epoch's start while restart_count < attempts."""
    ctx = train.get_context()
    torch.manual_seed(0)  # the same start in every run, to compare runs' weights
    model = prepare_model(torch.nn.Linear(4, 1))
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            with open(os.path.join(d, "state.json")) as f:
                start = json.load(f)["epoch"] + 1
            getattr(model, "module", model).load_state_dict(torch.load(os.path.join(d, "model.pt")))
    loader = prepare_data_loader(torch.utils.data.DataLoader(_dataset(), batch_size=8, shuffle=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    die_rank, die_epoch, die_attempts = config.get("die_at", (-1, -1, 0))
    for epoch in range(start, config["epochs"]):
        if ctx.get_world_rank() == die_rank and epoch == die_epoch and ctx.get_restart_count() < die_attempts:
            os.kill(os.getpid(), signal.SIGKILL)
        total = 0.0
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            total += loss.item()
        weights = float(sum(p.detach().sum() for p in model.parameters()))
        same = len(set(_gather(round(weights, 6)))) == 1
        _report_epoch(epoch, getattr(model, "module", model), {"epoch": epoch, "loss": total, "replicas_equal": same,
                                             "resumed_from": start})
        # Rank 0 has persisted this epoch before anyone starts the next.
        torch.distributed.barrier()


def context_loop():
    ctx = train.get_context()
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                          "MASTER_PORT")}
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backward(model(torch.ones(1, 2)).sum())
    enable_reproducibility(seed=3)
    mine = {"world_rank": ctx.get_world_rank(), "world_size": ctx.get_world_size(),
            "local_rank": ctx.get_local_rank(), "local_world_size": ctx.get_local_world_size(),
            "node_rank": ctx.get_node_rank(), "env": env, "backend": torch.distributed.get_backend(),
            "checkpoint": train.get_checkpoint(), "pid": os.getpid(),
            "trial": [ctx.get_trial_name(), ctx.get_trial_id()], "devices": [str(d) for d in get_devices()],
            "same_optimizer": prepare_optimizer(opt) is opt, "has_grad": model.weight.grad is not None,
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "seeded": [torch.rand(1).item(), random.random(), float(np.random.rand())]}
    # Metrics named as troupe's columns of metrics_dataframe once were.
    train.report({"ranks": _gather(mine), "iteration": "mine", "time": "mine", "checkpoint": "mine",
                  "restart_count": "mine"})


def sharding_loop():
    loader = prepare_data_loader(torch.utils.data.DataLoader(list(range(40)), batch_size=5, shuffle=True))
    epochs = []
    for _ in range(2):
        epochs.append([int(i) for batch in loader for i in batch])
    # A loop that sets the epoch itself, peeks at a batch, then passes twice
    # (training, evaluation): each epoch's passes use that epoch.
    own = prepare_data_loader(DataLoader(list(range(40)), batch_size=5, shuffle=True))
    own_epochs = []
    for epoch in range(3):
        own.sampler.set_epoch(epoch)
        next(iter(own))
        own_epochs.append(own.sampler.epoch)
        for _ in range(2):
            for _batch in own:
                pass
            own_epochs.append(own.sampler.epoch)
    subset = prepare_data_loader(DataLoader(list(range(40)), batch_size=5, sampler=SubsetRandomSampler(range(40))))
    train.report({"ranks": _gather(epochs), "batches": len(loader), "own_epochs": own_epochs,
                  "subset": _gather([int(i) for batch in subset for i in batch]),
                  "are_loaders": isinstance(loader, DataLoader) and isinstance(subset, DataLoader)})


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(6))


class _BucketBatches:
    """A custom batch sampler (not a torch BatchSampler)."""

    def __iter__(self):
        return iter([[0, 1], [2, 3, 4]])

    def __len__(self):
        return 2


def batch_sampler_loop():
    """Loaders prepare_data_loader shards another way, or cannot shard."""
    import warnings

    from troupe.train import torch as train_torch

    ds = list(range(21))
    loader = prepare_data_loader(DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), 4, drop_last=False)))
    epochs = [[[int(i) for i in batch] for batch in loader] for _ in range(2)]
    # The sampler the loop sets the epoch of, as on a batch_size= loader.
    loader.batch_sampler.sampler.set_epoch(5)
    loop_epoch = [[int(i) for i in batch] for batch in loader]
    dropped = prepare_data_loader(DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), 4, drop_last=True)))
    train_torch._warned_iterable = False  # this worker process may have warned before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream = [int(i) for batch in prepare_data_loader(DataLoader(_Stream(), batch_size=2)) for i in batch]
        prepare_data_loader(DataLoader(_Stream(), batch_size=2))
    try:
        prepare_data_loader(DataLoader(ds, batch_sampler=_BucketBatches()))
        custom = None
    except ConfigError as e:
        custom = str(e)
    own = prepare_data_loader(DataLoader(ds, batch_sampler=_BucketBatches()), add_dist_sampler=False)
    train.report({"ranks": _gather(epochs), "loop_epoch": _gather(loop_epoch),
                  "batch_sizes": [len(b) for b in epochs[0]], "dropped": [len(b) for b in dropped],
                  "warnings": [str(w.message) for w in caught], "stream": stream, "custom": custom,
                  "own": [[int(i) for i in b] for b in own]})


def raising_loop(config):
    if train.get_context().get_world_rank() == config["rank"]:
        raise ValueError("bad batch 7")
    torch.distributed.barrier()  # the other rank waits on the one that raised


def sharded_checkpoint_loop():
    """Each rank reports its own shard; both write common.txt."""
    rank = train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, f"shard-{rank}.txt"), "w") as f:
            f.write(f"rank {rank}")
        with open(os.path.join(d, "common.txt"), "w") as f:
            f.write(str(rank))
        train.report({"rank": rank}, checkpoint=train.Checkpoint.from_directory(d))


def unshared_storage_loop():
    """As on nodes that do not share the run folder: rank 1's staged
    files never reach rank 0."""
    from troupe.train import session

    if train.get_context().get_world_rank() == 1:
        session._session.store.stage_part = lambda *args: None
    sharded_checkpoint_loop()


def uneven_reports_loop():
    if train.get_context().get_world_rank() == 0:
        train.report({"extra": True})
    train.report({"last": True})


def late_rank_loop(config):
    """Rank 1 reports a few seconds after rank 0 has begun to wait. Each
    rank's stderr goes to a file of the test's while it reports (where a
    worker's own stderr goes depends on when the pool started it)."""
    rank = train.get_context().get_world_rank()
    marker = os.path.join(config["dir"], "rank0-reporting")
    if rank == 0:
        open(marker, "w").close()
    else:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(3)  # the lateness under test, not a synchronisation
    saved = sys.stderr
    with open(os.path.join(config["dir"], f"stderr-{rank}"), "w") as err:
        sys.stderr = err
        try:
            train.report({"late": True})
        finally:
            sys.stderr = saved


def flaky_loop():
    ctx = train.get_context()
    if ctx.get_restart_count() == 0 and ctx.get_world_rank() == 1:
        raise RuntimeError("worker 1 failing once")
    torch.distributed.barrier()
    train.report({"restart_count": ctx.get_restart_count()})


def scored_loop(config):
    """Reports config["losses"] one per epoch (rank 0 with a checkpoint),
    with the variable the workers' runtime_env sets."""
    for epoch, loss in enumerate(config["losses"]):
        _report_epoch(epoch, torch.nn.Linear(1, 1), {"loss": loss, "nested": {"loss": loss},
                                                     "var": os.environ.get("RUN_CONFIG_WORKER_VAR")})
        torch.distributed.barrier()


def torchrun_style_loop():
    """Ends as the scripts of the multi-GPU guides do: the loop destroys the
    process group itself."""
    torch.distributed.barrier()
    train.report({"rank": train.get_context().get_world_rank()})
    torch.distributed.destroy_process_group()


def init_again_loop():
    torch.distributed.init_process_group("gloo")


# ---------------------------------------------------------------- tests


def test_fit_trains_ddp_and_keeps_k_checkpoints(tmp_path):
    trainer = TorchTrainer(ddp_loop, train_loop_config={"epochs": 3},
                           scaling_config=train.ScalingConfig(num_workers=2),
                           run_config=run_config(tmp_path, checkpoint_config=train.CheckpointConfig(num_to_keep=2)))
    result = trainer.fit()
    assert result.error is None
    assert result.metrics["epoch"] == 2 and result.metrics["replicas_equal"]
    rows = _rows(result)
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    assert [(r["training_iteration"], r["checkpoint_dir_name"]) for r in rows] == [
        (i + 1, f"checkpoint_00000{i}") for i in range(3)]
    assert result.path == str(tmp_path / "run")
    assert sorted(os.listdir(result.path)) == ["checkpoint_000001", "checkpoint_000002", "progress.jsonl",
                                               "trainer.pkl"]
    assert result.checkpoint.path == os.path.join(result.path, "checkpoint_000002")
    state = torch.load(os.path.join(result.checkpoint.path, "model.pt"))
    assert set(state) == {"weight", "bias"}
    assert [c.path for c, _ in result.best_checkpoints] == [
        os.path.join(result.path, f"checkpoint_00000{i}") for i in (1, 2)]
    # The run goes on from its folder alone: the loop and the configs come
    # from what fit() left there; a config given to restore replaces its own.
    assert TorchTrainer.can_restore(result.path) and not TorchTrainer.can_restore(str(tmp_path))
    more = TorchTrainer.restore(result.path, train_loop_config={"epochs": 4}).fit()
    assert more.path == result.path and more.metrics["epoch"] == 3 and more.metrics["resumed_from"] == 3
    assert more.checkpoint.path.endswith("checkpoint_000003")
    with pytest.raises(ConfigError, match="not the folder of a TorchTrainer run"):
        TorchTrainer.restore(str(tmp_path))


def _rows(result):
    rows = result.metrics_dataframe
    return rows.to_dict("records") if hasattr(rows, "to_dict") else rows


def test_context_environment_and_process_group(tmp_path):
    result = TorchTrainer(context_loop, scaling_config=train.ScalingConfig(num_workers=2),
                          run_config=run_config(tmp_path), torch_config=TorchConfig(backend="gloo", timeout_s=60)).fit()
    ranks = result.metrics["ranks"]
    assert ranks[0]["trial"] == ranks[1]["trial"] and ranks[0]["trial"][0] == "run" and ranks[0]["trial"][1]
    assert all(r["devices"] == ["cpu"] and r["same_optimizer"] and r["has_grad"] and r["deterministic"]
               for r in ranks)
    assert ranks[0]["seeded"] == ranks[1]["seeded"]  # enable_reproducibility seeded both ranks alike
    # troupe's columns never overwrite the loop's metrics of the same name.
    [row] = _rows(result)
    assert [row[k] for k in ("iteration", "time", "checkpoint", "restart_count")] == ["mine"] * 4
    assert row["training_iteration"] == 1 and row["checkpoint_dir_name"] is None
    assert row["troupe_restart_count"] == 0 and isinstance(row["timestamp"], float)
    assert [r["world_rank"] for r in ranks] == [0, 1]
    assert {r["world_size"] for r in ranks} == {2}
    assert sorted(r["local_rank"] for r in ranks) == [0, 1]
    assert {r["local_world_size"] for r in ranks} == {2} and {r["node_rank"] for r in ranks} == {0}
    assert {r["backend"] for r in ranks} == {"gloo"}
    assert all(r["checkpoint"] is None for r in ranks)
    assert len({r["pid"] for r in ranks} | {os.getpid()}) == 3
    for r in ranks:
        assert r["env"]["RANK"] == str(r["world_rank"]) and r["env"]["WORLD_SIZE"] == "2"
        assert r["env"]["LOCAL_RANK"] == str(r["local_rank"]) and r["env"]["MASTER_PORT"].isdigit()
        assert r["env"]["MASTER_ADDR"] == ranks[0]["env"]["MASTER_ADDR"]


def test_elastic_group_takes_what_the_cluster_holds(tmp_path):
    # 4 CPUs hold two workers of 2 CPUs: between min 1 and max 4, two start.
    scaling = train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 2}, min_workers=1, max_workers=4)
    result = TorchTrainer(context_loop, scaling_config=scaling, run_config=run_config(tmp_path)).fit()
    assert [r["world_size"] for r in result.metrics["ranks"]] == [2, 2]
    with pytest.raises(train.TrainingFailedError, match="min_workers=3"):
        scaling = train.ScalingConfig(num_workers=3, resources_per_worker={"CPU": 2}, min_workers=3, max_workers=4)
        TorchTrainer(context_loop, scaling_config=scaling, run_config=run_config(tmp_path)).fit()


def dies_once_loop():
    """Rank 1 SIGKILLs itself in the first attempt; every rank reports the
    world size it trained with."""
    ctx = train.get_context()
    if ctx.get_restart_count() == 0 and ctx.get_world_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    train.report({"world_size": ctx.get_world_size(), "restart": ctx.get_restart_count()})


def test_an_elastic_group_restarts_as_large_as_before(tmp_path):
    # The restart was sized at once from what was free, while the head
    # still held the killed workers' resources until their nodes reported
    # the exits: every restart shrank.
    if AGAINST != "troupe":
        pytest.skip("Ray's ray.nodes() says nothing of what is free on each node")
    scaling = train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}, min_workers=1, max_workers=4)
    result = TorchTrainer(dies_once_loop, scaling_config=scaling,
                          run_config=run_config(tmp_path, failure_config=train.FailureConfig(max_failures=1))).fit()
    assert result.metrics["restart"] == 1 and result.metrics["world_size"] == 4, result.metrics


class Hog:
    """Holds CPUs of the cluster while it lives."""

    def ping(self):
        return True


def test_an_elastic_group_takes_what_is_free_now(tmp_path):
    # One of the 4 CPUs is held by another actor: between 1 and 4 workers of
    # 1 CPU, three start. Sized by the cluster's totals it asked for 4,
    # waited out the placement timeout and failed every attempt.
    if AGAINST != "troupe":
        pytest.skip("Ray's ray.nodes() says nothing of what is free on each node")
    hog = rt.remote(num_cpus=1)(Hog).remote()
    try:
        assert rt.get(hog.ping.remote(), timeout=60)
        scaling = train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}, min_workers=1, max_workers=4)
        result = TorchTrainer(context_loop, scaling_config=scaling, run_config=run_config(tmp_path)).fit()
        assert [r["world_size"] for r in result.metrics["ranks"]] == [3, 3, 3]
    finally:
        rt.kill(hog)


def test_a_group_the_cluster_can_never_hold_fails_at_once(tmp_path, monkeypatch):
    # More workers, or bigger ones, than the cluster's 4 CPUs (and no 64
    # GPUs) can ever hold: fit fails before it places anything, naming what
    # was asked and what the cluster has. It used to wait for placement
    # (PLACEMENT_TIMEOUT_S, 300 s; shortened here so that the old behaviour
    # fails quickly too, with a timeout instead of the reason).
    monkeypatch.setattr(trainer_module, "PLACEMENT_TIMEOUT_S", 30)
    cases = [
        (train.ScalingConfig(num_workers=5),
         r"5 workers \(num_workers=5\) of \{CPU: 1\}.*at most 4 such workers.*cluster total \{CPU: 4\}"
         r".*give fewer workers.*troupe\.init\(num_cpus=\.\.\.\)"),
        (train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 8}),
         r"1 worker \(num_workers=1\) of \{CPU: 8\}.*no node has .* one worker.*cluster total \{CPU: 4\}"),
        (train.ScalingConfig(num_workers=1, use_gpu=True, resources_per_worker={"CPU": 1, "GPU": 64}),
         r"of \{CPU: 1, GPU: 64\}.*no node has .* one worker.*cluster total \{CPU: 4, GPU: \d+\}"),
        (train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}, min_workers=5, max_workers=8),
         r"at least 5 workers \(min_workers=5\).*at most 4 such workers"),
    ]
    for scaling, reason in cases:
        begin = time.monotonic()
        with pytest.raises(train.TrainingFailedError, match=reason) as info:
            TorchTrainer(context_loop, scaling_config=scaling, run_config=run_config(tmp_path)).fit()
        assert isinstance(info.value.__cause__, ConfigError), info.value
        assert time.monotonic() - begin < 20, scaling


def test_parts_of_gpus_are_counted_per_gpu_as_the_head_places_them():
    # A worker's part of a GPU comes out of one GPU. Counting 0.4 GPU on a
    # node of 2 GPUs as 5 workers (2 / 0.4) made an elastic group ask for 5
    # and wait out PLACEMENT_TIMEOUT_S for a fifth that never fits.
    def fits(res, *totals):
        return trainer_module._workers_that_fit(res, [{"Resources": t} for t in totals])

    assert fits({"GPU": 0.4}, {"GPU": 2}) == 4
    assert fits({"GPU": 0.4, "CPU": 1}, {"GPU": 2, "CPU": 3}) == 3
    assert fits({"GPU": 0.3}, {"GPU": 1}, {"GPU": 3}) == 3 + 9
    assert fits({"GPU": 0.1}, {"GPU": 1}) == 10
    assert fits({"GPU": 0.25}, {"GPU": 2}) == 8
    assert fits({"GPU": 0.5}, {"GPU": 0}) == 0
    assert fits({"GPU": 2}, {"GPU": 3}) == 1
    assert fits({"CPU": 0.3}, {"CPU": 1}) == 3
    assert fits({"CPU": 0}, {"CPU": 1}) is None


def test_a_group_that_fits_but_finds_the_cluster_busy_waits(tmp_path, monkeypatch):
    # Two workers fit the cluster's 4 CPUs, but 3 are taken: placing waits
    # (for PLACEMENT_TIMEOUT_S, short here) instead of failing as never fitting.
    monkeypatch.setattr(trainer_module, "PLACEMENT_TIMEOUT_S", 3)
    hog = rt.remote(num_cpus=3)(Hog).remote()
    try:
        assert rt.get(hog.ping.remote(), timeout=60)
        with pytest.raises(train.TrainingFailedError, match="could not place 2 workers") as info:
            TorchTrainer(context_loop, scaling_config=train.ScalingConfig(num_workers=2),
                         run_config=run_config(tmp_path)).fit()
        assert not isinstance(info.value.__cause__, ConfigError)
    finally:
        rt.kill(hog)
    deadline = time.monotonic() + 60
    while rt.available_resources().get("CPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rt.available_resources().get("CPU", 0) == 4


def test_a_restart_waits_for_a_lost_node_rather_than_failing_the_run(tmp_path, monkeypatch):
    # After a node is lost, the cluster alive may hold fewer workers than
    # the group: a first attempt is refused at once (nothing to wait for),
    # but a restart waits for the node to come back, and a placement that
    # times out then is one more failure, not the run's end (it failed at
    # once, whatever max_failures said).
    class Shrunk:
        @staticmethod
        def nodes():
            return [{"Alive": True, "Resources": {"CPU": 1.0}}, {"Alive": False, "Resources": {"CPU": 4.0}}]

    trainer = TorchTrainer(context_loop, scaling_config=train.ScalingConfig(num_workers=2),
                           run_config=run_config(tmp_path))
    trainer.failures = 0
    with pytest.raises(ConfigError):
        trainer._group_size(Shrunk())
    trainer.failures = 1
    assert trainer._group_size(Shrunk()) == 2
    monkeypatch.setattr(trainer_module, "PLACEMENT_TIMEOUT_S", 2)
    hog = rt.remote(num_cpus=3)(Hog).remote()
    try:
        assert rt.get(hog.ping.remote(), timeout=60)
        workers, groups = [], []
        with pytest.raises(trainer_module._WorkersDied) as info:
            trainer._place(rt, workers, groups)
        assert "could not place 2 workers" in str(info.value.__cause__)
        for w in workers:
            rt.kill(w)
        # The same with a placement group (SPREAD), and a strict strategy
        # the nodes alive cannot meet waits rather than being refused.
        spread = TorchTrainer(context_loop, scaling_config=train.ScalingConfig(
            num_workers=2, placement_strategy="SPREAD"), run_config=run_config(tmp_path))
        spread.failures = 1
        workers, groups = [], []
        with pytest.raises(trainer_module._WorkersDied) as info:
            spread._place(rt, workers, groups)
        assert "could not reserve 2 bundles" in str(info.value.__cause__)
        for pg in groups:
            rt.util.remove_placement_group(pg)
    finally:
        rt.kill(hog)


def test_prepare_data_loader_shards_and_advances_epochs(tmp_path):
    result = TorchTrainer(sharding_loop, scaling_config=train.ScalingConfig(num_workers=2),
                          run_config=run_config(tmp_path)).fit()
    ranks = result.metrics["ranks"]
    assert result.metrics["batches"] == 4
    for epoch in range(2):
        a, b = ranks[0][epoch], ranks[1][epoch]
        assert len(a) == len(b) == 20 and not set(a) & set(b) and set(a) | set(b) == set(range(40))
    # A new pass is a new epoch: a different shuffle.
    assert ranks[0][0] != ranks[0][1]
    # Once the loop sets epochs, they are its own.
    assert result.metrics["own_epochs"] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # A random subset sampler is sharded shuffled, as Ray shards it.
    a, b = result.metrics["subset"]
    assert len(a) == len(b) == 20 and set(a) | set(b) == set(range(40)) and a != sorted(a)
    assert result.metrics["are_loaders"]


def test_prepare_data_loader_shards_a_batch_sampler_and_says_what_it_cannot(tmp_path):
    # A loader built with batch_sampler= once went unsharded: every rank
    # trained all 21 samples each epoch.
    result = TorchTrainer(batch_sampler_loop, scaling_config=train.ScalingConfig(num_workers=2),
                          run_config=run_config(tmp_path)).fit()
    m = result.metrics
    for epoch in range(2):
        a, b = ([i for batch in m["ranks"][r][epoch] for i in batch] for r in (0, 1))
        # As DistributedSampler: ceil(21 / 2) = 11 each, one padding repeat.
        assert len(a) == len(b) == 11 and set(a) | set(b) == set(range(21)) and len(set(a) & set(b)) == 1
    assert m["ranks"][0][0] != m["ranks"][0][1]  # the next pass is the next epoch
    assert m["batch_sizes"] == [4, 4, 3] and m["dropped"] == [4, 4]
    assert m["loop_epoch"][0] not in (m["ranks"][0][0], m["ranks"][0][1])
    # An IterableDataset cannot be sharded from outside: said once, not silently.
    assert m["stream"] == list(range(6))
    assert len(m["warnings"]) == 1 and "IterableDataset" in m["warnings"][0], m["warnings"]
    assert "whole stream" in m["warnings"][0]
    # A batch sampler of the loop's own cannot be: a ConfigError that says
    # what to do, and add_dist_sampler=False leaves it to the loop.
    assert m["custom"] and "_BucketBatches" in m["custom"] and "add_dist_sampler=False" in m["custom"], m["custom"]
    assert m["own"] == [[0, 1], [2, 3, 4]]


def test_worker_killed_restarts_from_last_checkpoint(tmp_path):
    trainer = TorchTrainer(ddp_loop, train_loop_config={"epochs": 4, "die_at": (1, 2, 1)},
                           scaling_config=train.ScalingConfig(num_workers=2),
                           run_config=run_config(tmp_path, failure_config=train.FailureConfig(max_failures=1)))
    result = trainer.fit()
    assert trainer.failures == 1
    assert result.metrics["epoch"] == 3 and result.metrics["resumed_from"] == 2
    progress = CheckpointStore(result.path, train.CheckpointConfig()).progress()
    assert [(p["metrics"]["epoch"], p["restart_count"]) for p in progress] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    # The restarted attempt counts on from the checkpoint's report, not from 1.
    assert [p["iteration"] for p in progress] == [1, 2, 3, 4]
    assert result.checkpoint.path.endswith("checkpoint_000003")


def _final_weights(result):
    return torch.load(os.path.join(result.checkpoint.path, "model.pt"))


def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tmp_path):
    # The loop leaves the sampler's epoch to prepare_data_loader; a resumed
    # attempt must shuffle epoch 2 as epoch 2, not as the first pass.
    whole = TorchTrainer(ddp_loop, train_loop_config={"epochs": 4}, scaling_config=train.ScalingConfig(num_workers=2),
                         run_config=train.RunConfig(name="whole", storage_path=str(tmp_path))).fit()
    broken = TorchTrainer(ddp_loop, train_loop_config={"epochs": 4, "die_at": (1, 2, 1)},
                          scaling_config=train.ScalingConfig(num_workers=2),
                          run_config=train.RunConfig(name="broken", storage_path=str(tmp_path),
                                                     failure_config=train.FailureConfig(max_failures=1))).fit()
    assert broken.metrics["resumed_from"] == 2
    progress = CheckpointStore(broken.path, train.CheckpointConfig()).progress()
    # Each rank's loaders' epochs, recorded with each checkpoint.
    assert [p["loader_epochs"] for p in progress] == [[[e], [e]] for e in (1, 2, 3, 4)]
    a, b = _final_weights(whole), _final_weights(broken)
    assert all(torch.equal(a[k], b[k]) for k in a), (a, b)


def test_a_new_run_resumed_from_another_runs_checkpoint_shuffles_as_the_uninterrupted_one(tmp_path):
    # Ray's resume_from_checkpoint=result.checkpoint pattern, into a run of
    # another name: the loaders started again at epoch 0's order (their
    # epochs were looked up in the new run's own progress only).
    whole = TorchTrainer(ddp_loop, train_loop_config={"epochs": 4}, scaling_config=train.ScalingConfig(num_workers=2),
                         run_config=train.RunConfig(name="whole", storage_path=str(tmp_path))).fit()
    after_two = train.Checkpoint(os.path.join(whole.path, "checkpoint_000001"))
    again = TorchTrainer(ddp_loop, train_loop_config={"epochs": 4}, scaling_config=train.ScalingConfig(num_workers=2),
                         run_config=train.RunConfig(name="again", storage_path=str(tmp_path)),
                         resume_from_checkpoint=after_two).fit()
    assert again.metrics["resumed_from"] == 2
    progress = CheckpointStore(again.path, train.CheckpointConfig()).progress()
    assert [p["iteration"] for p in progress] == [1, 2]  # the new run counts its own reports
    assert [p["loader_epochs"] for p in progress] == [[[3], [3]], [[4], [4]]]
    a, b = _final_weights(whole), _final_weights(again)
    assert all(torch.equal(a[k], b[k]) for k in a), (a, b)


def test_every_ranks_checkpoint_files_make_the_checkpoint(tmp_path):
    result = TorchTrainer(sharded_checkpoint_loop, scaling_config=train.ScalingConfig(num_workers=2),
                          run_config=run_config(tmp_path)).fit()
    files = sorted(os.listdir(result.checkpoint.path))
    assert files == ["common.txt", "shard-0.txt", "shard-1.txt"], files
    with open(os.path.join(result.checkpoint.path, "common.txt")) as f:
        assert f.read() == "0"  # rank 0's wins
    # Nothing staged is left behind.
    assert sorted(os.listdir(result.path)) == ["checkpoint_000000", "progress.jsonl", "trainer.pkl"]


def test_storage_the_nodes_do_not_share_fails_the_run_at_once(tmp_path):
    # Not retried, even without a failure limit: every attempt would meet it.
    trainer = TorchTrainer(unshared_storage_loop, scaling_config=train.ScalingConfig(num_workers=2),
                           run_config=run_config(tmp_path, failure_config=train.FailureConfig(max_failures=-1)))
    with pytest.raises(train.TrainingFailedError, match="a folder every node shares"):
        trainer.fit()
    assert trainer.failures == 0


def test_a_rank_that_reports_more_often_is_told_why_it_failed(tmp_path):
    # Rank 1 ends its loop while rank 0 waits in its extra report.
    trainer = TorchTrainer(uneven_reports_loop, scaling_config=train.ScalingConfig(num_workers=2),
                           run_config=run_config(tmp_path))
    with pytest.raises(train.TrainingFailedError, match="called report.. fewer times than this one"):
        trainer.fit()


def test_a_rank_that_waits_long_in_report_says_so(tmp_path, monkeypatch):
    # A report made only on rank 0 used to wait silently. The bound is the
    # driver's TROUPE_REPORT_WAIT_WARNING_S, which never reached the workers
    # (they do not inherit troupe's own variables).
    monkeypatch.setenv("TROUPE_REPORT_WAIT_WARNING_S", "0.5")
    trainer = TorchTrainer(late_rank_loop, train_loop_config={"dir": str(tmp_path)},
                           scaling_config=train.ScalingConfig(num_workers=2), run_config=run_config(tmp_path))
    assert trainer.fit().metrics["late"] is True
    waited = (tmp_path / "stderr-0").read_text()
    assert "rank 0 has waited 0.5 s for the other ranks' report #1" in waited, waited
    late = (tmp_path / "stderr-1").read_text()
    assert "has waited" not in late, late  # it came late, it did not wait
    monkeypatch.setenv("TROUPE_REPORT_WAIT_WARNING_S", "soon")
    with pytest.raises(ConfigError, match="TROUPE_REPORT_WAIT_WARNING_S must be a positive number of seconds, "
                                          "got 'soon'"):
        TorchTrainer(late_rank_loop, train_loop_config={"dir": str(tmp_path)},
                     scaling_config=train.ScalingConfig(num_workers=2), run_config=run_config(tmp_path)).fit()


def test_max_failures_exhausted_raises_with_the_cause(tmp_path):
    trainer = TorchTrainer(ddp_loop, train_loop_config={"epochs": 3, "die_at": (1, 0, 99)},
                           scaling_config=train.ScalingConfig(num_workers=2),
                           run_config=run_config(tmp_path, failure_config=train.FailureConfig(max_failures=1)))
    with pytest.raises(train.TrainingFailedError, match="max_failures=1") as info:
        trainer.fit()
    assert trainer.failures == 2
    assert info.value.__cause__ is not None and info.value.result.checkpoint is None


def test_loop_that_raises_once_is_retried_and_the_run_completes(tmp_path, capsys):
    trainer = TorchTrainer(flaky_loop, scaling_config=train.ScalingConfig(num_workers=2),
                           run_config=run_config(tmp_path, failure_config=train.FailureConfig(max_failures=2)))
    result = trainer.fit()
    assert trainer.failures == 1
    assert result.metrics["restart_count"] == 1 and result.error is None
    # The failure that was retried shows where it happened (it said only
    # the error's first line, and the run completed without it).
    err = capsys.readouterr().err
    assert "attempt 1 failed (rank 1: " in err, err
    assert "troupe.train: where rank 1's loop failed:\nTraceback (most recent call last):" in err, err
    assert 'raise RuntimeError("worker 1 failing once")' in err, err


def test_loop_that_raises_is_retried_then_fails_and_leaves_no_workers(tmp_path):
    # As Ray Train: a loop that raises is a failure, retried from the last
    # checkpoint while max_failures allows; one that raises on every
    # attempt fails the run with its error.
    trainer = TorchTrainer(raising_loop, train_loop_config={"rank": 1},
                           scaling_config=train.ScalingConfig(num_workers=2),
                           run_config=run_config(tmp_path, failure_config=train.FailureConfig(max_failures=1)))
    with pytest.raises(train.TrainingFailedError, match=r"failed 2 time\(s\), more than max_failures=1; last: rank 1: .*ValueError: bad batch 7") as info:
        trainer.fit()
    assert trainer.failures == 2
    assert isinstance(info.value.__cause__, ValueError)
    # Both workers were stopped: their CPUs come back.
    deadline = time.monotonic() + 60
    while rt.available_resources().get("CPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rt.available_resources().get("CPU", 0) == 4


def test_a_loop_that_ends_the_process_group_itself_completes(tmp_path):
    # TorchTrainer ended the group again after the loop, and torch's
    # assertion failed the finished run, then every retry of it.
    trainer = TorchTrainer(torchrun_style_loop, scaling_config=train.ScalingConfig(num_workers=2),
                           run_config=run_config(tmp_path, failure_config=train.FailureConfig(max_failures=0)))
    result = trainer.fit()
    assert trainer.failures == 0 and result.error is None


def test_a_loop_that_sets_up_the_process_group_again_is_told_to_remove_that(tmp_path):
    trainer = TorchTrainer(init_again_loop, scaling_config=train.ScalingConfig(num_workers=2),
                           run_config=run_config(tmp_path, failure_config=train.FailureConfig(max_failures=0)))
    with pytest.raises(train.TrainingFailedError,
                       match="TorchTrainer sets up the process group before train_loop_per_worker runs and ends it "
                             "after: remove the loop's own dist.init_process_group call"):
        trainer.fit()


def test_bad_input_names_the_value(tmp_path):
    with pytest.raises(ValueError, match="num_workers.*0"):
        train.ScalingConfig(num_workers=0)
    with pytest.raises(ValueError, match="min_workers"):
        train.ScalingConfig(num_workers=2, min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="num_to_keep"):
        train.CheckpointConfig(num_to_keep=0)
    with pytest.raises(ValueError, match="max_failures"):
        train.FailureConfig(max_failures=-2)
    with pytest.raises(TypeError, match="callable"):
        TorchTrainer("not a function")
    with pytest.raises(ValueError, match="no_such_dir"):
        train.Checkpoint.from_directory(str(tmp_path / "no_such_dir"))
    with pytest.raises(RuntimeError, match="report"):
        train.report({"loss": 1.0})
    # Taken as a path, it was once a local folder named "s3:".
    with pytest.raises(ConfigError, match=r"storage_path='s3://bucket/x'.*only local or shared filesystem"):
        train.RunConfig(storage_path="s3://bucket/x")
    with pytest.raises(ValueError, match="backend.*'mpi'"):
        TorchConfig(backend="mpi")
    with pytest.raises(TypeError, match="torch_config"):
        TorchTrainer(ddp_loop, torch_config="gloo")
    # troupe has no Ray Data: what to use instead.
    with pytest.raises(ConfigError, match="no Ray Data.*prepare_data_loader"):
        TorchTrainer(ddp_loop, datasets={"train": [1, 2]})
    with pytest.raises(ConfigError, match="no Ray Data.*prepare_data_loader"):
        train.get_dataset_shard("train")
    # A config that cannot travel to the workers is named by key before any
    # worker is placed (it failed once they ran, naming "argument 2").
    import threading

    with pytest.raises(TypeError, match=r"train_loop_config\['lock'\] \(a lock\) cannot be pickled"):
        TorchTrainer(ddp_loop, train_loop_config={"epochs": 1, "lock": threading.Lock()},
                     run_config=run_config(tmp_path)).fit()
    # A storage path that cannot hold the run's folder is named as the
    # option (it was the bare NotADirectoryError of whichever step met it).
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match=r"RunConfig\(storage_path=.*a-file/runs'\) cannot hold the run's folder: "
                                          r"NotADirectoryError"):
        TorchTrainer(ddp_loop, train_loop_config={"epochs": 1},
                     run_config=train.RunConfig(storage_path=str(tmp_path / "a-file" / "runs"))).fit()
    # A stray file of a checkpoint's name is no checkpoint.
    store = CheckpointStore(str(tmp_path / "run"), train.CheckpointConfig())
    os.makedirs(store.path_of(0))
    open(store.path_of(3), "w").close()
    assert store.indices() == [0] and store.latest().path == store.path_of(0)


def test_gpus_asked_for_and_use_gpu_must_agree():
    # As Ray's: a worker holding a GPU trained on the CPU, and one with
    # use_gpu but GPU=0 fell back to gloo on the CPU, both silently.
    with pytest.raises(ValueError, match=r"GPU=1 but use_gpu is False"):
        train.ScalingConfig(num_workers=1, resources_per_worker={"GPU": 1})
    with pytest.raises(ValueError, match=r"use_gpu=True but resources_per_worker gives GPU=0"):
        train.ScalingConfig(num_workers=1, use_gpu=True, resources_per_worker={"CPU": 1, "GPU": 0})
    train.ScalingConfig(num_workers=1, use_gpu=True, resources_per_worker={"GPU": 0.5})


def slow_rank_0_loop(config):
    """Rank 0 alone works for a while (an evaluation, a save) before the
    report every rank makes."""
    if train.get_context().get_world_rank() == 0:
        time.sleep(config["rank_0_works_s"])  # the slowness under test, not a synchronisation
    train.report({"done": True})


def test_the_process_groups_timeout_is_torchs_and_is_named_when_waited_out(tmp_path):
    # Without a TorchConfig the group's timeout was 300 s, and it bounds every
    # collective: a loop whose rank 0 alone worked for five minutes failed
    # every attempt, told that a rank had died.
    assert trainer_module.worker_module.PROCESS_GROUP_TIMEOUT_S >= 1800
    trainer = TorchTrainer(slow_rank_0_loop, train_loop_config={"rank_0_works_s": 8},
                           torch_config=TorchConfig(timeout_s=3),
                           scaling_config=train.ScalingConfig(num_workers=2), run_config=run_config(tmp_path))
    with pytest.raises(train.TrainingFailedError, match=r"waited out the process group's timeout of 3 s.*"
                                                        r"TorchConfig\(timeout_s=\.\.\.\)"):
        trainer.fit()


def memory_loop():
    train.report({"ok": True})


def test_memory_per_worker_is_the_actors_memory_option(tmp_path):
    # Passed as a custom resource it was refused ("use num_cpus/num_gpus/
    # memory, not resources={'memory': ...}"), failing a config from Ray.
    result = TorchTrainer(memory_loop, scaling_config=train.ScalingConfig(
        num_workers=1, resources_per_worker={"CPU": 1, "memory": 1 << 20}), run_config=run_config(tmp_path)).fit()
    assert result.metrics["ok"] is True


def test_ray_trains_other_options_are_taken_as_ray_takes_them(tmp_path, monkeypatch):
    # A Ray Train script's options: each was a TypeError ("unexpected
    # keyword argument"), or taken and honoured silently differently.
    monkeypatch.setattr(trainer_module, "PLACEMENT_TIMEOUT_S", 30)
    with pytest.raises(ValueError, match="placement_strategy must be one of PACK, SPREAD.*'RANDOM'"):
        train.ScalingConfig(placement_strategy="RANDOM")
    with pytest.raises(ValueError, match="max_failures must be 0 with fail_fast=True, got 1"):
        train.FailureConfig(max_failures=1, fail_fast=True)
    assert train.FailureConfig(fail_fast="RAISE").fail_fast == "raise"
    for tune_only in ({"stop": {"loss": 0.1}}, {"callbacks": [object()]}, {"log_to_file": True},
                      {"storage_filesystem": object()}):
        with pytest.raises(ConfigError, match=f"RunConfig\\({next(iter(tune_only))}=.*troupe.train has no Tune"):
            train.RunConfig(**tune_only)
    train.RunConfig(verbose=0, callbacks=[], log_to_file=False)
    with pytest.raises(ValueError, match=r"checkpoint_frequency=2.*report\(metrics, checkpoint="):
        TorchTrainer(ddp_loop, run_config=train.RunConfig(
            checkpoint_config=train.CheckpointConfig(checkpoint_frequency=2)))
    # "~" is the home folder (it was a folder named "~" here), and a
    # relative checkpoint path is the driver's (workers resolved it in
    # their own working directory).
    assert train.RunConfig(storage_path="~/runs").storage_path == os.path.expanduser("~/runs")
    monkeypatch.chdir(tmp_path)
    assert train.Checkpoint("ck/checkpoint_000001").path == str(tmp_path / "ck" / "checkpoint_000001")
    from troupe.train.base_trainer import TrainingFailedError

    assert TrainingFailedError is train.TrainingFailedError

    # SPREAD places the workers through a placement group, given back after;
    # worker_runtime_env reaches every worker.
    cpus = rt.available_resources().get("CPU", 0)
    result = TorchTrainer(
        scored_loop, train_loop_config={"losses": [5.0, 1.0, 3.0]},
        scaling_config=train.ScalingConfig(num_workers=2, placement_strategy="SPREAD", trainer_resources={"CPU": 0}),
        run_config=run_config(tmp_path, checkpoint_config=train.CheckpointConfig(num_to_keep=2), verbose=0,
                              worker_runtime_env={"env_vars": {"RUN_CONFIG_WORKER_VAR": "from-runtime-env"}})).fit()
    assert result.error is None and result.metrics["var"] == "from-runtime-env"
    deadline = time.monotonic() + 60
    while rt.available_resources().get("CPU", 0) < cpus and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rt.available_resources().get("CPU", 0) == cpus
    # Result.get_best_checkpoint among the kept (iterations 2 and 3: losses 1, 3).
    kept = {os.path.basename(c.path) for c, _ in result.best_checkpoints}
    assert kept == {"checkpoint_000001", "checkpoint_000002"}
    assert result.get_best_checkpoint("loss", "min").path.endswith("checkpoint_000001")
    assert result.get_best_checkpoint("loss", "max").path.endswith("checkpoint_000002")
    assert result.get_best_checkpoint("nested/loss", "min").path.endswith("checkpoint_000001")
    with pytest.raises(RuntimeError, match="no kept checkpoint reported a number for 'no_such_metric' "
                                           "\\(reported: .*loss"):
        result.get_best_checkpoint("no_such_metric", "min")
    with pytest.raises(ValueError, match="mode must be 'min' or 'max', got 'avg'"):
        result.get_best_checkpoint("loss", "avg")
    # Result.from_path reads the same back from the run's folder.
    again = train.Result.from_path(result.path)
    assert again.metrics == result.metrics and again.checkpoint.path == result.checkpoint.path
    assert [c.path for c, _ in again.best_checkpoints] == [c.path for c, _ in result.best_checkpoints]
    with pytest.raises(ConfigError, match="holds no run"):
        train.Result.from_path(str(tmp_path))
    # A strict strategy the cluster (one node) can never meet fails at once,
    # saying why; an accelerator type no node offers too.
    begin = time.monotonic()
    with pytest.raises(train.TrainingFailedError, match=r"placement_strategy='STRICT_SPREAD' needs 2 workers .* "
                                                        r"distinct nodes .* place 1") as info:
        TorchTrainer(scored_loop, train_loop_config={"losses": [1.0]},
                     scaling_config=train.ScalingConfig(num_workers=2, placement_strategy="STRICT_SPREAD"),
                     run_config=train.RunConfig(name="strict", storage_path=str(tmp_path))).fit()
    assert isinstance(info.value.__cause__, ConfigError)
    with pytest.raises(train.TrainingFailedError, match="accelerator_type:H100"):
        TorchTrainer(scored_loop, train_loop_config={"losses": [1.0]},
                     scaling_config=train.ScalingConfig(num_workers=1, accelerator_type="H100"),
                     run_config=train.RunConfig(name="accel", storage_path=str(tmp_path))).fit()
    assert time.monotonic() - begin < 20
    # fail_fast="raise": the loop's own error, not a TrainingFailedError.
    with pytest.raises(ValueError, match="bad batch 7"):
        TorchTrainer(raising_loop, train_loop_config={"rank": 1}, scaling_config=train.ScalingConfig(num_workers=2),
                     run_config=train.RunConfig(name="fast", storage_path=str(tmp_path),
                                                failure_config=train.FailureConfig(fail_fast="raise"))).fit()


def test_checkpoint_metadata_is_a_json_file_in_its_folder(tmp_path):
    checkpoint = train.Checkpoint.from_directory(str(tmp_path))
    assert checkpoint.get_metadata() == {}
    checkpoint.set_metadata({"epoch": torch.tensor(3), "lr": 0.5})
    checkpoint.update_metadata({"lr": 0.1})
    assert train.Checkpoint(str(tmp_path)).get_metadata() == {"epoch": 3, "lr": 0.1}
    assert os.listdir(tmp_path) == [".metadata.json"]


def test_runs_without_a_name_get_folders_of_their_own(tmp_path):
    # Started within one second, they once shared TorchTrainer_<time>, and
    # each run resumed from the checkpoints of the one before.
    from troupe.train.trainer import _fresh_run_name

    names = [_fresh_run_name(str(tmp_path)) for _ in range(5)]
    assert len(set(names)) == 5, names
    assert all((tmp_path / n).is_dir() and n.startswith("TorchTrainer_") for n in names), names


def test_checkpoint_store_is_atomic_and_keeps_the_best(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "w").write_text("x")
    store = CheckpointStore(tmp_path / "run", train.CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="acc"))
    store.sweep()
    (tmp_path / "run" / ".tmp_checkpoint_000000_dead").mkdir()  # what a crash mid-copy leaves
    for acc in (0.9, 0.1, 0.5, 0.2):
        store.persist(str(src), {"acc": acc})
    store.sweep()
    # The two best (0.9 and 0.5: indices 0 and 2) and the latest (3) stay.
    assert _kept(store) == [0, 2, 3]
    assert (tmp_path / "run" / "checkpoint_000003" / "w").read_text() == "x"
    assert store.latest().path.endswith("checkpoint_000003")
    # As Ray's: the best K from the worst to the best, without the latest
    # that only its being the latest kept.
    assert [m["acc"] for _, m in store.best_checkpoints()] == [0.5, 0.9]


def test_a_checkpoint_on_disk_always_has_its_report(tmp_path, monkeypatch):
    """Rank 0 killed while it persists a checkpoint (here: its report's
    write fails): whichever checkpoint a restart resumes from has its
    report, with the loader epochs that restore the data order."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "w").write_text("x")
    store = CheckpointStore(tmp_path / "run", train.CheckpointConfig())
    store.sweep()
    store.persist(str(src), {"loss": 1.0}, extra={"loader_epochs": [0]})

    def killed(*args, **kwargs):
        raise OSError("killed while persisting")

    monkeypatch.setattr(store, "record", killed)
    with pytest.raises(OSError, match="killed while persisting"):
        store.persist(str(src), {"loss": 0.5}, extra={"loader_epochs": [1]})
    monkeypatch.undo()
    store.sweep()  # what the restart does first
    latest = store.latest()
    assert store.report_of(latest.path).get("loader_epochs") == [0], (latest.path, store.progress())
    # The next report takes the index the lost one did not fill.
    store.persist(str(src), {"loss": 0.25}, extra={"loader_epochs": [2]})
    assert store.report_of(store.latest().path)["metrics"] == {"loss": 0.25}


def _kept(store):
    return sorted(int(name[-6:]) for name in os.listdir(store.run_dir) if name.startswith("checkpoint_"))


def _store_of(tmp_path, name, scores, **config):
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    store = CheckpointStore(tmp_path / name, train.CheckpointConfig(checkpoint_score_attribute="acc", **config))
    store.sweep()
    for score in scores:
        store.persist(str(src), {} if score is None else {"acc": score, "hist": np.array([1, 2])})
    return store


def test_a_metric_json_cannot_hold_is_stored_as_its_repr_and_said_once(tmp_path, capsys):
    import datetime

    store = CheckpointStore(tmp_path / "run", train.CheckpointConfig())
    store.sweep()
    when = datetime.date(2026, 1, 2)
    for step in range(3):
        store.record({"loss": 0.5, "when": when, "nested": {"blob": b"ab", "ok": [1, 2]}, "step": step})
    err = capsys.readouterr().err
    assert err.count("metric 'when' is a date") == 1, err
    assert err.count("metric 'nested/blob' is a bytes") == 1, err
    assert "'loss'" not in err and "'step'" not in err and "nested/ok" not in err, err
    assert store.progress()[0]["metrics"]["when"] == repr(when)


def test_keep_k_ranks_scores_as_numbers_and_keeps_the_best_beside_the_latest(tmp_path):
    # num_to_keep=1 once kept only the latest, deleting the best; tensors and
    # NumPy values were stored as text ("tensor(9.)" > "tensor(10.)"), and
    # "min" failed on them.
    best = _store_of(tmp_path, "max", [torch.tensor(9.0), np.float32(10.0), torch.tensor(3) / 4, np.float64(2)],
                     num_to_keep=1)
    assert _kept(best) == [1, 3]
    assert [m["acc"] for _, m in best.best_checkpoints()] == [10.0]
    first = best.progress()[0]["metrics"]
    assert first == {"acc": 9.0, "hist": [1, 2]} and type(first["acc"]) is float
    low = _store_of(tmp_path, "min", [torch.tensor(10.0), torch.tensor(9.0), torch.tensor(11.0), torch.tensor(12.0)],
                    num_to_keep=2, checkpoint_score_order="min")
    assert _kept(low) == [0, 1, 3]
    assert [m["acc"] for _, m in low.best_checkpoints()] == [10.0, 9.0]
    # A score that is no number (text, missing, NaN) ranks below every number.
    odd = _store_of(tmp_path, "odd", ["n/a", None, math.nan, 0.5, "x", 0.1], num_to_keep=1)
    assert _kept(odd) == [3, 5]


def test_batches_of_namedtuples_and_other_mappings_reach_the_device():
    # A namedtuple of two fields raised TypeError, one of one field held a
    # generator, and a UserDict (a tokenizer's BatchEncoding is one) kept
    # its tensors on the CPU.
    import collections

    from troupe.train import torch as train_torch

    meta = torch.device("meta")
    Pair = collections.namedtuple("Pair", "x y")
    One = collections.namedtuple("One", "x")
    moved = train_torch._to(Pair(torch.ones(2), [torch.zeros(1), 3]), meta)
    assert type(moved) is Pair and moved.x.device == meta and moved.y[0].device == meta and moved.y[1] == 3
    one = train_torch._to(One(torch.ones(1)), meta)
    assert type(one) is One and one.x.device == meta
    encoding = train_torch._to(collections.UserDict(input_ids=torch.ones(2), mask=torch.ones(2)), meta)
    assert type(encoding) is collections.UserDict
    assert encoding["input_ids"].device == meta and encoding["mask"].device == meta
    plain = train_torch._to({"a": (torch.ones(1),)}, meta)
    assert type(plain) is dict and type(plain["a"]) is tuple and plain["a"][0].device == meta
