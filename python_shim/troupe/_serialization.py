"""How Python values become troupe values: (data, buffers, refs).

``data`` is a pickle (protocol 5); ``buffers`` are the out-of-band buffers
pickle hands over (NumPy arrays, torch tensors: frame attachments, not copied
into the message); ``refs`` are the ObjectRefs found inside the value, which
cross as refs (each pickled as its index in that list). Plain data goes
through the C pickler; anything else (lambdas, classes of __main__) through
cloudpickle.
"""
import pickle
import sys
import threading

import cloudpickle

from troupe import _core
from troupe.exceptions import _ErrorBox

ObjectRef = _core.ObjectRef
_tls = threading.local()
_SIMPLE = frozenset((int, float, str, bytes, bool, type(None)))
# A message takes at most 4096 attachments (wire::FrameLimits), and a call's
# frame may carry several values: a value with more out-of-band buffers
# than this is pickled in band (one buffer) instead.
MAX_OUT_OF_BAND = 1024
EMPTY = ()


def _is_plain(value):
    t = type(value)
    if t in _SIMPLE:
        return True
    if t is tuple or t is list:
        return all(type(x) in _SIMPLE for x in value)
    if t is dict:
        return all(type(k) in _SIMPLE and type(v) in _SIMPLE for k, v in value.items())
    return False


def _reduce_ref(ref):
    refs = getattr(_tls, "refs", None)
    if refs is None:
        raise TypeError("a troupe ObjectRef can only be pickled by troupe (pass it to .remote() or troupe.put)")
    refs.append(ref)
    return _load_ref, (len(refs) - 1,)


def pickling_refs():
    """Whether troupe is pickling a value now (ObjectRefs inside it cross as refs)."""
    return getattr(_tls, "refs", None) is not None


def _load_ref(index):
    return _tls.loaded[index]


ObjectRef.__reduce__ = _reduce_ref


def _reduce_tensor(t):
    # A CPU copy of the tensor's bytes, out of band; dtype and shape beside.
    import torch

    flat = t.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    return _load_tensor, (pickle.PickleBuffer(raw.numpy()), t.dtype, tuple(t.shape), t.requires_grad)


def _load_tensor(buffer, dtype, shape, requires_grad):
    import warnings

    import torch

    if len(memoryview(buffer)) == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        # The tensor views the received attachment (no copy); torch warns
        # that the buffer is read-only, which only means troupe's.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)
    return t.requires_grad_(requires_grad) if requires_grad else t


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle, with torch tensors as out-of-band buffers."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor:
            return _reduce_tensor(obj)
        return super().reducer_override(obj)


def dumps(value):
    """value -> (data, buffers, refs)."""
    buffers = []
    refs = []
    _tls.refs = refs
    try:
        if _is_plain(value):
            data = pickle.dumps(value, 5)
        else:
            import io

            out = io.BytesIO()
            _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(value)
            if len(buffers) > MAX_OUT_OF_BAND:
                buffers.clear()
                refs.clear()
                out = io.BytesIO()
                _Pickler(out, protocol=5).dump(value)
            data = out.getbuffer()
    finally:
        _tls.refs = None
    return data, buffers, refs


def loads(parts):
    """(data, buffers, refs) -> value."""
    data, buffers, refs = parts
    previous = getattr(_tls, "loaded", None)
    _tls.loaded = refs
    try:
        return pickle.loads(data, buffers=buffers)
    finally:
        _tls.loaded = previous


def value_of(parts):
    """A value that may be a failed call's answer, which raises here."""
    value = loads(parts)
    if type(value) is _ErrorBox:
        raise value.exception()
    return value


class _Top:
    """Stands for a top-level ObjectRef argument, resolved before the call."""

    __slots__ = ("index",)

    def __init__(self, index):
        self.index = index

    def __reduce__(self):
        return _Top, (self.index,)


def call_args(args, kwargs):
    """A call's arguments -> (serialized (args, kwargs), top-level refs)."""
    top = EMPTY
    if any(type(a) is ObjectRef for a in args) or any(type(v) is ObjectRef for v in kwargs.values()):
        top = []

        def lift(a):
            if type(a) is ObjectRef:
                top.append(a)
                return _Top(len(top) - 1)
            return a

        args = tuple(lift(a) for a in args)
        kwargs = {k: lift(v) for k, v in kwargs.items()}
    if not kwargs and all(type(a) in _SIMPLE for a in args):
        return (pickle.dumps((args, None), 5), [], []), top
    return dumps((args, kwargs or None)), top


def load_call_args(parts, top):
    """The worker's side of call_args: (args, kwargs) with the top-level
    refs' values in place (a failed upstream call raises its error)."""
    args, kwargs = loads(parts)
    if top:
        values = [value_of(t) for t in top]
        args = tuple(values[a.index] if type(a) is _Top else a for a in args)
        if kwargs:
            kwargs = {k: values[v.index] if type(v) is _Top else v for k, v in kwargs.items()}
    return args, kwargs or {}


def dumps_code(obj):
    """A function or class with the driver's sys.path, so that the worker
    imports what the driver could (modules beside the driver's script)."""
    return pickle.dumps((list(sys.path), cloudpickle.dumps(obj, 5)), 5)


def loads_code(blob):
    path, code = pickle.loads(blob)
    for entry in path:
        if entry not in sys.path:
            sys.path.append(entry)
    return pickle.loads(code)
