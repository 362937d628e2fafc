"""Ray's ray.util.collective on troupe's collective groups: actors (or tasks)
form a group, by init_collective_group in each member or by
create_collective_group in the driver, and run allreduce, broadcast,
allgather, reducescatter, reduce, barrier, send and recv on numpy arrays
and torch tensors (gloo: host memory; nccl: CUDA tensors).

Unlike Ray's, a group never hangs on a member that died: each member
watches the others through the head, and an operation waiting on a dead
or restarted member fails at once with CollectiveAbortedError naming it.
"""
import json
import threading

from troupe import _core
from troupe.exceptions import ConfigError
from troupe.util.collective.types import Backend, ReduceOp

__all__ = ["Backend", "ReduceOp", "allgather", "allreduce", "barrier", "broadcast", "create_collective_group",
           "destroy_collective_group", "get_collective_group_size", "get_rank", "init_collective_group",
           "is_group_initialized", "recv", "reduce", "reducescatter", "send"]

# Where groups meet in the head's KV store: "<prefix><name>/...".
_PREFIX = "troupe.collective/"
# An operation's own bound, after which it fails with a timeout (a member
# that died fails it at once): long, since ranks may reach a collective
# minutes apart (a slow data loader, a checkpoint).
_MIN_OP_TIMEOUT_MS = 300_000

_groups = {}  # group name -> _Member: the groups this process is in
_groups_lock = threading.Lock()


class _Member:
    """This process's place in one group; ops on it run one at a time (the
    runtime's groups take operations from one thread at a time)."""

    def __init__(self, handle, backend):
        self.handle, self.backend = handle, backend
        self.rank, self.world_size = handle.rank, handle.world_size
        self.lock = threading.Lock()


def _client():
    import troupe

    return troupe._client()


def _own_id():
    """The id of the actor (or task executor) this runs in; 0 in a driver."""
    return _core.actor_id() if _core.in_worker() else 0


def _check_name(group_name):
    if not isinstance(group_name, str) or not group_name:
        raise ConfigError(f"collective: group_name must be a non-empty string, got {group_name!r}")


def _backend(backend):
    value = str(backend).lower()
    if value not in (Backend.GLOO, Backend.NCCL):
        raise ConfigError(f"collective: backend must be 'gloo' or 'nccl', got {backend!r}")
    return value


def _timeout_ms(gloo_timeout):
    if isinstance(gloo_timeout, bool) or not isinstance(gloo_timeout, int) or gloo_timeout <= 0:
        raise ConfigError(f"collective: gloo_timeout must be a positive int of milliseconds, got {gloo_timeout!r}")
    return gloo_timeout


def _check_ranks(world_size, rank):
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"collective: world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigError(f"collective: rank must be an int in [0, {world_size - 1}], got {rank!r}")


def _join(name, key, generation, rank, world_size, members, backend, timeout_ms):
    with _groups_lock:
        if name in _groups:
            raise RuntimeError(f"collective group {name!r} is already initialized in this process")
    # A member outside any actor (a driver) cannot be watched: then no one is.
    watched = members if all(members) else []
    handle = _core.join_group(_client(), key, generation, rank, world_size, watched, backend, timeout_ms,
                              max(timeout_ms, _MIN_OP_TIMEOUT_MS))
    with _groups_lock:
        _groups[name] = _Member(handle, backend)


def init_collective_group(world_size, rank, backend=Backend.NCCL, group_name="default", gloo_timeout=30000):
    """Joins this process to group `group_name` as `rank` of `world_size`
    (as Ray's): blocks until every member has joined, at most
    `gloo_timeout` ms. Members that destroy the group and join again form
    a new one."""
    _check_ranks(world_size, rank)
    _check_name(group_name)
    backend = _backend(backend)
    timeout_ms = _timeout_ms(gloo_timeout)
    if is_group_initialized(group_name):
        raise RuntimeError(f"collective group {group_name!r} is already initialized in this process")
    client = _client()
    base = f"{_PREFIX}{group_name}"
    # The n-th join of rank r is in the n-th forming of the group.
    generation = client.kv_add(f"{base}/joins/rank{rank}", 1)
    client.kv_put(f"{base}/gen{generation}/member{rank}", str(_own_id()).encode())
    members = [int(client.kv_wait(f"{base}/gen{generation}/member{r}", timeout_ms)) for r in range(world_size)]
    _join(group_name, base, generation, rank, world_size, members, backend, timeout_ms)


def create_collective_group(actors, world_size, ranks, backend=Backend.NCCL, group_name="default",
                            gloo_timeout=30000):
    """Declares, from the driver, a group of `actors` (handles) with
    `ranks` (as Ray's): each actor joins it at its first collective call
    on `group_name`."""
    _check_name(group_name)
    backend = _backend(backend)
    timeout_ms = _timeout_ms(gloo_timeout)
    actors, ranks = list(actors), list(ranks)
    if not (len(actors) == len(ranks) == world_size):
        raise ConfigError(f"collective: {len(actors)} actors and {len(ranks)} ranks for world_size {world_size!r}")
    if sorted(ranks) != list(range(world_size)):
        raise ConfigError(f"collective: ranks must be 0..{world_size - 1}, each once, got {ranks!r}")
    client = _client()
    base = f"{_PREFIX}{group_name}/declared"
    generation = client.kv_add(f"{base}/generation", 1)
    members = {str(a._actor.id): r for a, r in zip(actors, ranks)}
    client.kv_put(base, json.dumps({"generation": generation, "world_size": world_size, "backend": backend,
                                    "timeout_ms": timeout_ms, "members": members}).encode())


def _declared(group_name):
    """This actor's place in a group the driver declared, joined now."""
    blob = _client().kv_get(f"{_PREFIX}{group_name}/declared")
    if blob is None:
        return None
    spec = json.loads(blob)
    rank = spec["members"].get(str(_own_id()))
    if rank is None:
        raise RuntimeError(f"collective group {group_name!r} was declared without this actor ({_own_id()})")
    by_rank = sorted(spec["members"].items(), key=lambda item: item[1])
    _join(group_name, f"{_PREFIX}{group_name}/declared", spec["generation"], rank, spec["world_size"],
          [int(actor) for actor, _ in by_rank], spec["backend"], spec["timeout_ms"])
    return _groups[group_name]


def _member(group_name):
    _check_name(group_name)
    with _groups_lock:
        member = _groups.get(group_name)
    if member is None and _core.in_worker():
        member = _declared(group_name)
    if member is None:
        raise RuntimeError(f"collective group {group_name!r} is not initialized in this process: call "
                           "init_collective_group in each member, or create_collective_group in the driver")
    return member


def is_group_initialized(group_name):
    with _groups_lock:
        return group_name in _groups


def get_rank(group_name="default"):
    """This member's rank in the group; -1 when not in it (as Ray's)."""
    with _groups_lock:
        member = _groups.get(group_name)
    return member.rank if member else -1


def get_collective_group_size(group_name="default"):
    """The group's world size; -1 when not in it (as Ray's)."""
    with _groups_lock:
        member = _groups.get(group_name)
    return member.world_size if member else -1


def destroy_collective_group(group_name="default"):
    """Leaves the group here; in the driver, also withdraws its
    create_collective_group declaration."""
    with _groups_lock:
        member = _groups.pop(group_name, None)
    if member is not None:
        with member.lock:
            member.handle.close()
    if not _core.in_worker():
        _client().kv_erase(f"{_PREFIX}{group_name}/declared")


# Element types by numpy and torch name.
_DTYPES = {"float32", "float64", "int32", "int64", "bfloat16", "float16", "uint8"}


def _is_torch(tensor):
    return type(tensor).__module__.split(".")[0] == "torch"


def _describe(tensor, member, what, written=True):
    """(address, element count, dtype name) of a tensor an operation
    reads or writes, checked against the group's backend."""
    if _is_torch(tensor):
        dtype = str(tensor.dtype).replace("torch.", "")
        device = tensor.device.type
        contiguous, writable = tensor.is_contiguous(), True
        address, count = tensor.data_ptr(), tensor.numel()
    elif hasattr(tensor, "__array_interface__") and hasattr(tensor, "flags"):
        dtype, device = tensor.dtype.name, "cpu"
        contiguous, writable = tensor.flags.c_contiguous, tensor.flags.writeable
        address, count = tensor.__array_interface__["data"][0], tensor.size
    else:
        raise TypeError(f"collective {what}: a {type(tensor).__name__} is neither a numpy array nor a torch tensor")
    if dtype not in _DTYPES:
        raise ConfigError(f"collective {what}: dtype {dtype} is not one a group moves ({', '.join(sorted(_DTYPES))})")
    if not contiguous:
        raise ConfigError(f"collective {what}: the {type(tensor).__name__} is not contiguous; pass a contiguous "
                          "copy (and copy the result back)")
    if written and not writable:
        raise ConfigError(f"collective {what}: the array is read-only (a value from troupe.get is); pass a copy")
    wanted = "cuda" if member.backend == Backend.NCCL else "cpu"
    if device != wanted:
        raise ConfigError(f"collective {what}: a {device} tensor in a {member.backend} group, which moves "
                          f"{'CUDA tensors' if wanted == 'cuda' else 'host memory (numpy arrays, CPU tensors)'}")
    return address, count, dtype


def _op(op):
    if isinstance(op, ReduceOp):
        return op.name
    if isinstance(op, str) and op.upper() in ReduceOp.__members__:
        return op.upper()
    raise ConfigError(f"collective: op must be a ReduceOp (SUM, PRODUCT, MIN, MAX), got {op!r}")


def _empty_like(tensor, leading):
    """A contiguous buffer of `leading` tensors shaped as `tensor`."""
    if _is_torch(tensor):
        import torch

        return torch.empty((leading,) + tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device)
    import numpy as np

    return np.empty((leading,) + tuple(tensor.shape), dtype=tensor.dtype)


def _copy_into(target, source):
    if _is_torch(target):
        target.copy_(source)
    else:
        target[...] = source


def _copy_of(tensor):
    return tensor.clone() if _is_torch(tensor) else tensor.copy()


def allreduce(tensor, group_name="default", op=ReduceOp.SUM):
    """In place: every member's `tensor` becomes the reduction of all."""
    member = _member(group_name)
    address, count, dtype = _describe(tensor, member, "allreduce")
    op = _op(op)
    with member.lock:
        member.handle.allreduce(address, count, dtype, op)


def reduce(tensor, dst_rank=0, group_name="default", op=ReduceOp.SUM):
    """`dst_rank`'s `tensor` becomes the reduction of all; the others' are
    left as they were."""
    member = _member(group_name)
    _describe(tensor, member, "reduce", written=False)
    if isinstance(dst_rank, bool) or not isinstance(dst_rank, int) or not 0 <= dst_rank < member.world_size:
        raise ConfigError(f"collective reduce: dst_rank must be in [0, {member.world_size - 1}], got {dst_rank!r}")
    result = _copy_of(tensor)
    allreduce(result, group_name, op)
    if member.rank == dst_rank:
        _copy_into(tensor, result)


def broadcast(tensor, src_rank=0, group_name="default"):
    """In place: every member's `tensor` becomes `src_rank`'s."""
    member = _member(group_name)
    address, count, dtype = _describe(tensor, member, "broadcast")
    with member.lock:
        member.handle.broadcast(address, count, dtype, src_rank)


def allgather(tensor_list, tensor, group_name="default"):
    """tensor_list[r] (one per member, shaped as `tensor`) becomes rank r's
    `tensor`."""
    member = _member(group_name)
    address, count, dtype = _describe(tensor, member, "allgather", written=False)
    if len(tensor_list) != member.world_size:
        raise ConfigError(f"collective allgather: tensor_list has {len(tensor_list)} tensors for "
                          f"{member.world_size} members")
    gathered = _empty_like(tensor, member.world_size)
    out, _, _ = _describe(gathered, member, "allgather")
    with member.lock:
        member.handle.allgather(address, out, count, dtype)
    for r, target in enumerate(tensor_list):
        _copy_into(target, gathered[r])


def reducescatter(tensor, tensor_list, group_name="default", op=ReduceOp.SUM):
    """`tensor` becomes the reduction over members of their
    tensor_list[this rank]."""
    member = _member(group_name)
    address, count, dtype = _describe(tensor, member, "reducescatter")
    if len(tensor_list) != member.world_size:
        raise ConfigError(f"collective reducescatter: tensor_list has {len(tensor_list)} tensors for "
                          f"{member.world_size} members")
    stacked = _empty_like(tensor, member.world_size)
    for r, source in enumerate(tensor_list):
        _copy_into(stacked[r], source)
    source, _, _ = _describe(stacked, member, "reducescatter")
    op = _op(op)
    with member.lock:
        member.handle.reduce_scatter(source, address, count, dtype, op)


def barrier(group_name="default"):
    member = _member(group_name)
    with member.lock:
        member.handle.barrier()


def send(tensor, dst_rank, group_name="default"):
    """Sends `tensor` to `dst_rank`, whose recv of the same shape takes it."""
    member = _member(group_name)
    address, count, dtype = _describe(tensor, member, "send", written=False)
    with member.lock:
        member.handle.send(address, count, dtype, dst_rank, 0)


def recv(tensor, src_rank, group_name="default"):
    """Fills `tensor` with what `src_rank` sends."""
    member = _member(group_name)
    address, count, dtype = _describe(tensor, member, "recv")
    with member.lock:
        member.handle.recv(address, count, dtype, src_rank, 0)
