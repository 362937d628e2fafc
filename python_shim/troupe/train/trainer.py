"""TorchTrainer: Ray Train's TorchTrainer on troupe's actors, in pure Python
over the public API (remote, get, wait, kill, cluster_resources).

`fit()` runs attempts. An attempt places one TrainWorker actor per worker,
orders ranks by node (ranks of a node are contiguous; local ranks follow),
asks rank 0 for a free port (MASTER_PORT) and starts every loop, then waits.
A worker that dies (its actor reports death), or a loop that raises, ends
the attempt: every worker is killed and, while failures <= max_failures, a
new attempt resumes from the latest persisted checkpoint, as Ray Train's
FailureConfig does; past that, fit raises TrainingFailedError with the last
cause (a loop's remote traceback). A group the cluster can never hold is no
failure to retry: fit raises at once. Because a peer's death also surfaces
on the survivors as a gloo error, an error is classified only after the
other ranks have had a grace period to report a death.

fit() also leaves the trainer's arguments in the run folder (trainer.pkl),
so that TorchTrainer.restore(path) makes a trainer that goes on with the
run from the folder alone.
"""

import dataclasses
import datetime
import hashlib
import itertools
import importlib
import os
import sys
import time
import uuid

from . import session
from . import worker as worker_module
from .checkpoint import Checkpoint, CheckpointStore, StorageNotSharedError, _lookup
from .config import CheckpointConfig, RunConfig, ScalingConfig, TorchConfig
from ..exceptions import ConfigError

# What a TorchTrainer worker imports before it serves (troupe's
# preload_modules): torch, torch.distributed (initialised before the loop
# starts) and torch.nn.parallel (prepare_model's DDP).
WORKER_PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel")

# How long an attempt waits for its workers to be placed and start.
PLACEMENT_TIMEOUT_S = 300
# After a loop's error: how long the other ranks get to show a worker death
# or their own errors.
CLASSIFY_GRACE_S = 5.0
# What a rank's collective says when a peer is gone: an echo of another
# rank's failure, never the root cause when a root cause is known.
_PEER_LOST = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "NCCL error",
              "ProcessGroupNCCL", "ProcessGroupGloo")

# What a collective that waited out the process group's timeout says.
_TIMED_OUT = ("Timed out waiting", "Watchdog caught collective operation timeout")

_runtime_name = "troupe"

# What fit() leaves in the run folder for TorchTrainer.restore: the
# trainer's arguments, pickled as they travel to the workers (cloudpickle).
TRAINER_STATE = "trainer.pkl"

# What troupe adds to each row of Result.metrics_dataframe, under Ray's
# names where Ray has one (from the keys of a progress.jsonl line). A
# metric of the loop's own of the same name wins.
_ROW_COLUMNS = {"training_iteration": "iteration", "timestamp": "time", "checkpoint_dir_name": "checkpoint",
                "troupe_restart_count": "restart_count"}

NO_RAY_DATA = ("troupe.train has no Ray Data (datasets=, get_dataset_shard): build a torch DataLoader in the "
               "training loop and pass it to troupe.train.torch.prepare_data_loader, which gives each rank "
               "its shard")


def use_runtime(module_name):
    """Which runtime module the trainer places its workers with: "troupe"
    (the default), or "ray", to check this code against Ray's actors."""
    global _runtime_name
    _runtime_name = module_name


class TrainingFailedError(RuntimeError):
    """fit() failed: a loop raised, or workers died more than max_failures
    times. `__cause__` is the last error; `result` what the run left."""

    def __init__(self, message, result=None):
        super().__init__(message)
        self.result = result


class Result:
    """What a run left (Ray's ray.train.Result)."""

    def __init__(self, metrics, checkpoint, metrics_dataframe, error, path, best_checkpoints):
        self.metrics = metrics
        self.checkpoint = checkpoint
        self.metrics_dataframe = metrics_dataframe
        self.error = error
        self.path = path
        self.best_checkpoints = best_checkpoints

    @classmethod
    def from_path(cls, path):
        """The Result of the run whose folder is `path` (storage_path/name),
        read from what it left there, as Ray's Result.from_path. `error`
        is None: a run's error is not kept in its folder."""
        path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        if not os.path.isdir(path):
            raise ConfigError(f"Result.from_path: {path!r} is not a folder")
        config = CheckpointConfig()
        state = os.path.join(path, TRAINER_STATE)
        if os.path.isfile(state):
            import cloudpickle

            try:
                with open(state, "rb") as f:
                    run_config = cloudpickle.load(f).get("run_config")
                config = run_config.checkpoint_config or config
            except Exception:  # a loop's module that is gone: the default ranking
                pass
        store = CheckpointStore(path, config)
        if not store.progress() and store.latest() is None:
            raise ConfigError(f"Result.from_path: {path!r} holds no run (no reported metrics or checkpoints)")
        return _result_of(store, None)

    def get_best_checkpoint(self, metric, mode):
        """The kept checkpoint whose reported `metric` is the least
        (mode "min") or the greatest ("max"); checkpoints reported without
        it are left out. As Ray's: RuntimeError when the run kept no
        checkpoint, or when none reported `metric` (a misspelt name)."""
        if mode not in ("min", "max"):
            raise ValueError(f"Result.get_best_checkpoint: mode must be 'min' or 'max', got {mode!r}")
        if not self.best_checkpoints:
            raise RuntimeError(f"Result.get_best_checkpoint: the run at {self.path} kept no checkpoint")
        scored = []
        for checkpoint, metrics in self.best_checkpoints:
            value = _lookup(metrics, metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
                scored.append((value, checkpoint))
        if not scored:
            names = sorted({k for _, m in self.best_checkpoints for k in m})
            raise RuntimeError(f"Result.get_best_checkpoint: no kept checkpoint reported a number for {metric!r} "
                               f"(reported: {', '.join(names) or 'nothing'})")
        pick = min if mode == "min" else max
        return pick(scored, key=lambda pair: pair[0])[1]

    def __repr__(self):
        return f"Result(metrics={self.metrics!r}, checkpoint={self.checkpoint!r}, path={self.path!r})"


def _result_of(store, error):
    progress = store.progress()
    metrics = progress[-1]["metrics"] if progress else {}
    rows = []
    for p in progress:
        row = dict(p["metrics"])
        for column, key in _ROW_COLUMNS.items():
            row.setdefault(column, p.get(key))
        rows.append(row)
    try:
        import pandas

        frame = pandas.DataFrame(rows)
    except ImportError:
        frame = rows
    return Result(metrics, store.latest(), frame, error, store.run_dir, store.best_checkpoints())


class _WorkersDied(Exception):
    def __init__(self, rank=None):
        super().__init__(rank)
        self.rank = rank  # the world rank whose worker died, when known


class _LoopRaised(Exception):
    """A worker's loop raised (its error is the cause): a failure to retry,
    unlike an error of the driver's own (an unpicklable loop, a lost
    cluster), which would come back the same on every attempt."""

    def __init__(self, rank=None):
        super().__init__(rank)
        self.rank = rank  # the world rank whose loop raised


def _workers_that_fit(res, nodes, available=False):
    """How many workers asking `res` the nodes hold at once by their total
    resources (a worker is one actor: it lives on one node), or with
    `available` by what is free on them now; None when it asks for
    nothing, or (available) when the nodes do not say what is free
    (Ray's ray.nodes())."""
    if available and not all("AvailableResources" in n for n in nodes):
        return None
    per_node = _fits_per_node(res, nodes, "AvailableResources" if available else "Resources")
    return None if per_node is None else sum(per_node)


def _fits_per_node(res, nodes, field="Resources"):
    """How many workers asking `res` each node holds by its total
    resources (or by `field`'s), None when it asks for nothing."""
    asked = {k: float(v) for k, v in res.items() if v > 0}
    if not asked:
        return None
    return [min(_fits_on_node(k, v, float(n.get(field, {}).get(k, 0))) for k, v in asked.items())
            for n in nodes]


def _fits_on_node(key, amount, total):
    """How many workers asking `amount` of `key` a node holding `total`
    places. A part of a GPU comes out of one GPU (the head never splits a
    worker over two), so 0.4 GPU fits twice on each GPU, not 5 times on 2
    GPUs; shares are taken as the head's scheduler takes them, down to its
    1e-9 slack, so that 10 workers of 0.1 fit on one GPU."""
    if key == "GPU" and amount < 1 - _EPS:
        per_gpu, free = 0, 1.0
        while free + _EPS >= amount:
            free -= amount
            per_gpu += 1
        return int(total + _EPS) * per_gpu
    # A little slack for amounts that are sums of fractions (0.1 * 3).
    return int(total / amount + _EPS)


_EPS = 1e-9  # the head scheduler's slack (runtime/head/scheduler.cc)


def _amounts(resources, keys=None):
    """{CPU: 2, GPU: 1}: the amounts of `keys` (0 where missing), or the
    non-zero ones."""
    if keys is None:
        keys = [k for k, v in resources.items() if v]
    return "{" + ", ".join(f"{k}: {float(resources.get(k, 0)):g}" for k in sorted(keys)) + "}"


def _unplaceable(res, lo, fits, elastic, nodes):
    """Why a group of workers asking `res` can never be placed on `nodes`
    (their total resources, of the kinds a worker asks for)."""
    keys = [k for k, v in res.items() if v > 0]
    total = {k: sum(float(n.get("Resources", {}).get(k, 0)) for n in nodes) for k in keys}
    count = f"{lo} worker{'s' if lo != 1 else ''}"
    wanted = f"at least {count} (min_workers={lo})" if elastic else f"{count} (num_workers={lo})"
    if fits == 0:
        held = "no node has the resources of one worker, even when idle"
    else:
        held = f"its nodes hold at most {fits} such worker{'s' if fits != 1 else ''} when idle"
    shown = 8  # a large cluster's nodes would drown the reason
    per_node = "; ".join(f"node {n.get('NodeID')} {_amounts(n.get('Resources', {}), keys)}" for n in nodes[:shown])
    if len(nodes) > shown:
        per_node += f"; {len(nodes) - shown} more"
    return (f"ScalingConfig asks for {wanted} of {_amounts(res)} each, which this cluster can never place: "
            f"{held} (cluster total {_amounts(total, keys)}; nodes: {per_node or 'none alive'}); give fewer "
            f"workers, less for each (resources_per_worker), or a larger cluster (an embedded one: "
            f"troupe.init(num_cpus=...))")


def _death_errors(rt):
    names = ("ActorDiedError", "RayActorError", "WorkerCrashedError", "ActorUnavailableError")
    return tuple(c for c in (getattr(rt.exceptions, n, None) for n in names) if isinstance(c, type))


def _fresh_run_name(storage):
    """TorchTrainer_<time>, with _2, _3, ... when a run started in the same
    second has that folder: a run of its own never resumes another's
    checkpoints. The folder is made here (exclusively), so two drivers
    starting at once get two names."""
    base = "TorchTrainer_" + datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    os.makedirs(storage, exist_ok=True)
    for n in itertools.count(1):
        name = base if n == 1 else f"{base}_{n}"
        try:
            os.mkdir(os.path.join(storage, name))
            return name
        except FileExistsError:
            continue


def _check_picklable_config(config):
    """train_loop_config travels to every worker: one that cannot be pickled
    is refused before any worker is placed, naming the key (it failed once
    the workers ran, as "argument 2 (a dict) cannot be pickled")."""
    if config is None:
        return
    import cloudpickle

    class _Nowhere:
        def write(self, data):
            return len(data)

    def pickle_away(obj):
        # Into nothing, arrays' buffers out of band: no copy of a large
        # config (a data set in it) is kept.
        cloudpickle.CloudPickler(_Nowhere(), protocol=5, buffer_callback=lambda buffer: None).dump(obj)

    try:
        pickle_away(config)
        return
    except Exception as whole:  # noqa: BLE001 (which key is said below)
        problem = whole
    items = config.items() if isinstance(config, dict) else ()
    for key, value in items:
        try:
            pickle_away(value)
        except Exception as e:  # noqa: BLE001
            raise TypeError(f"TorchTrainer: train_loop_config[{key!r}] (a {type(value).__name__}) cannot be "
                            f"pickled, and the config travels to every worker: {e}") from None
    raise TypeError(f"TorchTrainer: train_loop_config cannot be pickled, and it travels to every worker: "
                    f"{problem}") from None


class TorchTrainer:
    def __init__(self, train_loop_per_worker, *, train_loop_config=None, scaling_config=None, run_config=None,
                 resume_from_checkpoint=None, torch_config=None, datasets=None):
        if datasets is not None:
            raise ConfigError(f"TorchTrainer(datasets=...): {NO_RAY_DATA}")
        if not callable(train_loop_per_worker):
            raise TypeError(f"TorchTrainer: train_loop_per_worker must be callable, "
                            f"got {type(train_loop_per_worker).__name__}")
        if scaling_config is not None and not isinstance(scaling_config, ScalingConfig):
            raise TypeError(f"TorchTrainer: scaling_config must be a ScalingConfig, got {scaling_config!r}")
        if run_config is not None and not isinstance(run_config, RunConfig):
            raise TypeError(f"TorchTrainer: run_config must be a RunConfig, got {run_config!r}")
        if resume_from_checkpoint is not None and not isinstance(resume_from_checkpoint, Checkpoint):
            raise TypeError(f"TorchTrainer: resume_from_checkpoint must be a Checkpoint, got {resume_from_checkpoint!r}")
        if torch_config is not None and not isinstance(torch_config, TorchConfig):
            raise TypeError(f"TorchTrainer: torch_config must be a TorchConfig, got {torch_config!r}")
        cc = run_config.checkpoint_config if run_config is not None else None
        if cc is not None and (cc.checkpoint_frequency or cc.checkpoint_at_end):
            raise ValueError(f"TorchTrainer: CheckpointConfig(checkpoint_frequency={cc.checkpoint_frequency!r}, "
                             f"checkpoint_at_end={cc.checkpoint_at_end!r}) is for trainables that checkpoint "
                             "themselves; a training loop reports its checkpoints: "
                             "troupe.train.report(metrics, checkpoint=Checkpoint.from_directory(...))")
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = train_loop_config
        self.scaling_config = scaling_config or ScalingConfig()
        self.run_config = run_config or RunConfig()
        self.resume_from_checkpoint = resume_from_checkpoint
        self.torch_config = torch_config
        self.failures = 0

    # -------------------------------------------------------------- restore

    @classmethod
    def can_restore(cls, path):
        """Whether `path` is the folder of a run fit() started (it holds
        what fit() left there for restore)."""
        return os.path.isfile(os.path.join(os.fspath(path), TRAINER_STATE))

    @classmethod
    def restore(cls, path, train_loop_per_worker=None, train_loop_config=None, *, scaling_config=None,
                torch_config=None, datasets=None):
        """A trainer whose fit() goes on with the run at `path` (a run
        folder, `storage_path/name`) from its latest checkpoint, with the
        arguments that run was given; those given here replace them."""
        path = os.path.abspath(os.fspath(path))
        if not cls.can_restore(path):
            raise ConfigError(f"TorchTrainer.restore: {path!r} is not the folder of a TorchTrainer run "
                              f"(it has no {TRAINER_STATE})")
        import cloudpickle

        with open(os.path.join(path, TRAINER_STATE), "rb") as f:
            state = cloudpickle.load(f)
        given = {"train_loop_per_worker": train_loop_per_worker, "train_loop_config": train_loop_config,
                 "scaling_config": scaling_config, "torch_config": torch_config, "datasets": datasets}
        state.update({k: v for k, v in given.items() if v is not None})
        # The run is the folder's, wherever it was first started from.
        run_config = state.get("run_config") or RunConfig()
        state["run_config"] = dataclasses.replace(run_config, storage_path=os.path.dirname(path),
                                                  name=os.path.basename(path))
        return cls(state.pop("train_loop_per_worker"), **state)

    def _save_state(self, store):
        """Leaves this trainer's arguments in the run folder for restore().
        A loop that does not pickle leaves none (its workers will say why)."""
        import cloudpickle

        final = os.path.join(store.run_dir, TRAINER_STATE)
        state = {"train_loop_per_worker": self.train_loop_per_worker, "train_loop_config": self.train_loop_config,
                 "scaling_config": self.scaling_config, "run_config": self.run_config,
                 "resume_from_checkpoint": self.resume_from_checkpoint, "torch_config": self.torch_config}
        try:
            blob = cloudpickle.dumps(state)
        except Exception:
            if os.path.exists(final):
                os.remove(final)  # an earlier fit's arguments are not this one's
            return
        tmp = f"{final}.{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, final)

    # ------------------------------------------------------------------ fit

    def fit(self):
        _check_picklable_config(self.train_loop_config)
        self._report_wait_warning_s = session.report_wait_warning_s()
        rt = importlib.import_module(_runtime_name)
        if not rt.is_initialized():
            rt.init()
        storage = self.run_config.storage_path or os.path.join(os.path.expanduser("~"), "troupe_results")
        try:
            name = self.run_config.name or _fresh_run_name(os.path.abspath(storage))
            store = CheckpointStore(os.path.join(os.path.abspath(storage), name), self.run_config.checkpoint_config)
            store.sweep()
            self._save_state(store)
        except OSError as e:
            # Before anything runs: the folder, named as the option that
            # gave it (it was the bare OSError of whichever step met it).
            raise ConfigError(f"TorchTrainer: RunConfig(storage_path={storage!r}) cannot hold the run's folder: "
                              f"{type(e).__name__}: {e}") from e
        try:
            return self._attempts(rt, store, name)
        finally:
            store.remove_marker()  # however the run ends (a fail_fast raise, Ctrl-C)

    def _attempts(self, rt, store, name):
        max_failures = self.run_config.failure_config.max_failures
        self.failures = 0
        while True:
            try:
                self._attempt(rt, store, name)
                return self._result(store, None)
            except (_WorkersDied, _LoopRaised) as failure:
                # A worker died or a loop raised: a failure either way, as in Ray Train.
                cause = failure.__cause__
                if isinstance(cause, StorageNotSharedError):
                    # Not the loop's: every attempt would meet it again.
                    raise self._failed(store, f"run {name!r} failed: {cause}", cause) from cause
                self.failures += 1
                # As Ray Train's "[Rank N]": which rank, not only a pid.
                who = "" if failure.rank is None else f"rank {failure.rank}: "
                what = (f"workers died: {who}{cause}" if isinstance(failure, _WorkersDied)
                        else f"{who}{type(cause).__name__}: {cause}")
                if self.run_config.failure_config.fail_fast == "raise":
                    raise cause
                if 0 <= max_failures < self.failures:
                    raise self._failed(store, f"run {name!r} failed {self.failures} time(s), more than "
                                              f"max_failures={max_failures}; last: {what}", cause) from cause
                first = str(what).splitlines()[0] if str(what) else type(cause).__name__
                print(f"troupe.train: run {name!r}: attempt {self.failures} failed ({first}); restarting from the "
                      f"latest checkpoint ({self.failures} of {'unlimited' if max_failures < 0 else max_failures} "
                      "failures)", file=sys.stderr, flush=True)
                # Where it failed, as Ray Train shows each failure: the
                # run may well complete, and the error be seen nowhere else.
                trace = getattr(cause, "traceback_str", "")
                if trace:
                    loop = "the loop" if failure.rank is None else f"rank {failure.rank}'s loop"
                    print(f"troupe.train: where {loop} failed:\n{trace.rstrip()}", file=sys.stderr, flush=True)
            except Exception as e:
                raise self._failed(store, f"run {name!r} failed: {type(e).__name__}: {e}", e) from e

    def _failed(self, store, message, cause):
        return TrainingFailedError(message, self._result(store, cause))

    def _result(self, store, error):
        return _result_of(store, error)

    # -------------------------------------------------------------- attempt

    def _attempt(self, rt, store, name):
        workers, groups = [], []
        store.sweep()  # what an attempt before this one left half-written or staged
        try:
            self._place(rt, workers, groups)
            refs = self._start(rt, workers, store, name)
            self._wait(rt, refs)
        except _death_errors(rt) as e:  # while placing or starting
            raise _WorkersDied() from e
        finally:
            for w in workers:
                try:
                    rt.kill(w)
                except Exception:  # already gone: nothing to stop
                    pass
            for pg in groups:
                try:
                    rt.util.remove_placement_group(pg)
                except Exception:  # the cluster is gone: nothing to give back
                    pass

    def _group_size(self, rt):
        """How many workers this attempt places: num_workers, or, elastic,
        as many as the cluster holds between min_workers and max_workers.
        A group the cluster's total resources can never hold is a
        ConfigError at once (placing it would wait PLACEMENT_TIMEOUT_S for
        nothing); one that fits the total but not what is free now waits."""
        lo, hi = self.scaling_config.worker_bounds()
        res = self.scaling_config.worker_resources()
        nodes = [n for n in rt.nodes() if n.get("Alive", True)]
        fits = _workers_that_fit(res, nodes)
        if fits is not None and fits < lo:
            if self.failures == 0:
                raise ConfigError(_unplaceable(res, lo, fits, self.scaling_config.elastic, nodes))
            # A restart after a node was lost: it may come back, as Ray's
            # restart waits for resources (it failed the run at once,
            # whatever max_failures said). Placing waits for it, bounded.
            return lo
        if lo == hi:
            return lo
        size = min(hi if fits is None else fits, hi)
        # Elastic: as many as what is free now holds (others' actors hold
        # part of the cluster), at least min_workers, which waits. Sized by
        # the totals alone it asked for max_workers, waited out the
        # placement timeout, and failed every attempt.
        free = _workers_that_fit(res, nodes, available=True)
        # (A restart sees the last attempt's workers' resources free: each
        # rt.kill returns once its worker is DEAD, which the head sets as
        # it gives them back; test_an_elastic_group_restarts_as_large_as_before.)
        return size if free is None else max(lo, min(size, free))

    def _place(self, rt, workers, groups):
        """Creates the workers into `workers` (so that the caller stops them
        whatever happens; a placement group they are in goes into
        `groups`), then puts them in rank order."""
        res = self.scaling_config.worker_resources()
        bundle = {k: v for k, v in res.items() if v > 0}
        # Workers import torch before they are ready: a pooled one taken for
        # the next attempt (after a death) has it loaded already.
        opts = {"num_cpus": res.pop("CPU"), "num_gpus": res.pop("GPU", 0), "max_restarts": 0,
                "preload_modules": list(WORKER_PRELOAD)}
        if "memory" in res:  # an actor option of its own, as Ray's WorkerGroup passes it
            opts["memory"] = res.pop("memory")
        if res:
            opts["resources"] = res
        if self.run_config.worker_runtime_env:
            opts["runtime_env"] = dict(self.run_config.worker_runtime_env)
        actor_class = rt.remote(**opts)(worker_module.TrainWorker)
        n = self._group_size(rt)
        strategy = self.scaling_config.placement_strategy
        if strategy == "PACK" or not bundle:
            workers.extend(actor_class.remote(_runtime_name) for _ in range(n))
        else:
            workers.extend(self._place_in_group(rt, actor_class, bundle, n, strategy, groups))
        try:
            infos = rt.get([w.node_info.remote() for w in workers], timeout=PLACEMENT_TIMEOUT_S)
        except rt.exceptions.GetTimeoutError as e:
            why = RuntimeError(f"could not place {len(workers)} workers of {self.scaling_config.worker_resources()} "
                               f"within {PLACEMENT_TIMEOUT_S} s")
            if self.failures > 0:
                # On a restart (a node lost and not back yet) a failure of
                # its own, counted against max_failures, not the run's end.
                raise _WorkersDied() from why
            raise why from e
        node_order = {}
        for info in infos:
            node_order.setdefault(info["node_id"], len(node_order))
        ranked = sorted(range(len(workers)), key=lambda i: (node_order[infos[i]["node_id"]], i))
        self._infos = [infos[i] for i in ranked]
        self._node_order = node_order
        workers[:] = [workers[i] for i in ranked]

    def _place_in_group(self, rt, actor_class, bundle, n, strategy, groups):
        """n workers, one per bundle of a placement group of `strategy`. A
        strict strategy the cluster can never meet is a ConfigError at
        once (its group would stay pending until the placement timeout)."""
        if strategy in ("STRICT_PACK", "STRICT_SPREAD"):
            nodes = [nd for nd in rt.nodes() if nd.get("Alive", True)]
            per_node = _fits_per_node(bundle, nodes)
            can = sum(1 for f in per_node if f >= 1) if strategy == "STRICT_SPREAD" else max(per_node, default=0)
            least = self.scaling_config.worker_bounds()[0]
            if least <= can < n:
                n = can  # an elastic group takes what the strategy can place
            if can < n and self.failures == 0:  # a restart waits for a lost node, as below
                where = "distinct nodes that each hold" if strategy == "STRICT_SPREAD" else "one node holding"
                raise ConfigError(f"TorchTrainer: placement_strategy={strategy!r} needs {n} workers of {bundle} on "
                                  f"{where} them; the cluster's {len(nodes)} node(s) place {can}")
        strategies = importlib.import_module(f"{_runtime_name}.util.scheduling_strategies")
        pg = rt.util.placement_group([dict(bundle) for _ in range(n)], strategy=strategy)
        groups.append(pg)
        try:
            rt.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except rt.exceptions.GetTimeoutError as e:
            why = RuntimeError(f"could not reserve {n} bundles of {bundle} with placement_strategy={strategy!r} "
                               f"within {PLACEMENT_TIMEOUT_S} s")
            if self.failures > 0:
                raise _WorkersDied() from why  # a restart's: one more failure, as _place's
            raise why from e
        return [actor_class.options(scheduling_strategy=strategies.PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=i)).remote(_runtime_name) for i in range(n)]

    def _start(self, rt, workers, store, name):
        per_node = {}
        for info in self._infos:
            per_node[info["node_id"]] = per_node.get(info["node_id"], 0) + 1
        port = rt.get(workers[0].free_port.remote(), timeout=PLACEMENT_TIMEOUT_S)
        latest = store.latest() or self.resume_from_checkpoint
        cc = self.run_config.checkpoint_config
        tc = self.torch_config
        # The same id for every attempt of a run, and for a run resumed by its name.
        trial_id = hashlib.sha1(os.path.abspath(store.run_dir).encode()).hexdigest()[:8]
        refs, seen = [], {}
        node_gpus = worker_module.node_gpu_lists(self._infos) if self.scaling_config.use_gpu else {}
        for rank, (w, info) in enumerate(zip(workers, self._infos)):
            node = info["node_id"]
            local_rank = seen.get(node, 0)
            seen[node] = local_rank + 1
            spec = {
                "context": {"world_rank": rank, "world_size": len(workers), "local_rank": local_rank,
                            "local_world_size": per_node[node], "node_rank": self._node_order[node],
                            "experiment_name": name, "trial_dir": store.run_dir, "restart_count": self.failures,
                            "trial_id": trial_id},
                "master_addr": self._infos[0]["ip"], "master_port": port, "use_gpu": self.scaling_config.use_gpu,
                "node_gpus": node_gpus.get(node),
                "backend": tc.backend if tc else None, "timeout_s": tc.timeout_s if tc else None,
                "checkpoint": latest.path if latest else None,
                "storage_marker": store.marker_token,
                # Read in the driver: workers do not inherit troupe's own
                # variables.
                "report_wait_warning_s": self._report_wait_warning_s,
                "checkpoint_config": {"num_to_keep": cc.num_to_keep,
                                      "checkpoint_score_attribute": cc.checkpoint_score_attribute,
                                      "checkpoint_score_order": cc.checkpoint_score_order},
            }
            if _runtime_name == "troupe":
                # A cluster's worker files reach this console marked as an
                # embedded cluster's workers mark their lines.
                from .. import _driver_logs
                _driver_logs.label_actor(w._actor.id, f"TrainWorker rank={rank}")
            refs.append(w.run.remote(spec, self.train_loop_per_worker, self.train_loop_config))
        return refs

    def _wait(self, rt, refs):
        """Returns when every loop returned; raises _WorkersDied when a worker
        died, else the root error: the first that is not a collective's echo
        of a lost peer."""
        deaths = _death_errors(rt)
        def rank_of(ref):
            return next((rank for rank, r in enumerate(refs) if r is ref or r == ref), None)

        pending = list(refs)
        errors = []
        grace_until = None
        while pending:
            timeout = 1.0 if grace_until is None else max(0.0, grace_until - time.monotonic())
            ready, pending = rt.wait(pending, num_returns=1, timeout=timeout)
            for ref in ready:
                try:
                    rt.get(ref, timeout=PLACEMENT_TIMEOUT_S)
                except deaths as e:
                    raise _WorkersDied(rank_of(ref)) from e
                except Exception as e:
                    errors.append((rank_of(ref), e))
                    grace_until = grace_until or time.monotonic() + CLASSIFY_GRACE_S
            if grace_until is not None and time.monotonic() >= grace_until:
                break
        if errors:
            roots = [(r, e) for r, e in errors if not any(m in str(e) for m in _PEER_LOST)]
            rank, error = (roots or errors)[0]
            if not roots and any(m in str(error) for m in _TIMED_OUT):
                # Every rank's error is a collective that waited out the
                # group's timeout: said as that, not as a lost peer.
                timeout = (self.torch_config.timeout_s if self.torch_config
                           else worker_module.PROCESS_GROUP_TIMEOUT_S)
                raise _LoopRaised(rank) from RuntimeError(
                    f"a collective waited out the process group's timeout of {timeout} s (one rank was that "
                    "much slower to reach it than another; give TorchTrainer(torch_config=TorchConfig("
                    f"timeout_s=...)) more): {error}")
            raise _LoopRaised(rank) from error
