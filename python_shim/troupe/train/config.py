"""The configuration objects of troupe.train, named and shaped as Ray Train's
(ray.train.ScalingConfig, RunConfig, FailureConfig, CheckpointConfig), so a
Ray Train script ports by changing its imports. Each validates itself when
made: a bad value fails where it is written, naming the value.
"""

import dataclasses
import os
import re
from typing import Any, Dict, List, Optional, Union

from ..exceptions import ConfigError


def _check(ok, message):
    if not ok:
        raise ValueError(message)


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclasses.dataclass
class ScalingConfig:
    """How many workers and what each holds. With `min_workers` and
    `max_workers` the group is elastic: each (re)start places as many workers
    as the cluster's total resources hold, between the two.

    `placement_strategy` as Ray's: "PACK" (the default) places workers as
    the scheduler places actors, filling nodes; the others reserve the
    workers' resources as a placement group of that strategy first.
    `accelerator_type` asks for nodes that offer the resource
    "accelerator_type:<type>", as Ray does. `trainer_resources` is taken
    for Ray's sake: troupe has no trainer actor (the driver runs the
    attempts), so nothing is reserved for one."""

    num_workers: int = 1
    use_gpu: bool = False
    resources_per_worker: Optional[Dict[str, float]] = None
    min_workers: Optional[int] = None
    max_workers: Optional[int] = None
    placement_strategy: str = "PACK"
    trainer_resources: Optional[Dict[str, float]] = None
    accelerator_type: Optional[str] = None

    def __post_init__(self):
        _check(isinstance(self.num_workers, int) and self.num_workers >= 1,
               f"ScalingConfig.num_workers must be an int >= 1, got {self.num_workers!r}")
        _check(self.placement_strategy in PLACEMENT_STRATEGIES,
               f"ScalingConfig.placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, "
               f"got {self.placement_strategy!r}")
        _check(self.accelerator_type is None or (isinstance(self.accelerator_type, str) and self.accelerator_type),
               f"ScalingConfig.accelerator_type must be a non-empty str or None, got {self.accelerator_type!r}")
        for k, v in (self.trainer_resources or {}).items():
            _check(isinstance(v, (int, float)) and v >= 0,
                   f"ScalingConfig.trainer_resources[{k!r}] must be a number >= 0, got {v!r}")
        if self.min_workers is not None or self.max_workers is not None:
            lo = self.min_workers if self.min_workers is not None else 1
            hi = self.max_workers if self.max_workers is not None else self.num_workers
            _check(isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi,
                   f"ScalingConfig needs 1 <= min_workers <= max_workers, got {self.min_workers!r}, {self.max_workers!r}")
        for k, v in (self.resources_per_worker or {}).items():
            _check(isinstance(v, (int, float)) and v >= 0,
                   f"ScalingConfig.resources_per_worker[{k!r}] must be a number >= 0, got {v!r}")
        # As Ray's: GPUs asked for and use_gpu agree (a worker holding a GPU
        # trained on the CPU, or one with use_gpu and none fell back to it).
        gpus = (self.resources_per_worker or {}).get("GPU")
        _check(not (gpus and not self.use_gpu),
               f"ScalingConfig: resources_per_worker asks for GPU={gpus!r} but use_gpu is False: set use_gpu=True")
        _check(not (self.use_gpu and gpus is not None and gpus == 0),
               "ScalingConfig: use_gpu=True but resources_per_worker gives GPU=0: give each worker a GPU "
               "(or a fraction of one), or set use_gpu=False")

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
        if self.accelerator_type:
            res.setdefault(f"accelerator_type:{self.accelerator_type}", 0.001)
        return res


@dataclasses.dataclass
class FailureConfig:
    """How many failures a run survives (a worker that dies, or a loop that
    raises): each restarts every worker from the last persisted
    checkpoint. -1 is unlimited, as in Ray. `fail_fast` as Ray's: True
    fails at the first failure (max_failures must be 0); "raise" raises
    the loop's own error instead of a TrainingFailedError."""

    max_failures: int = 0
    fail_fast: Union[bool, str] = False

    def __post_init__(self):
        _check(isinstance(self.max_failures, int) and self.max_failures >= -1,
               f"FailureConfig.max_failures must be an int >= -1, got {self.max_failures!r}")
        if isinstance(self.fail_fast, str) and self.fail_fast.lower() == "raise":
            self.fail_fast = "raise"  # any case, as Ray takes it
        _check(self.fail_fast in (True, False, "raise"),
               f"FailureConfig.fail_fast must be True, False or 'raise', got {self.fail_fast!r}")
        _check(not self.fail_fast or self.max_failures == 0,
               f"FailureConfig: max_failures must be 0 with fail_fast={self.fail_fast!r}, got {self.max_failures!r}")


@dataclasses.dataclass
class CheckpointConfig:
    """Which persisted checkpoints stay: the `num_to_keep` most recent, or,
    as in Ray, the `num_to_keep` best by `checkpoint_score_attribute` (a
    reported metric) and also the latest, since a restart resumes from it.
    A checkpoint whose score is missing, not a number or NaN ranks below
    every one that has a number. None keeps all.

    `checkpoint_frequency` and `checkpoint_at_end` are Ray's fields for
    trainables that checkpoint themselves; a TorchTrainer's loop reports
    its checkpoints, so TorchTrainer refuses them (as Ray's does)."""

    num_to_keep: Optional[int] = None
    checkpoint_score_attribute: Optional[str] = None
    checkpoint_score_order: str = "max"
    checkpoint_frequency: int = 0
    checkpoint_at_end: Optional[bool] = None

    def __post_init__(self):
        _check(self.num_to_keep is None or (isinstance(self.num_to_keep, int) and self.num_to_keep >= 1),
               f"CheckpointConfig.num_to_keep must be None or an int >= 1, got {self.num_to_keep!r}")
        _check(self.checkpoint_score_order in ("max", "min"),
               f"CheckpointConfig.checkpoint_score_order must be 'max' or 'min', got {self.checkpoint_score_order!r}")
        _check(isinstance(self.checkpoint_frequency, int) and self.checkpoint_frequency >= 0,
               f"CheckpointConfig.checkpoint_frequency must be an int >= 0, got {self.checkpoint_frequency!r}")


@dataclasses.dataclass
class TorchConfig:
    """Ray's ray.train.torch.TorchConfig: the process group's `backend`
    ("gloo" or "nccl"; None: nccl with use_gpu, else gloo) and its timeout
    (`timeout_s`), which bounds its setup and every collective on it."""

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
    with _2, _3, ... for runs started in the same second; "~" is the
    user's home). `worker_runtime_env` is every worker's runtime_env.

    Ray Tune's fields are taken at their defaults only (troupe has no
    Tune): `callbacks`, `stop`, `sync_config`, `storage_filesystem` and
    `log_to_file` set to anything else are a ConfigError naming them (the
    workers' output reaches the driver and the session's logs). `verbose`
    is taken and changes nothing."""

    name: Optional[str] = None
    storage_path: Optional[str] = None
    failure_config: Optional[FailureConfig] = None
    checkpoint_config: Optional[CheckpointConfig] = None
    worker_runtime_env: Optional[Dict[str, Any]] = None
    verbose: Optional[int] = None
    callbacks: Optional[List[Any]] = None
    stop: Optional[Any] = None
    sync_config: Optional[Any] = None
    storage_filesystem: Optional[Any] = None
    log_to_file: Union[bool, str, tuple] = False

    def __post_init__(self):
        _check(self.name is None or (isinstance(self.name, str) and self.name and os.sep not in self.name),
               f"RunConfig.name must be a non-empty name without {os.sep!r}, got {self.name!r}")
        if self.storage_path is not None and _URI.match(os.fspath(self.storage_path)):
            # Taken as a path, it would be a local folder named "s3:".
            raise ConfigError(f"RunConfig.storage_path={self.storage_path!r} is a URI: troupe.train supports only "
                              "local or shared filesystem paths (mount the bucket and give its path)")
        if self.storage_path is not None:
            # "~/runs" was a folder named "~" in the current directory.
            self.storage_path = os.path.expanduser(os.fspath(self.storage_path))
        for field, default in (("callbacks", None), ("stop", None), ("sync_config", None),
                               ("storage_filesystem", None), ("log_to_file", False)):
            value = getattr(self, field)
            if value is not default and not (field == "callbacks" and value == []):
                raise ConfigError(f"RunConfig({field}={value!r}): Ray Tune's option; troupe.train has no Tune, so "
                                  f"it takes {field} only at its default ({default!r})")
        _check(self.worker_runtime_env is None or isinstance(self.worker_runtime_env, dict),
               f"RunConfig.worker_runtime_env must be a dict or None, got {self.worker_runtime_env!r}")
        self.failure_config = self.failure_config or FailureConfig()
        self.checkpoint_config = self.checkpoint_config or CheckpointConfig()
