"""Ray's ray.util.collective.types: the backends and reduce ops."""
import enum


class Backend(str):
    """A collective group's transport, a string as Ray's: Backend("gloo")
    (host memory: numpy arrays and CPU tensors, over TCP) or
    Backend("nccl") (CUDA tensors); Backend.GLOO, Backend.NCCL."""

    GLOO = "gloo"
    NCCL = "nccl"

    def __new__(cls, name):
        value = str(name).lower()
        if value not in (cls.GLOO, cls.NCCL):
            raise ValueError(f"collective backend must be 'gloo' or 'nccl', got {name!r}")
        return super().__new__(cls, value)


class ReduceOp(enum.Enum):
    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
