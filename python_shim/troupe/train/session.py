"""What the training loop sees of its run, inside a worker: `report`,
`get_checkpoint` and `get_context` (Ray Train's ray.train.report, ...).

A worker runs one loop at a time, so the run's state is one module global
that TrainWorker.run sets before calling the loop and clears after. Outside a
run the functions raise, naming what was called.
"""

import dataclasses
import os
import sys
import threading
from typing import Optional

from .checkpoint import Checkpoint, CheckpointStore


@dataclasses.dataclass
class TrainContext:
    """Where this worker stands in the group (Ray's TrainContext)."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    experiment_name: str
    trial_dir: str
    restart_count: int = 0
    trial_id: str = ""

    def get_world_rank(self):
        return self.world_rank

    def get_world_size(self):
        return self.world_size

    def get_local_rank(self):
        return self.local_rank

    def get_local_world_size(self):
        return self.local_world_size

    def get_node_rank(self):
        return self.node_rank

    def get_experiment_name(self):
        return self.experiment_name

    def get_trial_dir(self):
        return self.trial_dir

    def get_restart_count(self):
        return self.restart_count

    def get_trial_name(self):
        """The run's name (RunConfig.name): a TorchTrainer run is one trial."""
        return self.experiment_name

    def get_trial_id(self):
        """An id of the run, the same for every attempt of it."""
        return self.trial_id


@dataclasses.dataclass
class _Session:
    context: TrainContext
    store: CheckpointStore
    checkpoint: Optional[Checkpoint]
    use_gpu: bool
    reports: int = 0
    # A gloo group of the same ranks for report()'s small exchanges when
    # the training group is NCCL's (None: the default group).
    control_group: object = None
    # The prepared data loaders (weak references to
    # troupe.train.torch._EpochLoader), in the order the loop made them,
    # and the epochs this rank's resume at (from the checkpoint resumed,
    # when its report recorded them).
    loaders: list = dataclasses.field(default_factory=list)
    resume_epochs: Optional[list] = None

    def __post_init__(self):
        if self.checkpoint is None:
            return
        # Reports go on counting from the one that made the checkpoint, so
        # that an iteration names the same step of training in every attempt.
        report = self.store.report_of(self.checkpoint.path)
        if isinstance(report.get("iteration"), int):
            self.reports = report["iteration"]
        by_rank = report.get("loader_epochs")
        if by_rank:
            # A group of another size (elastic) takes rank 0's.
            rank = self.context.world_rank
            self.resume_epochs = by_rank[rank] if rank < len(by_rank) else by_rank[0]

    def add_loader(self, loader):
        """Registers a prepared loader; returns the epoch it resumes at (or
        None)."""
        import weakref

        index = len(self.loaders)
        self.loaders.append(weakref.ref(loader))
        if self.resume_epochs and index < len(self.resume_epochs):
            return self.resume_epochs[index]
        return None

    def loader_epochs(self):
        """Each registered loader's epoch to resume at (None: gone, or no
        DistributedSampler)."""
        return [None if (loader := ref()) is None else loader._resume_epoch() for ref in self.loaders]


_session: Optional[_Session] = None

# How long a rank waits in report() for the others before it says so (a
# rank that never reports, or reports only on rank 0, keeps it there). The
# driver reads TROUPE_REPORT_WAIT_WARNING_S (workers do not inherit troupe's
# own variables) and hands it to each worker with its spec.
REPORT_WAIT_WARNING_S = 60.0


def report_wait_warning_s():
    """TROUPE_REPORT_WAIT_WARNING_S of this process (the driver), else 60;
    a value that is not a positive number is a ConfigError naming it."""
    raw = os.environ.get("TROUPE_REPORT_WAIT_WARNING_S")
    if raw is None:
        return 60.0
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        from troupe.exceptions import ConfigError
        raise ConfigError(f"TROUPE_REPORT_WAIT_WARNING_S must be a positive number of seconds, got {raw!r}")
    return seconds


def _current(what):
    if _session is None:
        raise RuntimeError(f"troupe.train.{what}() is for the training loop of a TorchTrainer worker; "
                           "no run is active in this process")
    return _session


def start(session):
    global _session
    _session = session


def end():
    global _session
    _session = None


class _WaitWarning:
    """Says on stderr, once, that this rank has waited `after_s` seconds in
    report() for the other ranks: without it, a report made on rank 0 only
    (a common slip: `if rank == 0: train.report(...)`) hangs silently."""

    def __init__(self, rank, report, after_s):
        self._timer = None
        if after_s > 0:
            self._timer = threading.Timer(after_s, self._say, args=(rank, report, after_s))
            self._timer.daemon = True
            self._timer.start()

    @staticmethod
    def _say(rank, report, after_s):
        print(f"troupe.train.report: rank {rank} has waited {after_s:g} s for the other ranks' report #{report}; "
              "every rank must call report() the same number of times (a report made only on rank 0 waits here "
              "for good)", file=sys.stderr, flush=True)

    def cancel(self):
        if self._timer is not None:
            self._timer.cancel()


def _exchange(s, has):
    """What every rank's report of this step brings: which ranks carry a
    checkpoint, and each rank's loader epochs (a collective over the
    group, on its gloo side group under NCCL)."""
    import torch.distributed as dist

    mine = (bool(has), s.loader_epochs())
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ([0] if has else []), [mine[1]]
    seen = [None] * dist.get_world_size()
    waiting = _WaitWarning(s.context.world_rank, s.reports, REPORT_WAIT_WARNING_S)
    try:
        dist.all_gather_object(seen, mine, group=s.control_group)
    except RuntimeError as e:
        raise RuntimeError(f"troupe.train.report: the ranks could not exchange this report ({e}): a rank died, or "
                           "ended its loop having called report() fewer times than this one; every rank must call "
                           "report() the same number of times, as in Ray Train") from e
    finally:
        waiting.cancel()
    return [r for r, (f, _) in enumerate(seen) if f], [epochs for _, epochs in seen]


def report(metrics, checkpoint=None):
    """Reports this step's metrics (a dict) and, optionally, a checkpoint.
    Every rank calls it the same number of times (as in Ray Train): the
    ranks learn which of them report a checkpoint. Rank 0's metrics are the
    run's; the checkpoint persisted (atomically, keep-K) holds the files of
    every rank that reported one (a sharded checkpoint), rank 0's winning
    where two ranks wrote the same file name. Each rank's data loaders'
    epochs are recorded with it, for a run resumed from it."""
    s = _current("report")
    if not isinstance(metrics, dict):
        raise TypeError(f"troupe.train.report: metrics must be a dict, got {type(metrics).__name__}")
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        raise TypeError(f"troupe.train.report: checkpoint must be a troupe.train.Checkpoint, "
                        f"got {type(checkpoint).__name__}")
    s.reports += 1
    ranks, epochs = _exchange(s, checkpoint is not None)
    others = [r for r in ranks if r != 0]
    rank = s.context.world_rank
    if others:
        # Each other rank stages its files where rank 0 finds them, and
        # the group waits until all are staged.
        import torch.distributed as dist

        if rank in others:
            s.store.stage_part(s.reports, rank, checkpoint.path)
        dist.barrier(group=s.control_group)
    if rank != 0:
        return
    extra = {"iteration": s.reports, "restart_count": s.context.restart_count, "loader_epochs": epochs}
    if ranks:
        s.store.persist(checkpoint.path if checkpoint is not None else None, metrics, extra,
                        parts=[(r, s.store.part_path(s.reports, r)) for r in others])
    else:
        s.store.record(metrics, None, extra)


def get_checkpoint():
    """The latest persisted checkpoint when this attempt started (after a
    restart: the one to resume from), or the run's resume_from_checkpoint;
    None on a fresh run."""
    return _current("get_checkpoint").checkpoint


def get_context():
    return _current("get_context").context


def get_dataset_shard(dataset_name=None):
    """Ray's, for Ray Data's datasets, which troupe does not have."""
    from ..exceptions import ConfigError
    from .trainer import NO_RAY_DATA

    raise ConfigError(f"troupe.train.get_dataset_shard({dataset_name!r}): {NO_RAY_DATA}")


def use_gpu():
    return _session is not None and _session.use_gpu


def local_env(ctx, master_addr, master_port):
    """The environment torchrun would give this rank."""
    return {
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(ctx.world_rank),
        "WORLD_SIZE": str(ctx.world_size), "LOCAL_RANK": str(ctx.local_rank),
        "LOCAL_WORLD_SIZE": str(ctx.local_world_size), "NODE_RANK": str(ctx.node_rank),
        "GROUP_RANK": str(ctx.node_rank), "TORCHELASTIC_RESTART_COUNT": str(ctx.restart_count),
    }
