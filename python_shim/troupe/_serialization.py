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
# A copy of a ref is the ref (it names one object, as Ray's refs do):
# copy.deepcopy of a config that holds refs works.
ObjectRef.__copy__ = lambda self: self
ObjectRef.__deepcopy__ = lambda self, memo: self


class Yielded(list):
    """What a generator function yielded in a call made with a fixed
    num_returns (Ray's static generators): one value per return."""


def pick(value, item):
    """Item (index, count, what) of a num_returns=count call's value: a
    tuple or list of count values, else the ValueError Ray raises."""
    index, count, what = item
    if not isinstance(value, (tuple, list)) or len(value) != count:
        if type(value) is Yielded:
            raise ValueError(f"{what} yielded {len(value)} values, but num_returns={count}: a generator function "
                             f"called with a fixed num_returns must yield that many")
        got = f"{len(value)} values" if isinstance(value, (tuple, list)) else f"a value of type {type(value).__name__}"
        raise ValueError(f"{what} returned {got}, but num_returns={count}: it must return a tuple or list "
                         f"of {count} values")
    return value[index]


def one(value, what):
    """The value of a num_returns=1 call: for a generator function, the one
    value it yielded."""
    if type(value) is not Yielded:
        return value
    return pick(value, (0, 1, what))


class ItemRef(ObjectRef):
    """One of the refs of a call made with num_returns=N (N > 1), as Ray's.
    The call's result is one object, a tuple or list of N values; this ref
    stands for value `index` of it. It is an ObjectRef: get, wait, await and
    passing it to a task or inside a value work as for any ref. The N refs
    share that object: it lives while any of them does, and getting one
    fetches the whole result."""

    def __init__(self, parent, index, count, what):
        ObjectRef.__init__(self, parent)
        self._parent = parent
        self._item = (index, count, what)

    def _pick(self, value):
        return pick(value, self._item)

    def __reduce__(self):
        # The whole result travels as a ref; the receiver picks the item.
        return ItemRef, (self._parent, *self._item)

    def __repr__(self):
        return f"{ObjectRef.__repr__(self._parent)}[{self._item[0]}]"


def items(ref, count, what):
    """The refs a num_returns=count call returns for its result `ref`:
    None for 0 (as Ray), `ref` itself for 1, else count ItemRefs."""
    if count == 0:
        return None
    if count == 1:
        return ref
    return [ItemRef(ref, i, count, what) for i in range(count)]


def parent(ref):
    """The ref the runtime knows for `ref`: an ItemRef's whole result."""
    return ref._parent if type(ref) is ItemRef else ref


def value_for(ref, parts):
    """value_of(parts) of `ref`'s whole result, as `ref` sees it (its item
    for an ItemRef). A value this process cannot unpickle (its class's
    module is not here) is RaySystemError naming the ref, as in Ray (it was
    a bare "No module named ..." from deep in pickle)."""
    try:
        value = loads(parts)
    except Exception as e:  # whatever a value's unpickling raises (a __reduce__'s callable, a missing module)
        from troupe.exceptions import RaySystemError, TroupeError

        if isinstance(e, TroupeError):
            raise
        hint = (" (a class or module the value needs is not importable here: install it, or ship it with "
                "runtime_env's py_modules or working_dir)" if isinstance(e, (ImportError, AttributeError)) else "")
        raise RaySystemError(
            f"cannot unpickle the value of ObjectRef {ref.hex()} in this process: {type(e).__name__}: {e}{hint}"
        ) from e
    if type(value) is _ErrorBox:
        raise value.exception()
    if type(ref) is ItemRef:
        return pick(value, ref._item)
    return one(value, f"the call of ObjectRef {ref.hex()}")


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
        # A tensor of its own: torch tensors are writable, and the buffer
        # may be the object store's, which every later get of the same
        # object reads (one copy, as Ray's unpickling makes).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape).clone()
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
    """Stands for a top-level ObjectRef argument, resolved before the call;
    for an ItemRef, its result's ref is resolved and `item` picked."""

    __slots__ = ("index", "item")

    def __init__(self, index, item=None):
        self.index = index
        self.item = item

    def __reduce__(self):
        return _Top, (self.index, self.item)

    def value(self, values):
        value = values[self.index]
        return one(value, "the call of an argument's ObjectRef") if self.item is None else pick(value, self.item)


def call_args(args, kwargs):
    """A call's arguments -> (serialized (args, kwargs), top-level refs)."""
    top = EMPTY
    if any(isinstance(a, ObjectRef) for a in args) or any(isinstance(v, ObjectRef) for v in kwargs.values()):
        top = []

        def lift(a):
            if type(a) is ObjectRef:
                top.append(a)
                return _Top(len(top) - 1)
            if type(a) is ItemRef:
                top.append(a._parent)
                return _Top(len(top) - 1, a._item)
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
        args = tuple(a.value(values) if type(a) is _Top else a for a in args)
        if kwargs:
            kwargs = {k: v.value(values) if type(v) is _Top else v for k, v in kwargs.items()}
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
