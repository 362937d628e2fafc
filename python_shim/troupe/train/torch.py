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

What it shards: a map-style dataset's loader built with `batch_size` (any
sampler; it is replaced), or with `batch_sampler=` a torch `BatchSampler`
(replaced by a BatchSampler of the same batch_size and drop_last over the
rank's DistributedSampler). A custom batch sampler cannot be sharded from
outside: prepare_data_loader raises ConfigError (shard it by rank in the
sampler and pass add_dist_sampler=False). An IterableDataset's loader is
not sharded either (each rank reads the whole stream unless the dataset
splits it by rank itself): a warning says so, once per worker process.
"""

import collections.abc
import os
import random
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler

from ..exceptions import ConfigError
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


def _distributed_sampler(loader):
    """The loader's DistributedSampler: its sampler, or the sampler of its
    torch BatchSampler; else None."""
    if isinstance(loader.sampler, DistributedSampler):
        return loader.sampler
    batches = loader.batch_sampler
    if isinstance(batches, BatchSampler) and isinstance(getattr(batches, "sampler", None), DistributedSampler):
        return batches.sampler
    return None


def _custom_batch_sampler(loader):
    """True when the loader was built with a batch_sampler= that is not a
    plain torch BatchSampler (with batch_size=, DataLoader makes one)."""
    batches = loader.batch_sampler
    return loader.batch_size is None and batches is not None and type(batches) is not BatchSampler


def _sharded(loader):
    """The same loader over a DistributedSampler shard of its dataset."""
    # As Ray: every sampler but a sequential one shuffled (random, weighted,
    # a random subset), since a DistributedSampler replaces it. A loader
    # built with batch_sampler=BatchSampler(sampler, n, drop_last) keeps its
    # batch size and drop_last, over the shard of its sampler.
    by_batch_sampler = loader.batch_size is None and loader.batch_sampler is not None
    given = loader.batch_sampler.sampler if by_batch_sampler else loader.sampler
    shuffle = not isinstance(given, SequentialSampler)
    sampler = DistributedSampler(loader.dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                                 shuffle=shuffle)
    kwargs = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                  timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                  persistent_workers=loader.persistent_workers, generator=loader.generator,
                  multiprocessing_context=loader.multiprocessing_context)
    if by_batch_sampler:
        kwargs["batch_sampler"] = BatchSampler(sampler, loader.batch_sampler.batch_size,
                                               loader.batch_sampler.drop_last)
    else:  # batch_size=None too: no automatic batching, one sample at a time
        kwargs.update(batch_size=loader.batch_size, sampler=sampler, drop_last=loader.drop_last)
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, **kwargs)


_warned_iterable = False


def _warn_iterable_once():
    global _warned_iterable
    if _warned_iterable:
        return
    _warned_iterable = True
    warnings.warn("prepare_data_loader: the loader's dataset is an IterableDataset, which a DistributedSampler "
                  "cannot shard: every rank reads the whole stream. Split it by rank in the dataset's __iter__ "
                  "(troupe.train.get_context().get_world_rank() and get_world_size()) so that each sample is "
                  "trained once per epoch. (Said once per worker.)", UserWarning, stacklevel=3)


def prepare_data_loader(data_loader, add_dist_sampler=True, move_to_device=True):
    """Ray's: with more than one worker (and add_dist_sampler), the loader
    over this rank's DistributedSampler shard; batches moved to the device
    (move_to_device). See the module's text for what is sharded: a custom
    batch_sampler raises ConfigError, an IterableDataset warns once."""
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"prepare_data_loader: expected a torch DataLoader, got {type(data_loader).__name__}")
    if isinstance(data_loader, _EpochLoader):
        return data_loader  # prepared already
    if add_dist_sampler and _world_size() > 1 and _distributed_sampler(data_loader) is None:
        if isinstance(data_loader.dataset, IterableDataset):
            _warn_iterable_once()
        elif _custom_batch_sampler(data_loader):
            raise ConfigError(
                f"prepare_data_loader: the DataLoader's batch_sampler is a {type(data_loader.batch_sampler).__name__}"
                f", not a torch BatchSampler, so it cannot be sharded across the {_world_size()} workers (each "
                "would train every sample). Give its batches to this rank alone (get_context().get_world_rank() "
                "of get_world_size(), or a DistributedSampler inside it) and call prepare_data_loader(loader, "
                "add_dist_sampler=False); or build the loader with batch_size= or "
                "batch_sampler=torch.utils.data.BatchSampler(...).")
        else:
            data_loader = _sharded(data_loader)
    return _EpochLoader(data_loader, get_device() if move_to_device else None)


def _to(batch, device):
    """The batch with its tensors on `device`, in containers of the same
    types: a namedtuple (torch's collate keeps them; one of two fields
    raised TypeError) and any mapping (a tokenizer's BatchEncoding is a
    UserDict, whose tensors stayed on the CPU) included."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_to(b, device) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, collections.abc.Mapping):
        moved = {k: _to(v, device) for k, v in batch.items()}
        if type(batch) is dict:
            return moved
        try:
            return type(batch)(moved)
        except Exception:  # noqa: BLE001 - a mapping that cannot be built from a dict goes as one
            return moved
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
        sampler = _distributed_sampler(loader)
        if sampler is not None:
            self._note = _watch_set_epoch(sampler)
            if isinstance(resumed, int):
                type(sampler).set_epoch(sampler, resumed)

    def _loop_sets_epoch(self):
        return self._note is not None and self._note["loop_sets_epoch"]

    def _resume_epoch(self):
        """The epoch a run resumed from a checkpoint reported now starts
        this loader at: the current pass's, else the next pass's."""
        sampler = _distributed_sampler(self._loader)
        if sampler is None:
            return None
        if self._in_pass or self._passes == 0 or sampler.epoch != self._last_epoch:
            return sampler.epoch  # mid-pass, never passed, or set by the loop for its next pass
        return sampler.epoch + 1

    def __iter__(self):
        sampler = _distributed_sampler(self._loader)
        if sampler is not None:
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
