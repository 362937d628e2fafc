"""The configuration objects of troupe.train, named and shaped as Ray Train's
(ray.train.ScalingConfig, RunConfig, FailureConfig, CheckpointConfig), so a
Ray Train script ports by changing its imports. Each validates itself when
made: a bad value fails where it is written, naming the value.
"""

import dataclasses
import os
import re
from typing import Dict, Optional

from ..exceptions import ConfigError


def _check(ok, message):
    if not ok:
        raise ValueError(message)


@dataclasses.dataclass
class ScalingConfig:
    """How many workers and what each holds. With `min_workers` and
    `max_workers` the group is elastic: each (re)start places as many workers
    as the cluster's total resources hold, between the two."""

    num_workers: int = 1
    use_gpu: bool = False
    resources_per_worker: Optional[Dict[str, float]] = None
    min_workers: Optional[int] = None
    max_workers: Optional[int] = None

    def __post_init__(self):
        _check(isinstance(self.num_workers, int) and self.num_workers >= 1,
               f"ScalingConfig.num_workers must be an int >= 1, got {self.num_workers!r}")
        if self.min_workers is not None or self.max_workers is not None:
            lo = self.min_workers if self.min_workers is not None else 1
            hi = self.max_workers if self.max_workers is not None else self.num_workers
            _check(isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi,
                   f"ScalingConfig needs 1 <= min_workers <= max_workers, got {self.min_workers!r}, {self.max_workers!r}")
        for k, v in (self.resources_per_worker or {}).items():
            _check(isinstance(v, (int, float)) and v >= 0,
                   f"ScalingConfig.resources_per_worker[{k!r}] must be a number >= 0, got {v!r}")

    @property
    def elastic(self):
        return self.min_workers is not None or self.max_workers is not None

    def worker_bounds(self):
        """(least, most) workers a start may place."""
        if not self.elastic:
            return self.num_workers, self.num_workers
        lo = self.min_workers if self.min_workers is not None else 1
        hi = self.max_workers if self.max_workers is not None else max(self.num_workers, lo)
        return lo, hi

    def worker_resources(self):
        """What one worker asks of the cluster: CPU 1 (GPU 1 with use_gpu)
        unless resources_per_worker says otherwise."""
        res = dict(self.resources_per_worker or {})
        res.setdefault("CPU", 1)
        if self.use_gpu:
            res.setdefault("GPU", 1)
        return res


@dataclasses.dataclass
class FailureConfig:
    """How many failures a run survives (a worker that dies, or a loop that
    raises): each restarts every worker from the last persisted
    checkpoint. -1 is unlimited, as in Ray."""

    max_failures: int = 0

    def __post_init__(self):
        _check(isinstance(self.max_failures, int) and self.max_failures >= -1,
               f"FailureConfig.max_failures must be an int >= -1, got {self.max_failures!r}")


@dataclasses.dataclass
class CheckpointConfig:
    """Which persisted checkpoints stay: the `num_to_keep` most recent, or,
    as in Ray, the `num_to_keep` best by `checkpoint_score_attribute` (a
    reported metric) and also the latest, since a restart resumes from it.
    A checkpoint whose score is missing, not a number or NaN ranks below
    every one that has a number. None keeps all."""

    num_to_keep: Optional[int] = None
    checkpoint_score_attribute: Optional[str] = None
    checkpoint_score_order: str = "max"

    def __post_init__(self):
        _check(self.num_to_keep is None or (isinstance(self.num_to_keep, int) and self.num_to_keep >= 1),
               f"CheckpointConfig.num_to_keep must be None or an int >= 1, got {self.num_to_keep!r}")
        _check(self.checkpoint_score_order in ("max", "min"),
               f"CheckpointConfig.checkpoint_score_order must be 'max' or 'min', got {self.checkpoint_score_order!r}")


@dataclasses.dataclass
class TorchConfig:
    """Ray's ray.train.torch.TorchConfig: the process group's `backend`
    ("gloo" or "nccl"; None: nccl with use_gpu, else gloo) and how long
    its setup waits for every rank (`timeout_s`)."""

    backend: Optional[str] = None
    timeout_s: int = 1800

    def __post_init__(self):
        _check(self.backend in (None, "gloo", "nccl"),
               f"TorchConfig.backend must be None, 'gloo' or 'nccl', got {self.backend!r}")
        _check(isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0,
               f"TorchConfig.timeout_s must be a number > 0, got {self.timeout_s!r}")


# scheme://..., as s3://bucket/x or gs://...: a URI, not a path.
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclasses.dataclass
class RunConfig:
    """Where a run keeps its checkpoints and metrics:
    `storage_path`/`name`/ (default ~/troupe_results/TorchTrainer_<time>,
    with _2, _3, ... for runs started in the same second)."""

    name: Optional[str] = None
    storage_path: Optional[str] = None
    failure_config: Optional[FailureConfig] = None
    checkpoint_config: Optional[CheckpointConfig] = None

    def __post_init__(self):
        _check(self.name is None or (isinstance(self.name, str) and self.name and os.sep not in self.name),
               f"RunConfig.name must be a non-empty name without {os.sep!r}, got {self.name!r}")
        if self.storage_path is not None and _URI.match(os.fspath(self.storage_path)):
            # Taken as a path, it would be a local folder named "s3:".
            raise ConfigError(f"RunConfig.storage_path={self.storage_path!r} is a URI: troupe.train supports only "
                              "local or shared filesystem paths (mount the bucket and give its path)")
        self.failure_config = self.failure_config or FailureConfig()
        self.checkpoint_config = self.checkpoint_config or CheckpointConfig()
