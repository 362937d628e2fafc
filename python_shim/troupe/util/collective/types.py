"""Ray's ray.util.collective.types: the backends and reduce ops."""
import enum


class Backend:
    """A collective group's transport: gloo (host memory, numpy arrays and
    CPU tensors, over TCP) or nccl (CUDA tensors)."""

    GLOO = "gloo"
    NCCL = "nccl"


class ReduceOp(enum.Enum):
    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
