"""Ray's ray.util.collective on troupe's collective groups: actors (or tasks)
form a group, by init_collective_group in each member or by
create_collective_group in the driver, and run allreduce, broadcast,
allgather, reducescatter, reduce, barrier, send and recv on numpy arrays
and torch tensors (gloo: host memory; nccl: CUDA tensors).

Unlike Ray's, a group does not wait for a timeout on a member that died: each member
watches the others through the head, and an operation waiting on a dead
or restarted member fails at once with CollectiveAbortedError naming it.
"""
import json
import threading
import time

from troupe import _core
from troupe.exceptions import ConfigError, GetTimeoutError
from troupe.util.collective.types import Backend, ReduceOp

__all__ = ["Backend", "ReduceOp", "allgather", "allreduce", "barrier", "broadcast", "create_collective_group",
           "destroy_collective_group", "get_collective_group_size", "get_rank", "gloo_available",
           "init_collective_group", "is_group_initialized", "nccl_available", "recv", "reduce", "reducescatter",
           "send"]

# Where groups meet in the head's KV store: "<prefix><job id>/<name>/...".
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


def gloo_available():
    """Whether gloo groups can be formed (always: troupe is built with it)."""
    return True


def nccl_available():
    """Whether nccl groups can be formed here: troupe built with NCCL, and
    a CUDA device that torch sees."""
    if not _core.HAS_NCCL:
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _client():
    import troupe

    return troupe._client()


def _own_id():
    """The id of the actor (or task executor) this runs in; 0 in a driver."""
    return _core.actor_id() if _core.in_worker() else 0


def _base(group_name):
    """The KV prefix of a group's keys: its namespace's, as Ray's groups
    live in a namespace, or, where none is set (each job alone in Ray's
    anonymous one), the job's: two jobs using one name at once (a sweep's
    runs, each with "default") never pair each other's ranks or withdraw
    each other's declarations, while drivers of one namespace (a detached
    actor's and a later job's) meet. An actor has the namespace and job of
    the driver that made it."""
    import troupe

    context = troupe.get_runtime_context()
    scope = f"ns:{context.namespace}" if context.namespace else f"job:{context.get_job_id()}"
    return f"{_PREFIX}{scope}/{group_name}"


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


def _left_ms(deadline):
    return max(1, int((deadline - time.monotonic()) * 1000))


def _leader_alive(client, leader):
    """Whether the rank 0 that announced `leader` still runs, as it was then."""
    if not leader["actor"]:
        return True  # a driver: nothing to ask
    try:
        info = client.actor_info(leader["actor"])
    except Exception:  # noqa: BLE001 - an actor the head no longer knows is gone
        return False
    # PENDING: still in its constructor (a group formed in __init__).
    return info["state"] in ("ALIVE", "PENDING") and info["restarts"] == leader["restarts"]


def _follow(client, base, group_name, world_size, rank, deadline):
    """A rank other than 0: the generation of the forming rank 0 announced
    last, once that announcement is this rank's to join (its rank 0 runs,
    as it was then, with this world size, and no process took this rank in
    it yet, nor did rank 0 give it up: else it is one from before, and this
    waits for the next)."""
    while True:
        blob = client.kv_get(f"{base}/leader")
        generation = 0
        if blob is not None:
            leader = json.loads(blob)
            generation = leader["generation"]
            if (leader["world_size"] == world_size and client.kv_get(f"{base}/gen{generation}/member{rank}") is None
                    and client.kv_get(f"{base}/gen{generation}/abandoned") is None and _leader_alive(client, leader)):
                client.kv_put(f"{base}/gen{generation}/member{rank}", str(_own_id()).encode())
                return generation
        # The next announcement: rank 0's key of the next forming.
        try:
            client.kv_wait(f"{base}/gen{generation + 1}/member0", _left_ms(deadline))
        except GetTimeoutError:
            raise GetTimeoutError(f"collective group {group_name!r}: rank 0 did not start a forming that rank {rank} "
                                  f"of {world_size} could join within the timeout") from None


def _form(group_name, world_size, rank, backend, timeout_ms):
    """Forms the group: rank 0 starts a forming (a new generation, which
    it announces), the other ranks join the one it announced last, each
    publishing its actor id, so that every member watches the others."""
    client = _client()
    base = _base(group_name)
    deadline = time.monotonic() + timeout_ms / 1000
    if rank == 0:
        generation = client.kv_add(f"{base}/generation", 1)
        me = _own_id()
        restarts = client.actor_info(me)["restarts"] if me else 0
        client.kv_put(f"{base}/gen{generation}/member0", str(me).encode())
        client.kv_put(f"{base}/leader", json.dumps({"generation": generation, "world_size": world_size, "actor": me,
                                                    "restarts": restarts}).encode())
        # The forming before this one is given up (a rank that read the
        # announcement of it just now waits for this one), and its keys go;
        # the mark of the one before it too.
        client.kv_put(f"{base}/gen{generation - 1}/abandoned", b"1")
        for r in range(world_size):
            client.kv_erase(f"{base}/gen{generation - 1}/member{r}")
        client.kv_erase(f"{base}/gen{generation - 2}/abandoned")
    else:
        generation = _follow(client, base, group_name, world_size, rank, deadline)
    members = []
    for r in range(world_size):
        try:
            members.append(int(client.kv_wait(f"{base}/gen{generation}/member{r}", _left_ms(deadline))))
        except GetTimeoutError:
            if rank == 0:  # no one joins it any more: a rank that comes late waits for rank 0's next
                client.kv_put(f"{base}/gen{generation}/abandoned", b"1")
            missing = [k for k in range(world_size) if client.kv_get(f"{base}/gen{generation}/member{k}") is None]
            raise GetTimeoutError(f"collective group {group_name!r} (generation {generation}): rank(s) "
                                  f"{', '.join(map(str, missing))} of {world_size} did not join within "
                                  f"{timeout_ms} ms") from None
    _join(group_name, base, generation, rank, world_size, members, backend, _left_ms(deadline))


def init_collective_group(world_size, rank, backend=Backend.NCCL, group_name="default", gloo_timeout=30000):
    """Joins this process to group `group_name` as `rank` of `world_size`
    (as Ray's): blocks until every member has joined, at most
    `gloo_timeout` ms. Each forming is rank 0's: members that destroy the
    group and join again, or that join after a forming timed out or after
    another job used the name, form a new one with whatever rank 0 starts."""
    _check_ranks(world_size, rank)
    _check_name(group_name)
    backend = _backend(backend)
    timeout_ms = _timeout_ms(gloo_timeout)
    if is_group_initialized(group_name):
        raise RuntimeError(f"collective group {group_name!r} is already initialized in this process")
    _form(group_name, world_size, rank, backend, timeout_ms)


def create_collective_group(actors, world_size, ranks, backend=Backend.NCCL, group_name="default",
                            gloo_timeout=30000):
    """Declares, from the driver, a group of `actors` (handles) with
    `ranks` (as Ray's): each actor joins it at its first collective call
    on `group_name` (and again, after it destroyed it, at the next)."""
    _check_name(group_name)
    backend = _backend(backend)
    timeout_ms = _timeout_ms(gloo_timeout)
    actors, ranks = list(actors), list(ranks)
    if not (len(actors) == len(ranks) == world_size):
        raise ConfigError(f"collective: {len(actors)} actors and {len(ranks)} ranks for world_size {world_size!r}")
    if sorted(ranks) != list(range(world_size)):
        raise ConfigError(f"collective: ranks must be 0..{world_size - 1}, each once, got {ranks!r}")
    members = {str(a._actor.id): r for a, r in zip(actors, ranks)}
    _client().kv_put(f"{_base(group_name)}/declared", json.dumps({
        "world_size": world_size, "backend": backend, "timeout_ms": timeout_ms, "members": members}).encode())


def _declared(group_name):
    """This actor's place in a group the driver declared, joined now."""
    blob = _client().kv_get(f"{_base(group_name)}/declared")
    if blob is None:
        return None
    spec = json.loads(blob)
    rank = spec["members"].get(str(_own_id()))
    if rank is None:
        raise RuntimeError(f"collective group {group_name!r} was declared without this actor ({_own_id()})")
    _form(group_name, spec["world_size"], rank, spec["backend"], spec["timeout_ms"])
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
        if not member.lock.acquire(blocking=False):
            # Another thread of this member waits in an operation (a peer
            # that does not come): it fails now rather than at its timeout.
            member.handle.abort(f"collective group {group_name!r} was destroyed by this member")
            member.lock.acquire()
        try:
            member.handle.close()
        finally:
            member.lock.release()
    if not _core.in_worker():
        _client().kv_erase(f"{_base(group_name)}/declared")


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
    if isinstance(dst_rank, bool) or not isinstance(dst_rank, int) or not 0 <= dst_rank < member.world_size:
        raise ConfigError(f"collective reduce: dst_rank must be in [0, {member.world_size - 1}], got {dst_rank!r}")
    # Only the destination's is written (a read-only one there was numpy's
    # ValueError after both exchanges).
    _describe(tensor, member, "reduce", written=member.rank == dst_rank)
    # A reduce is an allreduce kept at one rank, so the agreement check sees
    # no root: the members first agree on it (one more small exchange, in
    # the memory the group moves: an NCCL group refuses host arrays;
    # members naming different roots each kept the whole sum).
    if member.backend == Backend.NCCL:
        import torch

        roots = torch.tensor([dst_rank, -dst_rank], dtype=torch.int64, device=tensor.device)
    else:
        import numpy as np

        roots = np.array([dst_rank, -dst_rank], dtype=np.int64)
    allreduce(roots, group_name, ReduceOp.MAX)
    highest, lowest = int(roots[0]), -int(roots[1])
    if highest != lowest:
        raise ConfigError(f"collective reduce: the members passed different dst_rank (from {lowest} to "
                          f"{highest}; this one {dst_rank}), so none reduced")
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
    # Checked after the exchange, so that the other members are not left
    # waiting for this one: a list entry that cannot take a member's tensor
    # is named, and none is written.
    for r, target in enumerate(tensor_list):
        if tuple(getattr(target, "shape", ())) != tuple(tensor.shape):
            raise ConfigError(f"collective allgather: tensor_list[{r}] has shape {tuple(getattr(target, 'shape', ()))}"
                              f", not the tensor's {tuple(tensor.shape)}")
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
    for r, entry in enumerate(tensor_list):
        # Checked before anything moves (an entry of another shape was
        # broadcast into its slot: a sum no member held, and no error).
        shape = tuple(getattr(entry, "shape", ()))
        if shape != tuple(tensor.shape) or _is_torch(entry) != _is_torch(tensor) or entry.dtype != tensor.dtype:
            raise ConfigError(f"collective reducescatter: tensor_list[{r}] is a {type(entry).__name__} of shape "
                              f"{shape} and dtype {getattr(entry, 'dtype', None)}, not as the tensor's "
                              f"({type(tensor).__name__}, {tuple(tensor.shape)}, {tensor.dtype})")
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
