"""TrainWorker: the actor that runs the training loop on one rank. The
driver (trainer.py) makes it a remote actor of whichever runtime module it
was given (troupe, or ray in the tests that check the code against Ray) and
calls, in order: `node_info` (where it landed, to order ranks by node),
`free_port` (rank 0 only: MASTER_PORT), then `run`, which sets the torchrun
environment, initialises torch.distributed (gloo on CPU, nccl on GPU),
runs the loop and tears the process group down.
"""

import datetime
import importlib
import inspect
import os
import socket

from .. import _console
from . import session
from .checkpoint import Checkpoint, CheckpointStore

# The process group's timeout without a TorchConfig: torch's own for gloo
# and Ray's TorchConfig default. It bounds every collective on the group,
# not only its setup (300 s failed a loop whose rank 0 alone evaluated or
# saved for over five minutes before a barrier or a report). A peer that
# dies is caught by the driver sooner, which sees the death and restarts
# the group.
PROCESS_GROUP_TIMEOUT_S = 1800


def _node_ip(rt):
    """The address the node's other hosts reach it at: the runtime's
    get_node_ip_address (troupe's and Ray's: the node's address as the head
    has it). The host name often resolves to 127.0.1.1, which rank 0's
    peers on other hosts could not reach."""
    return importlib.import_module(rt.__name__ + ".util").get_node_ip_address()


def _native():
    """troupe's native module; None where the package runs from its source
    folder alone (the tests that run TorchTrainer on Ray's actors)."""
    try:
        from .. import _core
    except ImportError:
        return None
    return _core


def _socket_interfaces(ip):
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME naming the interface that
    carries `ip`, for those the environment does not set (as `troupe
    torchrun` does): gloo and NCCL pick theirs from the host name, which
    often resolves to loopback, and a rank would tell its peers on other
    hosts an address they cannot reach."""
    core = _native()
    if core is None or not ip or ip.startswith("127.") or ip == "::1":
        return {}
    ifname = core.interface_of(ip)
    if not ifname:
        return {}
    return {var: ifname for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if not os.environ.get(var)}


def _node_id(rt):
    ctx = rt.get_runtime_context()
    for name in ("get_node_id", "node_id"):
        value = getattr(ctx, name, None)
        if value is not None:
            return str(value() if callable(value) else value)
    return socket.gethostname()


def call_loop(fn, config):
    """Ray's convention: a loop with one parameter gets the config."""
    try:
        takes_config = len(inspect.signature(fn).parameters) >= 1
    except (TypeError, ValueError):
        takes_config = True
    if takes_config:
        return fn(config if config is not None else {})
    return fn()


class TrainWorker:
    def __init__(self, runtime_name):
        self._rt = importlib.import_module(runtime_name)
        # The GPUs the runtime gave this worker (run() widens the variable
        # to the node's, as torchrun's ranks see them).
        self._own_gpus = os.environ.get("CUDA_VISIBLE_DEVICES")

    def node_info(self):
        return {"node_id": _node_id(self._rt), "ip": _node_ip(self._rt), "pid": os.getpid(),
                "gpus": self._own_gpus}

    def free_port(self):
        """MASTER_PORT: a port free now, outside the kernel's ephemeral
        range where one is (any outgoing connect could take one from inside
        it before rank 0's store binds it)."""
        core = _native()
        if core is not None:
            return core.free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the package's source alone (tests on Ray)
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, spec, fn, config):
        """Runs the loop as rank spec['context'].world_rank; returns how many
        reports it made."""
        import torch
        import torch.distributed as dist

        ctx = session.TrainContext(**spec["context"])
        _console.mark_output(f"TrainWorker rank={ctx.world_rank}")
        from .config import CheckpointConfig

        store = CheckpointStore(ctx.trial_dir, CheckpointConfig(**spec["checkpoint_config"]))
        if spec.get("storage_marker"):
            # Every rank, before the group forms, as Ray's check does: the
            # others stage their checkpoints in the run folder and read the
            # checkpoint a restart hands them from it (a rank 1 that could
            # not see it failed every restart with FileNotFoundError).
            store.check_shared(spec["storage_marker"], ctx.world_rank)
        os.environ.update(session.local_env(ctx, spec["master_addr"], spec["master_port"]))
        os.environ.update(_socket_interfaces(self.node_info()["ip"]))
        # Before CUDA starts (it reads the variable once): the node's GPUs,
        # so that cuda:LOCAL_RANK is this rank's own as under torchrun.
        visible = node_visible_gpus(spec.get("node_gpus"), self._own_gpus) if spec["use_gpu"] else None
        if visible:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible[0]
        use_gpu = spec["use_gpu"] and torch.cuda.is_available()
        if use_gpu:
            torch.cuda.set_device(visible[1] if visible else _device_index(ctx))
        # TorchConfig's backend and timeout when the trainer was given one.
        backend = spec.get("backend") or ("nccl" if use_gpu else "gloo")
        # An IPv6 address goes in brackets in the URL (MASTER_ADDR keeps it
        # bare, as torchrun sets it).
        host = spec["master_addr"]
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{spec['master_port']}",
            rank=ctx.world_rank, world_size=ctx.world_size,
            timeout=datetime.timedelta(seconds=spec.get("timeout_s") or PROCESS_GROUP_TIMEOUT_S))
        checkpoint = Checkpoint(spec["checkpoint"]) if spec["checkpoint"] else None
        # report()'s exchanges go over gloo: cheap, and a peer that left is
        # seen at once, where NCCL would wait out its timeout.
        control = dist.new_group(backend="gloo") if backend != "gloo" else None
        session.REPORT_WAIT_WARNING_S = spec.get("report_wait_warning_s", session.REPORT_WAIT_WARNING_S)
        session.start(session._Session(ctx, store, checkpoint, use_gpu, control_group=control))
        try:
            call_loop(fn, config)
            return session._session.reports
        except (RuntimeError, ValueError) as e:  # torch 1.x raises the one, 2.x the other
            if "default process group twice" not in str(e):
                raise
            raise type(e)(f"{e} (TorchTrainer sets up the process group before train_loop_per_worker runs "
                               "and ends it after: remove the loop's own dist.init_process_group call)") from e
        finally:
            session.end()
            _console.end_lines()  # a last line printed without its end
            # A loop written for torchrun may have ended it itself.
            if dist.is_initialized():
                dist.destroy_process_group()


def node_visible_gpus(node_gpus, own):
    """(CUDA_VISIBLE_DEVICES, device index) for a worker, as torchrun and
    Ray Train give them: every GPU of its node's workers in local-rank order
    (once each: workers holding parts of one GPU share it), and where this
    worker's first GPU is among them. None when it holds none of them."""
    own = [g for g in (own or "").split(",") if g]
    if not own or not node_gpus or own[0] not in node_gpus:
        return None
    return ",".join(node_gpus), node_gpus.index(own[0])


def node_gpu_lists(infos):
    """By node id: the GPUs of its workers (`infos` in rank order), each
    once, in local-rank order; a node with a worker that names none is
    left out (its workers keep their own)."""
    out, bare = {}, set()
    for info in infos:
        gpus = [g for g in (info.get("gpus") or "").split(",") if g]
        if not gpus:
            bare.add(info["node_id"])
        listed = out.setdefault(info["node_id"], [])
        listed.extend(g for g in gpus if g not in listed)
    return {node: gpus for node, gpus in out.items() if node not in bare}


def _device_index(ctx):
    import torch

    # With CUDA_VISIBLE_DEVICES set to this worker's GPUs, its first is 0.
    n = torch.cuda.device_count()
    return 0 if n <= 1 else ctx.local_rank % n
