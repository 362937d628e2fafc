"""troupe: a Ray-shaped Python API over troupe's C++ runtime.

    import troupe

    troupe.init()                       # embedded local cluster

    @troupe.remote
    def square(x):
        return x * x

    @troupe.remote(max_restarts=1)
    class Tally:
        def __init__(self, seen=()):
            self.seen = list(seen)
        def note(self, item):
            self.seen.append(item)
            return len(self.seen)

    t = Tally.remote()
    print(troupe.get([square.remote(i) for i in range(4)]), troupe.get(t.note.remote("x")))

Everything below this API (scheduling, restarts, retries, placement, failure
detection, object ownership) is the C++ runtime's: this package only turns
Python values into troupe values and calls troupe._core.
"""
import atexit
import json
import os
import sys
import threading

from troupe import _core
from troupe import actor
from troupe import exceptions
from troupe._generator import ObjectRefGenerator
from troupe._remote import ActorClass, ActorHandle, RemoteFunction, method, remote
from troupe import _packages
from troupe import _pip
from troupe import _remote
from troupe import _serialization as _ser
from troupe import _timeouts

ObjectRef = _core.ObjectRef
# As ray.__version__; the same as `troupe --version` and pyproject.toml's
# (test_cli.py checks all three agree).
__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "remote", "method", "get", "put", "wait", "kill", "cancel", "get_actor",
    "cluster_resources", "available_resources", "nodes", "get_runtime_context", "get_gpu_ids",
    "ObjectRef", "ObjectRefGenerator", "ActorHandle", "ActorClass", "RemoteFunction", "exceptions", "actor", "util",
]

_core.set_error_classes(dict(exceptions._FROM_RUNTIME))
_lock = threading.Lock()
_state = None  # the process's client: a driver's, or the worker's own
# Held by shutdown() for the whole of it: a second shutdown (another thread,
# atexit) returns only once the first has stopped the cluster. Reentrant, so
# that a signal handler calling shutdown() on the same thread cannot deadlock.
_shutdown_lock = threading.RLock()


class _State:
    def __init__(self, client, job_id, namespace="", env_vars=None, packages=(None, ()), pip=None):
        self.client = client
        self.job_id = job_id
        # An embedded cluster (init() without an address): every node is
        # this host.
        self.embedded = False
        # Where named actors are made and looked up by default: the
        # driver's init(namespace=...), "" (the default: names as given,
        # cluster-wide) when none was.
        self.namespace = namespace
        # runtime_env's env_vars that every task and actor started from
        # here gets (a driver's init(runtime_env=...), a worker's own).
        self.env_vars = env_vars or {}
        # runtime_env's working_dir and py_modules, as package ids in the
        # cluster's KV store (troupe/_packages.py): (working_dir or None,
        # tuple of py_modules).
        self.packages = packages
        # Follows the workers' log files for the console (_driver_logs);
        # None on an embedded cluster, whose workers print there already.
        self.logs = None
        # runtime_env's pip, as troupe/_pip.py writes it (None: none).
        self.pip = pip


def _client():
    """The process's client core, or an error naming what to do."""
    state = _state
    if state is None:
        if _core.in_worker():
            return _attach_worker().client
        if _forked_from is not None:
            raise exceptions.TroupeError(
                f"troupe was initialized in process {_forked_from}, which this process forked from: a fork's "
                "child cannot use its parent's connection (its threads stayed in the parent). Use troupe in the "
                "parent, or start the child with multiprocessing's 'spawn' and call troupe.init() there")
        raise exceptions.TroupeError("troupe is not initialized: call troupe.init() first")
    return state.client


# The driver that forked this process, if one did while initialized.
_forked_from = None


def _forget_in_child():
    """After os.fork(): the parent's runtime is not this process's. Its
    atexit shutdown would wait for answers no thread here reads (a child
    that called sys.exit() never ended)."""
    global _state, _forked_from
    if _state is not None and not _core.in_worker():
        _forked_from = os.getppid()
        _state = None


os.register_at_fork(after_in_child=_forget_in_child)


def _current_client():
    """The process's client, or None (not initialized, or a worker not yet
    attached): what a handle made now belongs to."""
    state = _state
    return state.client if state is not None else None


def _is_stale(client):
    """Whether a handle made with `client` (None: not known) belongs to a
    session that was shut down: its client is not the process's current one
    (another session's, or none since troupe.shutdown())."""
    return client is not None and client is not _current_client()


def _same_session(client, what):
    """The process's client, when `client` (the one a handle was made with;
    None: not known) is it. Ids (actors, placement groups) are the
    cluster's: after shutdown and init the same id names another object of
    the new cluster, so a handle of the old session must not reach it; after
    shutdown alone its cluster is gone."""
    if _is_stale(client):
        raise exceptions.TroupeError(f"{what} belongs to a troupe session that was shut down; "
                                     "its handle cannot name anything in this one")
    return _client()


def _namespace():
    """The namespace of the calling code: its driver's ("" = the default)."""
    _client()
    state = _state
    return state.namespace if state is not None else ""


def _attach_worker():
    global _state
    with _lock:
        if _state is None:
            # A pooled worker is handed its driver's job and namespace after
            # it started: from the process's environment, not os.environ's
            # copy of it.
            _state = _State(_core.Client.attach_worker(), _core.getenv("PYTROUPE_JOB_ID"),
                            _core.getenv("PYTROUPE_NAMESPACE"), _remote.inherited_env_vars(), _packages.inherited(),
                            _pip.inherited())
        return _state


_LOGGING_LEVELS = {10: "debug", 20: "info", 30: "warning", 40: "error", 50: "critical"}


def init(address=None, *, num_cpus=None, num_gpus=None, resources=None, namespace=None,
         ignore_reinit_error=False, object_store_memory=None, logging_level=None, runtime_env=None,
         log_to_driver=True, include_dashboard=None, dashboard_host=None, dashboard_port=None,
         configure_logging=True, logging_format=None, local_mode=False, _system_config=None, _token=None):
    """Connects to a cluster, or starts an embedded local one, as Ray's init:
    "HOST:PORT"; "auto" for the cluster `troupe start --head` recorded in
    the session directory; None for TROUPE_ADDRESS, else that session's
    cluster when its head runs (and no num_cpus, num_gpus or resources are
    given), else an embedded one; "local" for an embedded one whatever runs. The token comes from TROUPE_TOKEN or the session
    directory, as for C++ drivers. `namespace`: where this driver's named
    actors (and those of its tasks and actors) live and are looked up; None
    (the default) keeps names cluster-wide, unlike Ray's anonymous one.
    `runtime_env`: for every task and actor of this job, as Ray's:
    {"env_vars": {...}, "working_dir": DIR, "py_modules": [DIR, FILE.py or
    module, ...], "excludes": [PATTERN, ...], "pip": [REQUIREMENT, ...]}
    (other keys are refused by name; docs/python.md). Under `troupe submit --runtime-env-json`, that
    one is the default, and what is given here wins key by key. `log_to_driver` (Ray's): on a
    cluster started with `troupe start`, what this driver's tasks and actors print shows here too,
    each line marked with its worker (troupe._driver_logs); an embedded cluster's workers print
    here anyway. Ray's dashboard options describe a cluster this call
    starts: an embedded one serves no dashboard, so include_dashboard=True,
    dashboard_host or dashboard_port with one is a ConfigError (`troupe start
    --head --dashboard-port N` serves one); joining a running cluster, they
    are ignored, as Ray ignores them. configure_logging and logging_format
    are taken and change nothing: troupe never configures Python's logging.
    local_mode and _system_config are refused by name."""
    global _state
    if _core.in_worker():
        # In an actor or a task, troupe is its cluster's already: init()
        # joined that cluster again as a new driver (another job, another
        # namespace), or embedded a second cluster inside the worker.
        if ignore_reinit_error:
            return InitContext(_client())
        raise RuntimeError("troupe.init() was called in a worker, which is connected to its cluster already "
                           "(troupe.is_initialized() is True there; init(ignore_reinit_error=True) passes)")
    _remote.check_namespace(namespace, "troupe.init")
    _check_ray_only_init_options(include_dashboard, dashboard_host, dashboard_port, configure_logging,
                                 logging_format, local_mode, _system_config)
    job_env = _remote.parse_runtime_env(_remote.with_submitted_runtime_env(runtime_env), "troupe.init")
    if address is None:
        address = os.environ.get("TROUPE_ADDRESS") or None
    if address == "local":
        address = None
    elif address is None and num_cpus is None and num_gpus is None and resources is None:
        session, running = _core.running_cluster()
        if running:
            print(f"troupe.init: connecting to the cluster running at {running} (session {session}); "
                  "address='local' starts an embedded one", file=sys.stderr, flush=True)
            address = running
    # A Python driver's console is the script's: the runtime's warnings and
    # errors only (not a line per actor placed or stopped), unless asked
    # for more with TROUPE_LOG_LEVEL=info. The embedded cluster inherits it.
    # logging_level (Ray's: a logging level, e.g. logging.INFO, or its
    # name) says otherwise.
    if logging_level is not None:
        level = _LOGGING_LEVELS.get(logging_level, logging_level)
        if not isinstance(level, str) or level.lower() not in _LOGGING_LEVELS.values():
            raise exceptions.ConfigError(f"logging_level must be a logging level (logging.INFO, 'info', ...), "
                                         f"got {logging_level!r}")
    # The environment this session sets (its embedded cluster's workers
    # inherit it), undone by shutdown() or a failed init: options do not
    # outlive their session.
    env = {}
    if logging_level is not None:
        env["TROUPE_LOG_LEVEL"] = level.lower()
    elif "TROUPE_LOG_LEVEL" not in os.environ:
        env["TROUPE_LOG_LEVEL"] = "warning"
    if address is not None and not isinstance(address, str):
        raise exceptions.ConfigError(f"address must be 'HOST:PORT' or 'auto', not {address!r}")
    if address is not None and not address.strip():
        raise exceptions.ConfigError(f"address {address!r} is empty: give 'HOST:PORT', 'auto' for the "
                                     "session's cluster, or None for an embedded one")
    if resources is not None and not isinstance(resources, dict):
        raise exceptions.ConfigError(f"troupe.init: resources must be a dict of name -> amount, got {resources!r}")
    node = dict(resources or {})
    for key, value in node.items():
        _remote._number(value, f"troupe.init: resources[{key!r}]")
    _remote._number(num_cpus, "troupe.init: num_cpus")
    _remote._number(num_gpus, "troupe.init: num_gpus")
    # As Ray: CPUs and GPUs are given by num_cpus/num_gpus, not in resources
    # as well, where one of the two would be silently ignored.
    for key, given in (("CPU", num_cpus), ("GPU", num_gpus)):
        if key in node:
            arg = f"num_{key.lower()}s"
            both = f" (and {arg}={given!r} was given too)" if given is not None else ""
            raise exceptions.ConfigError(f"troupe.init: resources has {key!r}: {node[key]!r}{both}; give the "
                                         f"node's {key}s with {arg}=, not in resources")
    if num_cpus is not None:
        node["CPU"] = float(num_cpus)
    if num_gpus is not None:
        node["GPU"] = float(num_gpus)
    if address and node:
        raise exceptions.ConfigError("num_cpus, num_gpus and resources describe an embedded "
                                     f"cluster; not allowed with address={address!r}")
    if not address and (include_dashboard or dashboard_host is not None or dashboard_port is not None):
        raise exceptions.ConfigError("troupe.init: an embedded cluster serves no dashboard (include_dashboard, "
                                     "dashboard_host, dashboard_port); `troupe start --head --dashboard-port N` "
                                     "starts a cluster that does, and troupe.init('auto') joins it")
    if object_store_memory is not None:
        # The driver's object store limit (what its puts and the results
        # it sends on keep), as TROUPE_OBJECT_STORE_BYTES sets it; an
        # embedded cluster's workers inherit it, a running cluster's keep
        # what their node was started with (docs/python.md).
        if isinstance(object_store_memory, bool) or not isinstance(object_store_memory, int) or \
                object_store_memory <= 0:
            raise exceptions.ConfigError(f"object_store_memory must be a positive number of bytes, "
                                         f"got {object_store_memory!r}")
        env["TROUPE_OBJECT_STORE_BYTES"] = str(object_store_memory)
    # After a shutdown() under way on another thread: the new session starts
    # once the old cluster is stopped, not beside it.
    with _shutdown_lock, _lock:
        if _state is not None:
            if ignore_reinit_error:
                return InitContext(_state.client)
            raise RuntimeError("troupe.init() was called twice (troupe.shutdown() first)")
        for key, value in env.items():
            _init_env.setdefault(key, os.environ.get(key))
            os.environ[key] = value
        try:
            client = _core.Client(address or "", _token or "", {k: float(v) for k, v in node.items()})
        except BaseException:
            _restore_init_env()
            raise
        try:
            packages = job_env.packages(client, (None, ()))
        except BaseException:
            client.shutdown()
            _restore_init_env()
            raise
        _state = _State(client, f"{os.getpid()}@{client.address}", namespace or "", job_env.env_vars, packages,
                        job_env.pip)
        _state.embedded = not address
        if address and log_to_driver:
            from troupe import _driver_logs

            _state.logs = _driver_logs.DriverLogs(client)
    atexit.register(shutdown)
    return InitContext(client)


def _check_ray_only_init_options(include_dashboard, dashboard_host, dashboard_port, configure_logging,
                                 logging_format, local_mode, system_config):
    """The types of Ray's init options that troupe takes for Ray code's
    sake, and the refusal of those it has nothing for."""
    if include_dashboard is not None and not isinstance(include_dashboard, bool):
        raise exceptions.ConfigError(f"troupe.init: include_dashboard must be True, False or None, "
                                     f"got {include_dashboard!r}")
    if dashboard_host is not None and not isinstance(dashboard_host, str):
        raise exceptions.ConfigError(f"troupe.init: dashboard_host must be a host name, got {dashboard_host!r}")
    if dashboard_port is not None and (isinstance(dashboard_port, bool) or not isinstance(dashboard_port, int)
                                       or not 0 <= dashboard_port <= 65535):
        raise exceptions.ConfigError(f"troupe.init: dashboard_port must be a port number, got {dashboard_port!r}")
    if not isinstance(configure_logging, bool):
        raise exceptions.ConfigError(f"troupe.init: configure_logging must be a bool, got {configure_logging!r}")
    if logging_format is not None and not isinstance(logging_format, str):
        raise exceptions.ConfigError(f"troupe.init: logging_format must be a format string, got {logging_format!r}")
    if local_mode:
        raise exceptions.ConfigError("troupe.init: local_mode is not supported (Ray deprecated it too): tasks and "
                                     "actors always run in worker processes; an embedded cluster, troupe.init(), "
                                     "is the nearest thing")
    if system_config:
        raise exceptions.ConfigError(f"troupe.init: _system_config is Ray's internal tuning, which troupe has no "
                                     f"equivalent of; got keys {sorted(system_config)!r}")


class InitContext:
    """What troupe.init() returns, as Ray's RayContext: the cluster's
    address and its dashboard's URL (None where it serves none) in
    `address_info` (also by key: ctx["webui_url"]); as a context manager
    it shuts troupe down at its end."""

    def __init__(self, client):
        address = client.address
        dashboard = json.loads(client.status_json(limit=1)).get("dashboard")
        self.address_info = {"address": address, "gcs_address": address, "webui_url": dashboard}
        self.dashboard_url = dashboard

    def __getitem__(self, key):
        return self.address_info[key]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        shutdown()

    def __repr__(self):
        return f"InitContext({self.address_info})"


def is_initialized():
    # A worker's (an actor's, a task's) is its node's cluster, as in Ray.
    return _state is not None or _core.in_worker()


def shutdown():
    """Stops the embedded cluster (its workers too) or disconnects. Returns
    once that is done, also when another thread's shutdown() is doing it."""
    global _state
    with _shutdown_lock:
        with _lock:
            state, _state = _state, None
        if state is not None and not _core.in_worker():
            if state.logs is not None:
                state.logs.close()
            state.client.shutdown()
            _restore_init_env()


# The environment variables init() set, with their values before it (None:
# unset), restored when its session ends.
_init_env = {}


def _restore_init_env():
    for key, before in _init_env.items():
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
    _init_env.clear()


def get(refs, *, timeout=None):
    """The value of a ref, or the values of a list of refs; raises the remote
    error (TaskError, ActorDiedError, ...) or GetTimeoutError. A negative
    or NaN timeout is a ConfigError (a ValueError)."""
    timeout = _timeouts.seconds(timeout, "troupe.get")
    client = _client()
    if isinstance(refs, ObjectRef):
        return _ser.value_for(refs, client.get([_ser.parent(refs)], timeout)[0][1:])
    if isinstance(refs, (list, tuple)):
        for r in refs:
            if not isinstance(r, ObjectRef):
                raise TypeError(f"troupe.get takes ObjectRefs, got a {type(r).__name__} in the list")
        got = client.get([_ser.parent(r) for r in refs], timeout)
        if None in got:  # an error ended the wait before every value was there: raise it
            for ref, r in zip(refs, got):
                if r is not None and r[0]:
                    _ser.value_for(ref, r[1:])
        return [_ser.value_for(ref, r[1:]) for ref, r in zip(refs, got)]
    if isinstance(refs, ObjectRefGenerator):
        raise TypeError("troupe.get of an ObjectRefGenerator (a generator's call): iterate it for one ref per "
                        "value, e.g. troupe.get(list(gen))")
    raise TypeError(f"troupe.get takes an ObjectRef or a list of them, not a {type(refs).__name__}")


class _Awaiter:
    """Settles the awaits of refs (`await ref` in a driver or an actor's
    coroutine, `ref.future()`) from one thread for all of them: a ref's
    answer queues its token (C++, no GIL), and this thread turns the
    tokens into values. A thread each, as before, made 5,000 awaits in
    flight 3,000 threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._waiting = {}  # token -> (ref, deliver)
        self._next = 0
        self._pid = None  # the process whose thread runs (a fork's child starts its own)

    def add(self, ref, deliver):
        """Calls deliver(value, error) on the awaiter thread once `ref` is
        there (its error as `error`)."""
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._waiting = {}
                self._thread = threading.Thread(target=self._run, name="troupe-awaiter", daemon=True)
                self._thread.start()
                atexit.register(self._stop)
            self._next += 1
            token = self._next
            self._waiting[token] = (ref, deliver)
        _core.notify_when_ready(_ser.parent(ref), token)

    def _stop(self):
        # Before the interpreter finalizes: the thread's wait ends and it
        # returns, rather than being ended inside C++ frames.
        _core.stop_ready_tokens()
        self._thread.join(5)

    def _run(self):
        while True:
            tokens = _core.ready_tokens(1.0)
            if tokens is None:  # the interpreter exits
                return
            for token in tokens:
                with self._lock:
                    entry = self._waiting.pop(token, None)
                if entry is None:
                    continue
                ref, deliver = entry
                try:
                    got = _client().get([_ser.parent(ref)], 0.0)  # there: no wait
                    value, error = _ser.value_for(ref, got[0][1:]), None
                except BaseException as e:  # the ref's error is the await's
                    value, error = None, e
                try:
                    deliver(value, error)
                except BaseException:  # a closed loop: no one waits
                    pass


_awaiter = _Awaiter()


def _await_ref(ref):
    # `await ref` in a coroutine: the loop runs on while the ref is not
    # there; the awaiter thread settles the future.
    import asyncio

    from troupe import _worker_hooks

    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value, error):
        if not future.cancelled():
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)

    lend = _worker_hooks.lend_for()
    if not lend:
        _awaiter.add(ref, lambda value, error: loop.call_soon_threadsafe(settle, value, error))
        return future.__await__()

    def wait():
        try:
            # In an async task, the task's CPU is lent while it waits, as
            # for a plain get: a thread of its own waits, as the lending
            # is told by the waiting thread.
            got = _client().get([_ser.parent(ref)], None, lend)
            value, error = _ser.value_for(ref, got[0][1:]), None
        except BaseException as e:  # the ref's error is the await's
            value, error = None, e
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop closed meanwhile: no one waits
            pass

    threading.Thread(target=wait, name="troupe-await", daemon=True).start()
    return future.__await__()


ObjectRef.__await__ = _await_ref


def _ref_key(ref):
    # What names a ref's object for the ref's life (PyRef::key): its owner
    # store and id, or, for a call's answer, a number of this process's; a
    # num_returns item adds its index.
    key = _ser.parent(ref)._key()
    return key if type(ref) is not _ser.ItemRef else (*key, ref._item[0])


def _ref_hex(ref):
    # A ref's id as hex, as Ray's ObjectRef.hex(): stable and unique among
    # the refs of this process.
    return "".join(f"{part:016x}" if i < 2 else f"{part:04x}" for i, part in enumerate(_ref_key(ref)))


def _ref_eq(ref, other):
    # As Ray's: refs to one object are equal (one put, and the ref to it a
    # task returned), and so are usable as dict keys.
    return isinstance(other, ObjectRef) and _ref_key(ref) == _ref_key(other)


ObjectRef.__eq__ = _ref_eq
ObjectRef.__hash__ = lambda ref: hash(_ref_key(ref))
ObjectRef.__repr__ = lambda ref: f"ObjectRef({_ref_hex(ref)})"


def _ref_future(ref):
    # A concurrent.futures.Future of the ref's value, as Ray's
    # ObjectRef.future(): settled by the awaiter thread.
    import concurrent.futures

    future = concurrent.futures.Future()

    def deliver(value, error):
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    _awaiter.add(ref, deliver)
    return future


ObjectRef.hex = _ref_hex
ObjectRef.future = _ref_future


def put(value):
    """Keeps value in this process's object store; the ref may go to any task
    or actor, which fetches the value from here."""
    if isinstance(value, ObjectRef):
        raise TypeError("troupe.put of an ObjectRef: pass the ref itself")
    try:
        data = _ser.dumps(value)
    except exceptions.TroupeError:
        raise
    except Exception as e:  # whatever pickling the value raised, bare: name the value
        raise TypeError(f"troupe.put: the value (a {type(value).__name__}) cannot be pickled: {type(e).__name__}: "
                        f"{e} (troupe.util.inspect_serializability(value) shows what inside it cannot)") from e
    return _client().put(data)


def wait(refs, *, num_returns=1, timeout=None, fetch_local=True):
    """(ready, not_ready): the first num_returns refs ready, in the order
    given, or those ready when timeout (seconds) passes. The list may hold
    ObjectRefGenerators, as Ray's: one is ready when next() on it would
    not wait (a value has come, it ended, or it failed)."""
    timeout = _timeouts.seconds(timeout, "troupe.wait")
    if isinstance(refs, list) and refs and not isinstance(num_returns, bool) and isinstance(num_returns, int) \
            and 1 <= num_returns <= len(refs):
        # Plain refs (the common case): checked, waited on and split in one
        # call. None: generators or what is refused below.
        split = _client().wait_refs(refs, num_returns, timeout)
        if split is not None:
            return split
    if not isinstance(refs, list) or not all(isinstance(r, (ObjectRef, ObjectRefGenerator)) for r in refs):
        raise TypeError("troupe.wait takes a list of ObjectRefs (and ObjectRefGenerators)")
    if not refs:  # as Ray: nothing to wait for
        return [], []
    if len(set(map(id, refs))) != len(refs):
        raise ValueError("troupe.wait: the list holds the same ref twice")
    if isinstance(num_returns, bool) or not isinstance(num_returns, int) or not 1 <= num_returns <= len(refs):
        raise ValueError(f"num_returns={num_returns!r} is not between 1 and len(refs)={len(refs)}")
    if any(isinstance(r, ObjectRefGenerator) for r in refs):
        ready_at = _wait_with_generators(refs, num_returns, timeout)
    else:
        # An ItemRef is ready with its call's result (the same state,
        # counted once for each item given).
        ready_at = set(_client().wait([_ser.parent(r) for r in refs], [], num_returns, timeout))
    ready = [r for i, r in enumerate(refs) if i in ready_at]
    return ready, [r for i, r in enumerate(refs) if i not in ready_at]


# How long troupe.wait sleeps at a time while another thread reads from one
# of the generators it waits on.
_BUSY_SLICE_S = 0.01


def _wait_with_generators(refs, num_returns, timeout):
    """troupe.wait's ready indices for a list that holds generators. The
    runtime waits on refs and generators' streams at once; a generator it
    finds ready is polled (its value fetched ahead), and one whose stream
    failed in a way its retry mends is not ready yet: the wait goes on,
    on the new attempt's stream."""
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    plain = [i for i, r in enumerate(refs) if not isinstance(r, ObjectRefGenerator)]
    gens = [i for i, r in enumerate(refs) if isinstance(r, ObjectRefGenerator)]
    parents = [_ser.parent(refs[i]) for i in plain]
    while True:
        polls = {i: refs[i]._poll() for i in gens}
        polled = {i for i, ready in polls.items() if ready}
        waiting = [i for i in gens if i not in polled]
        order = plain + waiting
        need = num_returns - len(polled)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        # Enough already (or no time left): a poll, for every one ready now
        # (for the order; a generator found ready may yet not be).
        wait_s = 0.0 if need <= 0 else left
        n = len(order) if wait_s == 0.0 else need
        if wait_s != 0.0 and None in polls.values():
            # Another thread reads from a generator: what it takes is not
            # seen in the stream, so look again within a short slice.
            wait_s = _BUSY_SLICE_S if wait_s is None else min(wait_s, _BUSY_SLICE_S)
        streams = [refs[i]._wait_target() for i in waiting]
        if None in streams:  # finished by another thread meanwhile: poll again
            continue
        found = _client().wait(parents, streams, n, wait_s) if order else []
        ready = polled | {order[k] for k in found if k < len(plain) or refs[order[k]]._poll()}
        timed_out = deadline is not None and time.monotonic() >= deadline
        if len(ready) >= num_returns or need <= 0 or timed_out:
            return set(sorted(ready)[:num_returns])


def cancel(ref, *, force=False, recursive=True):
    """Cancels the task or actor method call whose result `ref` is, as
    Ray's ray.cancel: unless it has finished, getting `ref` raises
    TaskCancelledError from now on, and one not yet started never runs.
    A running task gets KeyboardInterrupt at its next Python instruction
    (a blocking call such as time.sleep ends first; a troupe.get or
    troupe.wait it waits in raises it at once), or with force=True its
    worker process is killed (the tasks it started lose their owner). A
    running actor method is not interrupted, as in Ray (the actor's state
    would be left half-changed): it runs on, and may check
    get_runtime_context().is_canceled(); an async method's coroutine is
    cancelled (asyncio.CancelledError). force=True on an actor call is a
    ConfigError (a ValueError): troupe.kill ends the actor. With
    recursive=True (the default, as Ray's), the tasks that a running task
    or plain method submitted and that have not finished are cancelled
    too, without force and recursively; with recursive=False they run on.
    Only the process that made the call can cancel it.
    An ObjectRefGenerator cancels its generator's call: its next ref
    raises TaskCancelledError (after those already received)."""
    if isinstance(ref, ObjectRefGenerator):
        ref = ref._cancel_target()
    if not isinstance(ref, ObjectRef):
        raise TypeError(f"troupe.cancel takes an ObjectRef, not a {type(ref).__name__}")
    if not isinstance(force, bool) or not isinstance(recursive, bool):
        raise TypeError(f"troupe.cancel: force and recursive are bools, got {force!r} and {recursive!r}")
    _client().cancel(_ser.parent(ref), force, recursive)


def kill(actor, *, no_restart=True):
    """Kills the actor's worker (SIGKILL); with no_restart=False it restarts
    if it has restarts left."""
    if not isinstance(actor, ActorHandle):
        raise TypeError(f"troupe.kill takes an actor handle, not a {type(actor).__name__}")
    _same_session(actor._client, f"troupe.kill: actor {actor._actor.id}").kill(actor._actor.id, no_restart)


def get_actor(name, namespace=None):
    """The live actor registered under name in `namespace`, by default the
    caller's (ValueError when there is none)."""
    if not isinstance(name, str) or not name:
        raise exceptions.ConfigError(f"get_actor takes an actor's name, not {name!r}")
    _remote.check_namespace(namespace, "troupe.get_actor")
    _remote.check_actor_name(name, "troupe.get_actor")
    client = _client()
    if namespace is None:
        namespace = _namespace()
    try:
        actor = client.get_actor(_remote.full_actor_name(name, namespace))
    except exceptions.ConfigError as e:
        if not namespace or not str(e).startswith("no actor named"):
            raise
        raise exceptions.ConfigError(f"no actor named {name!r} in namespace {namespace!r}") from None
    return _remote._named_handle(client, actor)


def _positive(resources):
    # As Ray's: a resource of which there is none (a node without GPUs,
    # CPUs all in use) is left out, so `"GPU" in cluster_resources()`
    # reads as it does there.
    return {k: v for k, v in resources.items() if v > 0}


def nodes():
    """Ray's ray.nodes(): a dict per node the cluster has known (NodeID,
    Alive and alive, NodeManagerAddress, NodeManagerHostname, NodeName,
    Resources, Labels; troupe's AvailableResources, GPUIds, IdleWorkers)."""
    out = []
    for n in _client().nodes():
        n = dict(n)
        n["Resources"] = _positive(n.get("Resources", {}))
        # Of the resources the node has; a dead node has none available
        # (it kept the figures of its last heartbeat).
        available = n.get("AvailableResources", {})
        n["AvailableResources"] = {k: v for k, v in available.items() if k in n["Resources"]} if n.get("Alive") else {}
        n.setdefault("NodeName", n.get("NodeManagerAddress"))
        n.setdefault("alive", n.get("Alive"))
        n.setdefault("Labels", {})
        out.append(n)
    return out


def cluster_resources():
    """The live nodes' resources in all (those of which there are none
    left out, as in Ray)."""
    return _positive(_client().cluster_resources())


def available_resources():
    """What no actor, task or placement group holds now (exhausted
    resources left out, as in Ray)."""
    return _positive(_client().available_resources())


def _assigned_gpus():
    """This worker's GPUs as its CUDA_VISIBLE_DEVICES names them (as Ray's
    get_gpu_ids: ints for indices): its node agent's own devices, which
    are not the node's numbers when the agent was started with a
    CUDA_VISIBLE_DEVICES. The node's numbers where the variable does not
    list one per GPU (a driver; code that changed it)."""
    ids = list(_core.gpu_ids())
    names = (_core.getenv_or_none("CUDA_VISIBLE_DEVICES") or "").split(",")
    if not ids or len(names) != len(ids) or not all(names):
        return ids
    return [int(n) if n.isdigit() else n for n in names]


def get_gpu_ids():
    return _assigned_gpus()


class RuntimeContext:
    """Where the calling code runs: job, namespace, node, actor, GPUs."""

    def __init__(self, state):
        self._state = state

    def get_job_id(self):
        return self._state.job_id

    @property
    def job_id(self):
        return self.get_job_id()

    @property
    def node_id(self):
        return self.get_node_id()

    @property
    def gcs_address(self):
        """The cluster head's address (Ray's GCS): HOST:PORT."""
        return json.loads(self._state.client.status_json(limit=1)).get("address")

    def get_task_id(self):
        """As Ray's: an id of the task or actor call running on this
        thread (a string); None in a driver or on a thread of the task's
        own."""
        from troupe import _worker_hooks

        token = _worker_hooks.current_task_token()
        return None if token is None else f"{token:x}"

    def get_worker_id(self):
        """As Ray's: this process's id in the cluster (a hex string), a
        driver's too."""
        return f"{self._state.client.client_id:x}"

    def get_actor_name(self):
        """As Ray's: the name the actor running this was given (without
        its namespace), None for an unnamed one, a task or a driver."""
        from troupe import _worker_hooks

        actor = _worker_hooks.user_actor_id()
        if not actor:
            return None
        name = self._state.client.actor_info(actor).get("name") or ""
        return name.rsplit(_remote.NAMESPACE_SEPARATOR, 1)[-1] if name else None

    @property
    def namespace(self):
        """The namespace named actors are made and looked up in: the
        driver's init(namespace=...), "" when none was given (names are
        then cluster-wide; Ray's would be an anonymous namespace)."""
        return self._state.namespace

    def get_actor_id(self):
        """The actor's id inside an actor; None in a driver or a task (its
        hidden executor is no actor of the user's)."""
        from troupe import _worker_hooks

        actor = _worker_hooks.user_actor_id()
        return str(actor) if actor else None

    def _own_actor(self, what):
        from troupe import _worker_hooks

        actor = _worker_hooks.user_actor_id()
        if not actor:
            raise RuntimeError(f"{what} is for an actor's methods; this is a driver or a task")
        return actor

    @property
    def current_actor(self):
        """A handle to the actor whose method runs this (Ray's), to pass to
        other actors and tasks; RuntimeError in a driver or a task."""
        from troupe import _worker_hooks

        actor = self._own_actor("current_actor")
        client = self._state.client
        return ActorHandle(client.actor_by_id(actor), _worker_hooks.actor_class(), client,
                           groups=_core.concurrency_groups())

    @property
    def was_current_actor_reconstructed(self):
        """Whether the actor whose method runs this has been restarted
        (Ray's); RuntimeError in a driver or a task."""
        actor = self._own_actor("was_current_actor_reconstructed")
        return self._state.client.actor_info(actor)["restarts"] > 0

    def get_node_id(self):
        client = self._state.client
        actor = _core.actor_id()
        if actor:
            return str(client.actor_info(actor)["node_id"])
        import socket

        host = socket.gethostname()
        mine = [n["NodeID"] for n in client.nodes() if n["Alive"] and n["NodeManagerHostname"] == host]
        return mine[0] if mine else None

    def get_assigned_resources(self):
        """As Ray's: inside an actor or a task, the resources its worker
        holds, e.g. {"CPU": 1.0, "GPU": 0.5} (what its options asked; a
        task's are its own). RuntimeError in a driver, which holds none."""
        if not _core.in_worker():
            raise RuntimeError("get_assigned_resources() is for actors and tasks; this is a driver")
        return dict(_core.assigned_resources())

    @property
    def runtime_env(self):
        """As Ray's: the runtime_env the calling code runs with, as a
        RuntimeEnv: the job's in a driver (init's over troupe submit's), a
        task's or an actor's in its worker (its options' over what it
        inherited, env_vars merged by name). A working_dir or py_module is
        named by its package's URI, troupe_pkg://<sha256> (Ray names its
        uploads gcs://_ray_pkg_<hash>.zip), which runtime_env takes back
        (a child given the caller's env runs with the same packages); pip in
        Ray's shape, {"packages", "pip_install_options", "pip_check"}."""
        state = self._state
        working_dir, py_modules = state.packages
        fields = {}
        if state.env_vars:
            fields["env_vars"] = dict(state.env_vars)
        if working_dir:
            fields["working_dir"] = _remote.PACKAGE_URI + working_dir
        if py_modules:
            fields["py_modules"] = [_remote.PACKAGE_URI + m for m in py_modules]
        if state.pip:
            spec = json.loads(state.pip) if isinstance(state.pip, str) else state.pip
            fields["pip"] = {"packages": spec["packages"], "pip_install_options": spec["options"],
                             "pip_check": spec["check"]}
        from troupe.runtime_env import RuntimeEnv

        return RuntimeEnv(**fields)

    def get_placement_group_id(self):
        """As Ray's: the id of the placement group this actor or task runs
        in (a string), None in a driver or outside any group."""
        group = _core.placement_group_id()
        return str(group) if group else None

    def get_accelerator_ids(self):
        return {"GPU": [str(g) for g in _assigned_gpus()]}

    def get_gpu_ids(self):
        return _assigned_gpus()

    def is_canceled(self):
        """As Ray's: inside a task or an actor method, whether troupe.cancel
        reached it while it ran (a plain method runs on to its end; a long
        one may check this now and then and return early). RuntimeError
        where no task or call runs on this thread: a driver, an async
        method's coroutine (its cancel is asyncio's), a thread the method
        started."""
        cancelled = _core.current_task_cancelled()
        if cancelled is None:
            raise RuntimeError(
                "is_canceled() is for the thread of a task or a plain actor method; "
                "this thread runs none (a driver, an async method, or a thread of the method's own)"
            )
        return cancelled


def get_runtime_context():
    _client()
    return RuntimeContext(_state)


# troupe.util (ActorPool, placement groups, state, ...) right after
# `import troupe`, as ray.util after `import ray`. Imported last: its
# modules use the names above.
from troupe import util  # noqa: E402
