"""Errors of the troupe Python API, named as Ray's (troupe.exceptions).

A Python exception raised by a remote function or method reaches the caller
as a TaskError whose message holds the remote traceback; the instance is also
of the original exception's class (a class made on the fly that derives from
both), so ``except ValueError`` catches a remote ValueError. Failures of the
runtime (a dead actor or worker, a timeout, a lost object) have classes of
their own, raised from the C++ runtime's errors of the same meaning.
"""


class TroupeError(Exception):
    """Base of every error troupe raises."""


class TaskError(TroupeError):
    """A remote function or actor method raised; ``cause`` is the original
    exception (None when it could not be pickled), ``traceback_str`` the
    remote traceback; as Ray's RayTaskError, ``function_name``, ``pid`` and
    ``ip`` say what raised it where (None when not known)."""

    function_name = pid = ip = None

    def __init__(self, message, cause=None, traceback_str=""):
        super().__init__(message)
        self.cause = cause
        self.traceback_str = traceback_str

    def as_instanceof_cause(self):
        """As Ray's: an error that is also of the original exception's
        class. troupe raises one already (when that class can be a base):
        this is it."""
        return self


class RayActorError(TroupeError):
    """Ray's base of the errors of an actor that cannot take calls."""


class ActorDiedError(RayActorError):
    """The actor is dead (killed, crashed, out of restarts) or died while the
    call was in flight. As Ray's, ``error_msg`` is the message and
    ``actor_id`` the actor's id where the message names it."""

    @property
    def error_msg(self):
        return str(self)

    @property
    def actor_id(self):
        import re

        m = re.match(r"actor (\d+)\b", str(self))
        return m.group(1) if m else None


class ActorUnavailableError(RayActorError):
    """Ray's error for an actor that is restarting. troupe waits for the
    restart instead (a call in flight when the actor died raises
    ActorDiedError)."""


class WorkerCrashedError(TroupeError):
    """The worker process running a task died and the task had no retries
    left."""


class TaskCancelledError(TroupeError):
    """The task was cancelled (troupe.cancel) before it finished."""


class GetTimeoutError(TroupeError, TimeoutError):
    """get() or an actor's start ran past its timeout."""


class ObjectLostError(TroupeError):
    """An object's owner died or cannot be reached."""


class OwnerDiedError(ObjectLostError):
    """Ray's name for an object lost with its owner; troupe raises
    ObjectLostError, which `except OwnerDiedError` does not catch, but
    `except ObjectLostError` catches both, as in Ray."""


class StreamError(TroupeError):
    """A streaming call's stream broke while its call ran on (or its
    reader, the ObjectRefGenerator, was dropped)."""


class PendingCallsLimitExceeded(TroupeError):
    """An actor handle made with max_pending_calls=N has N calls under way:
    this one was not sent (Ray's)."""


class ConfigError(TroupeError, ValueError):
    """Bad input: an option, an address, an actor name that does not exist."""


class RuntimeEnvSetupError(ConfigError):
    """As Ray's: a runtime_env that could not be set up where its task or
    actor was to run (a pip install that failed, saying what pip said and
    on which node). A ConfigError too: no retry can mend it. A runtime_env
    refused before it is sent is a plain ConfigError."""


class TroupeConnectionError(TroupeError, ConnectionError):
    """The cluster cannot be reached, or refused this process (wrong token)."""


# Ray's names (ray.exceptions), so that code moved from Ray imports and
# catches as it did. The first three are troupe's own classes under Ray's
# names; the others are defined for `except` clauses and raised by troupe
# where it has the same failure (see each).
RayError = TroupeError
RayTaskError = TaskError


class RaySystemError(TroupeError):
    """Ray's error of its own machinery; troupe raises TroupeError."""


class NodeDiedError(TroupeError):
    """Ray's error for a node lost; troupe's calls on it raise
    ActorDiedError or WorkerCrashedError, naming the node."""


class OutOfMemoryError(TroupeError):
    """Ray's error for a worker its memory monitor killed; troupe has no
    memory monitor (a worker the kernel kills is WorkerCrashedError)."""


class ObjectStoreFullError(TroupeError):
    """A full object store (Ray's name): troupe's stores are bounded by
    TROUPE_OBJECT_STORE_BYTES (troupe.init(object_store_memory=...)); the
    message names the object's size and what the store holds."""




class CollectiveAbortedError(TroupeError):
    """A collective operation (troupe.util.collective) that cannot finish:
    another member of its group died or restarted (the message names its
    rank and actor), or the group was aborted. The group is broken: every
    member destroys it and forms it again."""


class TaskUnschedulableError(TroupeError):
    """Ray's error for a task that can be placed nowhere; troupe raises
    ConfigError at submit, naming the resources."""


class ActorUnschedulableError(TroupeError):
    """Ray's error for an actor that can be placed nowhere. troupe does not
    raise it: such an actor stays PENDING (a node that fits may join), its
    pending_reason (troupe status, list_actors) names what it waits for,
    and a get on its calls times out."""


# Subclasses of TaskError and an original class, by that class.
_task_error_classes = {}


def _dual_init(self, message, cause=None, traceback_str=""):
    # Not the original class's __init__, whose arguments (JSONDecodeError's
    # msg, doc, pos; UnicodeDecodeError's five) the message does not fit.
    BaseException.__init__(self, message)
    self.cause = cause
    self.traceback_str = traceback_str


def _cause_attribute(self, name):
    # Only for attributes the instance lacks: those of the original
    # exception (MyError.code, CalledProcessError.returncode), as Ray's.
    cause = self.__dict__.get("cause")
    if cause is None or name.startswith("__"):
        raise AttributeError(name)
    return getattr(cause, name)


def _rebuild_task_error(cause_class, args, state):
    """A TaskError(cause_class) as pickled by _reduce_task_error."""
    e = BaseException.__new__(_task_error_class(cause_class))
    e.args = args
    e.__dict__.update(state)
    return e


def _reduce_task_error(self):
    # Pickled by its original class: the class made here has no name pickle
    # can look up ("TaskError(MyError)" is no attribute of this module).
    return _rebuild_task_error, (type(self)._cause_class, self.args, dict(self.__dict__))


def _task_error_class(cause_class):
    cls = _task_error_classes.get(cause_class)
    if cls is not None:
        return cls
    try:
        cls = type(f"TaskError({cause_class.__name__})", (TaskError, cause_class), {
            "__init__": _dual_init,
            "__str__": lambda self: self.args[0] if self.args else "",
            "__getattr__": _cause_attribute,
            "__reduce__": _reduce_task_error,
            "_cause_class": cause_class,
            "__module__": __name__,
        })
    except TypeError:  # a class that cannot be a base (layout, final)
        cls = TaskError
    _task_error_classes[cause_class] = cls
    return cls


def _rebuild_exception(cls, args, state):
    """An exception of `cls` with `args` and attributes `state`, made
    without calling its __init__ (for one whose __init__ takes other
    arguments than its args, which pickle would call it with)."""
    e = BaseException.__new__(cls)
    e.args = args
    e.__dict__.update(state)
    return e


class _RebuildByState:
    """Pickles an exception as _rebuild_exception(class, args, attributes)."""

    def __init__(self, exc):
        self.exc = exc

    def __reduce__(self):
        e = self.exc
        return _rebuild_exception, (type(e), e.args, dict(getattr(e, "__dict__", {})))


class _ErrorBox:
    """What a failed remote call answers: the exception (pickled apart, so an
    unpicklable one still reports its class and message) and its traceback.
    Loading one where a value is expected raises it (get, task arguments)."""

    # What raised it where (TaskError's function_name, pid, ip).
    function_name = pid = ip = None

    def __init__(self, cause_blob, class_name, message, traceback_str, where, function_name=None, pid=None, ip=None):
        self.cause_blob = cause_blob
        self.class_name = class_name
        self.message = message
        self.traceback_str = traceback_str
        self.where = where
        self.function_name, self.pid, self.ip = function_name, pid, ip

    def exception(self):
        e = self._exception()
        try:
            if e.function_name is None:
                e.function_name, e.pid, e.ip = self.function_name, self.pid, self.ip
        except Exception:  # noqa: BLE001 - an exception class that takes no attributes
            pass
        return e

    def _exception(self):
        import pickle

        cause = None
        if self.cause_blob is not None:
            try:
                cause = pickle.loads(self.cause_blob)
            except Exception:  # its class is not importable here
                cause = None
        text = f"{self.class_name}: {self.message}\n\n{self.where} raised:\n{self.traceback_str}"
        if isinstance(cause, TaskError):
            # A task's error re-raised by its caller (a get in a task): this
            # caller's traceback, which ends with the nested error's, under
            # the original error's first line, as Ray chains them. The
            # class and cause stay the nested error's.
            first = (str(cause).splitlines() or [self.class_name])[0]
            try:
                return type(cause)(f"{first}\n\n{self.where} raised:\n{self.traceback_str}", cause.cause,
                                   self.traceback_str)
            except Exception:  # noqa: BLE001 - a class made otherwise: the nested error as it came
                return cause
        if isinstance(cause, Exception):
            try:
                return _task_error_class(type(cause))(text, cause, self.traceback_str)
            except Exception:  # a __new__ of its own (ExceptionGroup's): a plain TaskError
                pass
        return TaskError(text, cause, self.traceback_str)


# The C++ runtime's errors (troupe/runtime/core/errors.h) by name, for the
# extension's exception translator.
_FROM_RUNTIME = {
    "ActorDied": ActorDiedError,
    "WorkerDied": WorkerCrashedError,
    "Timeout": GetTimeoutError,
    "ObjectLost": ObjectLostError,
    "ObjectStoreFull": ObjectStoreFullError,
    "Aborted": CollectiveAbortedError,
    "ConfigError": ConfigError,
    "ConnectionError": TroupeConnectionError,
    "TaskCancelled": TaskCancelledError,
    "StreamError": StreamError,
    "RemoteError": TaskError,
    "Error": TroupeError,
}
