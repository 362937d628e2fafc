"""troupe.train.torch: Ray Train's ray.train.torch, for the loop's model and
data. `prepare_model` moves the model to this worker's device and wraps it
in DistributedDataParallel; `prepare_data_loader` gives each rank its shard
(DistributedSampler) and moves batches to the device. The sampler's epoch is
handled: each new pass over the loader advances it, until the loop sets it
itself (`loader.sampler.set_epoch(epoch)`, as torchrun scripts do): from
then on the loop's epochs are obeyed and never advanced, however often it
passes over the loader. A checkpoint's report records each loader's epoch,
and a run resumed from it goes on from there: its next pass shuffles as the
uninterrupted run's did (a report made during a pass resumes that pass's
epoch).
"""

import os
import random

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, SequentialSampler

from . import session
from .config import TorchConfig
from .trainer import TorchTrainer

__all__ = ["TorchTrainer", "TorchConfig", "prepare_model", "prepare_data_loader", "prepare_optimizer", "backward",
           "enable_reproducibility", "get_device", "get_devices"]


def get_device():
    """This worker's device: its GPU with use_gpu, else the CPU."""
    if session.use_gpu() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_devices():
    """This worker's devices (Ray's): a worker holds one, get_device()'s."""
    return [get_device()]


def prepare_optimizer(optimizer):
    """Ray's, which returns the optimizer as it is without mixed precision
    (troupe has none to prepare)."""
    return optimizer


def backward(tensor):
    """Ray's: tensor.backward() (no mixed-precision scaling here)."""
    tensor.backward()


def enable_reproducibility(seed=0):
    """As Ray's: seeds torch, random and NumPy, and makes torch choose
    deterministic algorithms (an operation without one raises). Data
    loaders' workers and GPU nondeterminism beyond that are the loop's."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    # cuBLAS is deterministic only with this workspace setting (CUDA >= 10.2).
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"


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
    # As Ray: every sampler but a sequential one shuffled (random, weighted,
    # a random subset), since a DistributedSampler replaces it.
    shuffle = not isinstance(loader.sampler, SequentialSampler)
    sampler = DistributedSampler(loader.dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                                 shuffle=shuffle)
    kwargs = dict(batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
                  collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
                  timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                  persistent_workers=loader.persistent_workers, generator=loader.generator,
                  multiprocessing_context=loader.multiprocessing_context)
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, **kwargs)


def prepare_data_loader(data_loader, add_dist_sampler=True, move_to_device=True):
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"prepare_data_loader: expected a torch DataLoader, got {type(data_loader).__name__}")
    if isinstance(data_loader, _EpochLoader):
        return data_loader  # prepared already
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


def _watch_set_epoch(sampler):
    """Makes the sampler's set_epoch note that the loop called it; returns
    the note ({"loop_sets_epoch": bool}). troupe's own calls go to the
    class's method, past the note."""
    note = getattr(sampler.set_epoch, "_troupe_note", None)
    if note is not None:
        return note  # the sampler of another prepared loader
    note = {"loop_sets_epoch": False}
    original = sampler.set_epoch

    def set_epoch(epoch):
        note["loop_sets_epoch"] = True
        original(epoch)

    set_epoch._troupe_note = note
    sampler.set_epoch = set_epoch
    return note


class _EpochLoader(DataLoader):
    """A DataLoader that advances its DistributedSampler's epoch per pass
    (until the loop sets epochs itself) and moves batches to the device;
    everything else is the wrapped loader's. It is a DataLoader, for code
    that checks (Lightning and the like), but is not built as one:
    DataLoader.__init__ is never called, and every attribute it lacks
    (dataset, sampler, batch_size, ...) is read from the wrapped loader, so
    DataLoader's own methods, called on it, see the wrapped loader's."""

    def __init__(self, loader, device):
        self._loader = loader
        self._device = device
        self._passes = 0
        self._last_epoch = None
        self._in_pass = False
        self._note = None
        s = session._session
        resumed = s.add_loader(self) if s is not None else None
        if isinstance(loader.sampler, DistributedSampler):
            self._note = _watch_set_epoch(loader.sampler)
            if isinstance(resumed, int):
                type(loader.sampler).set_epoch(loader.sampler, resumed)

    def _loop_sets_epoch(self):
        return self._note is not None and self._note["loop_sets_epoch"]

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
            # A loop that sets epochs itself may pass over the loader more
            # than once an epoch (training, then evaluation; a peek at one
            # batch): its epoch stays.
            if self._passes > 0 and sampler.epoch == self._last_epoch and not self._loop_sets_epoch():
                type(sampler).set_epoch(sampler, sampler.epoch + 1)
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
        if name == "_loader":  # not set yet (a copy being made): no loader to ask
            raise AttributeError(name)
        return getattr(self._loader, name)
