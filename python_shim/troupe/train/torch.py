"""troupe.train.torch: Ray Train's ray.train.torch, for the loop's model and
data. `prepare_model` moves the model to this worker's device and wraps it
in DistributedDataParallel; `prepare_data_loader` gives each rank its shard
(DistributedSampler) and moves batches to the device. The sampler's epoch is
handled: each new pass over the loader advances it, unless the loop set it
itself (`loader.sampler.set_epoch(epoch)`, as torchrun scripts do), which
wins. A checkpoint's report records each loader's epoch, and a run resumed
from it goes on from there: its next pass shuffles as the uninterrupted
run's did (a report made during a pass resumes that pass's epoch).
"""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from . import session
from .trainer import TorchTrainer

__all__ = ["TorchTrainer", "prepare_model", "prepare_data_loader", "get_device"]


def get_device():
    """This worker's device: its GPU with use_gpu, else the CPU."""
    if session.use_gpu() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _world_size():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def prepare_model(model, move_to_device=True, parallel_strategy="ddp", parallel_strategy_kwargs=None):
    if parallel_strategy not in ("ddp", None):
        raise ValueError(f"prepare_model: parallel_strategy must be 'ddp' or None, got {parallel_strategy!r}")
    device = get_device()
    if move_to_device:
        model = model.to(device)
    if parallel_strategy == "ddp" and _world_size() > 1:
        kwargs = dict(parallel_strategy_kwargs or {})
        if device.type == "cuda":
            kwargs.setdefault("device_ids", [device])
        model = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
    return model


def _sharded(loader):
    """The same loader over a DistributedSampler shard of its dataset."""
    shuffle = isinstance(loader.sampler, RandomSampler)
    sampler = DistributedSampler(loader.dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                                 shuffle=shuffle)
    kwargs = dict(batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
                  collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
                  timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                  persistent_workers=loader.persistent_workers)
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, **kwargs)


def prepare_data_loader(data_loader, add_dist_sampler=True, move_to_device=True):
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"prepare_data_loader: expected a torch DataLoader, got {type(data_loader).__name__}")
    shardable = (add_dist_sampler and _world_size() > 1 and not isinstance(data_loader.dataset, IterableDataset)
                 and not isinstance(data_loader.sampler, DistributedSampler) and data_loader.batch_size is not None)
    if shardable:
        data_loader = _sharded(data_loader)
    return _EpochLoader(data_loader, get_device() if move_to_device else None)


def _to(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


class _EpochLoader:
    """A DataLoader that advances its DistributedSampler's epoch per pass
    and moves batches to the device; everything else is the loader's."""

    def __init__(self, loader, device):
        self._loader = loader
        self._device = device
        self._passes = 0
        self._last_epoch = None
        self._in_pass = False
        s = session._session
        resumed = s.add_loader(self) if s is not None else None
        if isinstance(loader.sampler, DistributedSampler) and isinstance(resumed, int):
            loader.sampler.set_epoch(resumed)

    def _resume_epoch(self):
        """The epoch a run resumed from a checkpoint reported now starts
        this loader at: the current pass's, else the next pass's."""
        sampler = self._loader.sampler
        if not isinstance(sampler, DistributedSampler):
            return None
        if self._in_pass or self._passes == 0 or sampler.epoch != self._last_epoch:
            return sampler.epoch  # mid-pass, never passed, or set by the loop for its next pass
        return sampler.epoch + 1

    def __iter__(self):
        sampler = self._loader.sampler
        if isinstance(sampler, DistributedSampler):
            if self._passes > 0 and sampler.epoch == self._last_epoch:
                sampler.set_epoch(sampler.epoch + 1)
            self._last_epoch = sampler.epoch
        self._passes += 1
        self._in_pass = True
        try:
            for batch in self._loader:
                yield batch if self._device is None or self._device.type == "cpu" else _to(batch, self._device)
        finally:
            self._in_pass = False

    def __len__(self):
        return len(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)
