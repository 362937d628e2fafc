"""@troupe.remote: remote functions (tasks) and actor classes, as Ray's.

A task runs through the runtime's task submitter (leased executor workers,
retries); its function travels once per worker: pickled once per driver,
kept in the cluster's KV store under its content hash, fetched by a worker
the first time it runs it. An actor's class travels in its spec (the head
keeps it for restarts).
"""
import functools
import hashlib
import inspect
import json
import numbers
import os
import re
import sys
import threading
import types

from troupe import _core
from troupe import _generator
from troupe import _packages
from troupe import _pip
from troupe import _serialization as ser
from troupe._launcher import worker_executable
from troupe.exceptions import ConfigError, TroupeError

_FUNCTION_KEY = "troupe.py.fn."
# Where to run: Ray's scheduling_strategy, or its older placement_group and
# placement_group_bundle_index options.
_PLACEMENT_OPTIONS = {"scheduling_strategy", "placement_group", "placement_group_bundle_index",
                      "placement_group_capture_child_tasks"}
# Set in the workers of a task or actor whose placement group captures its
# children: the group's id.
CAPTURE_ENV = "PYTROUPE_CAPTURE_PG"
_TASK_OPTIONS = {"num_cpus", "num_gpus", "memory", "resources", "max_retries", "max_calls", "name", "num_returns",
                 "retry_exceptions", "preload_modules", "runtime_env",
                 _generator.BACKPRESSURE_OPTION} | _PLACEMENT_OPTIONS
_ACTOR_OPTIONS = {"num_cpus", "num_gpus", "memory", "resources", "max_restarts", "max_task_retries", "max_concurrency", "name",
                  "lifetime", "namespace", "get_if_exists", "preload_modules", "runtime_env",
                  "max_pending_calls", "concurrency_groups"} | _PLACEMENT_OPTIONS
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
# The head has one flat table of actor names: a name in a namespace is kept
# there as NAMESPACE/NAME, one in the default namespace ("") as NAME alone,
# as before namespaces. Neither part may hold the separator, so no two
# (namespace, name) pairs share an entry.
NAMESPACE_SEPARATOR = "/"


def _client():
    import troupe

    return troupe._client()


def _client_or_init():
    """As Ray's: a driver's first .remote() without troupe.init() calls it
    (joining the session's running cluster, else embedding one)."""
    import troupe

    if troupe._state is None and not _core.in_worker() and troupe._forked_from is None:
        print("troupe: .remote() before troupe.init(): calling troupe.init()", file=sys.stderr, flush=True)
        troupe.init(ignore_reinit_error=True)
    return troupe._client()


def _check_options(options, allowed, what):
    unknown = set(options) - allowed
    if unknown:
        raise ConfigError(f"unknown option(s) for {what}: {', '.join(sorted(unknown))} "
                          f"(known: {', '.join(sorted(allowed))})")
    num_returns(options.get("num_returns", 1), what)
    _generator.credits(options.get(_generator.BACKPRESSURE_OPTION), what)
    for key in ("max_restarts", "max_task_retries", "max_retries"):
        value = options.get(key, 0)
        if not _is_int(value, -1):
            raise ConfigError(f"{key} must be an int in [-1, {_INT_MAX}], got {value!r}")
    calls = options.get("max_calls")
    if calls is not None and not _is_int(calls, 0):
        raise ConfigError(f"max_calls must be an int in [0, {_INT_MAX}] (0: no limit), got {calls!r}")
    pending = options.get("max_pending_calls", -1)
    if isinstance(pending, bool) or not isinstance(pending, int) or pending == 0 or pending < -1:
        raise ConfigError(f"{what}: max_pending_calls must be -1 (no limit) or an int >= 1, got {pending!r}")
    concurrency = options.get("max_concurrency", 1)
    if not _is_int(concurrency, 1) or concurrency > _MAX_CONCURRENCY:
        raise ConfigError(f"max_concurrency must be an int in [1, {_MAX_CONCURRENCY}], got {concurrency!r}")
    _concurrency_groups(options, what)
    for key in ("num_cpus", "num_gpus", "memory"):
        _number(options.get(key, 0), key)
    for key, value in dict(options.get("resources") or {}).items():
        _number(value, f"resources[{key!r}]")
    _preload(options)
    _retry_kinds(options)
    lifetime = options.get("lifetime")
    if lifetime not in (None, "detached", "non_detached"):
        raise ConfigError(f"lifetime must be None, 'detached' or 'non_detached', got {lifetime!r}")


def _concurrency_groups(options, what):
    """An actor's concurrency_groups option, checked: {name: its
    max_concurrency}, as Ray's; the names in order (a call names its group
    by 1 + its place there)."""
    groups = options.get("concurrency_groups")
    if groups is None:
        return []
    if not isinstance(groups, dict):
        raise ConfigError(f"{what}: concurrency_groups must be a dict {{name: max_concurrency}}, "
                          f"got {type(groups).__name__}")
    if len(groups) > _core.MAX_CONCURRENCY_GROUPS:
        raise ConfigError(f"{what}: concurrency_groups has {len(groups)} groups, more than "
                          f"{_core.MAX_CONCURRENCY_GROUPS}")
    for name, cap in groups.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{what}: a concurrency group's name must be a non-empty str, got {name!r}")
        if not _is_int(cap, 1) or cap > _MAX_CONCURRENCY:
            raise ConfigError(f"{what}: concurrency group {name!r} must have a max_concurrency in "
                              f"[1, {_MAX_CONCURRENCY}], got {cap!r}")
    return list(groups)


def num_returns(value, what):
    """num_returns, checked: an int >= 0, or "streaming" (a generator's
    values as they are yielded: an ObjectRefGenerator)."""
    if isinstance(value, str) and value == "streaming":
        return value
    if not _is_int(value, 0) or value > _MAX_RETURNS:
        if isinstance(value, str) and value == "dynamic":
            raise ConfigError(f"{what}: num_returns='dynamic' (Ray's older generator API) is not supported; "
                              "use num_returns='streaming', a generator function's default, which returns an "
                              "ObjectRefGenerator")
        raise ConfigError(f"{what}: num_returns must be an int in [0, {_MAX_RETURNS}] or 'streaming', "
                          f"got {value!r}")
    return value


def is_generator_function(fn):
    """Whether calling `fn` makes a generator (sync or async): its calls
    stream unless a num_returns says otherwise."""
    return inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)


_METHOD_OPTIONS = ("concurrency_group", "max_task_retries", "num_returns", "retry_exceptions")


def method(**options):
    """@troupe.method(num_returns=N, concurrency_group="io",
    retry_exceptions=[...], max_task_retries=K) on an actor class's method,
    as Ray's @ray.method: the defaults of its calls' num_returns, concurrency
    group (one of the class's concurrency_groups), the exceptions it is run
    again on and how many times (for exceptions and, apart, for crashes; the
    actor's max_task_retries when not given)."""
    unknown = set(options) - set(_METHOD_OPTIONS)
    if unknown:
        raise ConfigError(f"troupe.method: unknown option(s) {', '.join(sorted(unknown))} "
                          f"(known: {', '.join(_METHOD_OPTIONS)})")
    group = options.get("concurrency_group")
    if group is not None and (not isinstance(group, str) or not group):
        raise ConfigError(f"troupe.method: concurrency_group must be a group's name, got {group!r}")
    retries = _method_retries_option(options, "troupe.method")
    kinds = _retry_kinds(options, "troupe.method")

    def mark(fn):
        if not callable(fn):
            raise TypeError(f"@troupe.method applies to methods, not to a {type(fn).__name__}")
        if "num_returns" in options:
            fn._troupe_num_returns = num_returns(options["num_returns"], f"method {fn.__qualname__}")
        if group is not None:
            fn._troupe_concurrency_group = group
        if "retry_exceptions" in options:
            fn._troupe_retry_exceptions = kinds
        if retries is not None:
            fn._troupe_max_task_retries = retries
        return fn

    return mark


def check_namespace(namespace, what):
    """A namespace given by the user (init, .options, get_actor): a
    non-empty string without the separator; the error names `what` and the
    value. None (not given) passes."""
    if namespace is None:
        return None
    if not isinstance(namespace, str) or not namespace:
        raise ConfigError(f"{what}: namespace must be a non-empty string (None for the default), got {namespace!r}")
    if NAMESPACE_SEPARATOR in namespace:
        raise ConfigError(f"{what}: namespace {namespace!r} contains {NAMESPACE_SEPARATOR!r}, which troupe keeps "
                          "to join a namespace and an actor name")
    return namespace


def check_actor_name(name, what):
    """An actor's name (.options(name=...), get_actor): not empty, no
    separator. None is no name; anything but a str is refused (b"x" was
    registered as "b'x'", 5 as "5", and 0 made an unnamed actor)."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{what}: an actor name must be a str, got {type(name).__name__} {name!r}")
    if name is not None and str(name) == "":
        raise ConfigError(f"{what}: an actor name must not be empty (leave name out for an unnamed actor)")
    if name and NAMESPACE_SEPARATOR in str(name):
        raise ConfigError(f"{what}: actor name {name!r} contains {NAMESPACE_SEPARATOR!r}, which troupe keeps to "
                          "join a namespace and a name; give the namespace with namespace=... instead")


def full_actor_name(name, namespace):
    """The head's key of actor `name` in `namespace` ("" = the default)."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def _retry_kinds(options, what=None):
    """retry_exceptions as Ray takes it: False (default), True (any
    Exception) or a list of exception classes; the classes to retry on, or
    None for none."""
    value = options.get("retry_exceptions", False)
    if value is False or value is None:
        return None
    if value is True:
        return (Exception,)
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(k, type) and issubclass(k, BaseException) for k in value):
        return tuple(value)
    where = f"{what}: " if what else ""
    raise ConfigError(f"{where}retry_exceptions must be a bool or a list of exception classes, got {value!r}")


def _method_retries_option(options, what):
    """An actor method's max_task_retries option (@troupe.method, a call's
    .options): an int >= -1 (-1: without limit), or None when not given."""
    value = options.get("max_task_retries")
    if value is not None and not _is_int(value, -1):
        raise ConfigError(f"{what}: max_task_retries must be an int in [-1, {_INT_MAX}], got {value!r}")
    return value


class _CallRetry:
    """What one actor call's .options(retry_exceptions=..., max_task_retries=...)
    asked, carried to the actor's worker in front of the call's arguments
    (which the worker takes off): `kinds` the exception classes to run the
    method again on (None: none; only when `kinds_given`, else the method's
    own @troupe.method), `retries` how many times (None: the method's, else
    the actor's)."""

    __slots__ = ("kinds_given", "kinds", "retries")

    def __init__(self, kinds_given, kinds, retries):
        self.kinds_given, self.kinds, self.retries = kinds_given, kinds, retries

    def __getstate__(self):
        return (self.kinds_given, self.kinds, self.retries)

    def __setstate__(self, state):
        self.kinds_given, self.kinds, self.retries = state


class _RetryOnError:
    """A task function that is run again, in the same worker, when it
    raises one of `kinds` (retry_exceptions), up to `retries` more times
    (max_retries; -1: without limit); the last error is the task's."""

    def __init__(self, fn, retries, kinds):
        self.fn = fn
        self.retries = retries
        self.kinds = kinds
        self.__qualname__ = getattr(fn, "__qualname__", "task")
        self.__name__ = getattr(fn, "__name__", "task")

    def __call__(self, *args, **kwargs):
        return self.attempts(lambda fn, a, kw: fn(*a, **kw), args, kwargs)

    def attempts(self, run, args, kwargs):
        """run(fn, args, kwargs) until it returns, or raises what is not
        retried; the worker's run settles an async def function's coroutine
        and collects a generator function's values inside it, so that what
        they raise is retried as a plain function's error is."""
        # Each attempt gets the arguments as they arrived, as in Ray (where
        # each attempt deserializes them): one that changed them before
        # raising must not hand its changes to the next.
        # Arrays and tensors pickle out of band as views of their memory:
        # the snapshot copies them, and each attempt gets copies of its own.
        data, buffers, refs = ser.dumps((args, kwargs))
        buffers = [bytes(b) for b in buffers]
        attempt = 0
        while True:
            try:
                return run(self.fn, args, kwargs)
            except self.kinds:
                if 0 <= self.retries <= attempt:
                    raise
                attempt += 1
                args, kwargs = ser.loads((data, [bytearray(b) for b in buffers], refs))


def _call_args(what, args, kwargs):
    """ser.call_args, with an argument that cannot be pickled named."""
    try:
        return ser.call_args(args, kwargs)
    except TroupeError:
        raise
    except Exception as e:  # whatever a __reduce__ of the argument's raises (it came bare, unnamed)
        culprit = "an argument"
        for i, a in enumerate(args):
            try:
                ser.dumps(a)
            except Exception:
                culprit = f"argument {i} (a {type(a).__name__})"
                break
        else:
            for k, v in kwargs.items():
                try:
                    ser.dumps(v)
                except Exception:
                    culprit = f"keyword argument {k!r} (a {type(v).__name__})"
                    break
        raise TypeError(f"{what}: {culprit} cannot be pickled: {type(e).__name__}: {e}") from e


# A task's max_retries when none is given, as Ray's: it runs again up to
# three times if its worker dies (and, with retry_exceptions, if it raises).
DEFAULT_TASK_RETRIES = 3
# The runtime's counts are 32-bit ints.
_INT_MAX = 2**31 - 1
# num_returns: a bound that no real call needs, so that a typo is an error
# and not a million refs.
_MAX_RETURNS = 10_000
# A worker runs one thread per concurrent call (the head checks it again).
_MAX_CONCURRENCY = _core.MAX_ACTOR_CONCURRENCY
# The max_concurrency of an actor class with async def methods when none is
# given: its calls wait on one event loop and should be able to overlap, as
# in Ray (which says 1000); here each call in flight holds a worker thread
# (started when needed), so fewer.
_ASYNC_MAX_CONCURRENCY = 100


def _has_async_methods(cls):
    # async generators too (Ray counts them): with one call slot, a second
    # stream of one never started while the first waited for its reader.
    return any(inspect.iscoroutinefunction(m) or inspect.isasyncgenfunction(m)
               for m in (getattr(cls, name, None) for name in dir(cls)))


def _is_int(value, least):
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= _INT_MAX


def _number(value, key):
    """A resource amount given as a number (its range is the runtime's
    check, which names the value)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise ConfigError(f"{key} must be a number, got {value!r}")


def _preload(options):
    """preload_modules (troupe's own option): module names, checked."""
    mods = options.get("preload_modules") or ()
    if isinstance(mods, str) or not all(isinstance(m, str) and _MODULE_NAME.fullmatch(m) for m in mods):
        raise ConfigError(f"preload_modules must be a list of module names, got {mods!r}")
    return tuple(mods)


# runtime_env's env_vars travel to a worker as its environment, one
# variable each (as Ray's), and their names under this one (a comma
# between), from which the worker's Python sets os.environ (a pooled
# worker's started before they came) and passes them on to the tasks and
# actors it starts. Names, not values: the kernel takes at most 128 KiB
# for one environment string, which the values together soon pass.
RUNTIME_ENV_VARS = "PYTROUPE_ENV_VARS"
# A value that references variables (${PATH}, $HOME) travels as
# TROUPE_ENV_TEMPLATE_<NAME> instead, and the worker expands it against its
# own environment (apply_env_vars): NAME keeps the node's value for the
# reference meanwhile, and a TROUPE_ variable makes the node agent start a
# worker for it from exec (never a pooled one), where troupe.worker expands
# it before anything reads it.
ENV_TEMPLATE = "TROUPE_ENV_TEMPLATE_"
# Set by the worker once it expanded them: a worker that execs itself
# again with them (troupe.worker) does not expand them twice.
_ENV_EXPANDED = "TROUPE_ENV_EXPANDED"
# Variables that the loader, libc or the interpreter read when a process
# starts: a worker that expands one of them execs itself again with it.
_READ_AT_EXEC = ("LD_", "GLIBC_TUNABLES", "MALLOC_", "PYTHON")
# One environment string, its NUL included: the kernel's MAX_ARG_STRLEN.
_MAX_ENV_STRING = 128 << 10
# All env_vars of a worker together: an exec's arguments and environment
# take at most ARG_MAX (2 MiB with the usual 8 MiB stack), and the node's
# own environment and troupe's variables need the rest.
MAX_ENV_VARS_BYTES = 1 << 20
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# References as Ray's runtime_env expands them (os.path.expandvars, then an
# unset ${NAME} of capitals, digits and _ becomes empty).
_REFERENCE = re.compile(r"\$(\w+|\{[^}]*\})", re.ASCII)
_UNSET_REFERENCE = re.compile(r"\$\{[A-Z0-9_]+\}")


_RUNTIME_ENV_KEYS = ("env_vars", "working_dir", "py_modules", "excludes", "pip")


class RuntimeEnv:
    """A runtime_env option, checked: env_vars; working_dir and py_modules
    as absolute local paths (None: not given); excludes; pip as the
    canonical JSON of troupe/_pip.py (None: not given)."""

    def __init__(self, env_vars=None, working_dir=None, py_modules=None, excludes=(), pip=None):
        self.env_vars = env_vars or {}
        self.working_dir = working_dir
        self.py_modules = py_modules
        self.excludes = excludes
        self.pip = pip

    def packages(self, client, inherited):
        """(working_dir, py_modules) package ids: this env's, uploaded to
        `client`'s cluster, over the `inherited` ones (the job's, or the
        starting worker's) where it gives them."""
        working_dir, py_modules = inherited
        def upload(path, kind):
            return _package_id(path) or _packages.upload(client, path, kind, self.excludes)

        if self.working_dir is not None:
            working_dir = upload(self.working_dir, "working_dir")
        if self.py_modules is not None:
            py_modules = tuple(upload(p, "py_modules") for p in self.py_modules)
        return working_dir, py_modules


def _local_path(value, what, key):
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{what}: runtime_env {key} must be a local path, got {value!r}")
    if _package_id(value):
        return value  # a package already uploaded (get_runtime_context().runtime_env names them so)
    if "://" in value:
        raise ConfigError(f"{what}: runtime_env {key} {value!r} is a URI; troupe packs local paths only")
    return os.path.abspath(value)


PACKAGE_URI = "troupe_pkg://"


def _package_id(value):
    """The package id a troupe_pkg://<sha256> URI names, else None."""
    if isinstance(value, str) and value.startswith(PACKAGE_URI):
        package = value[len(PACKAGE_URI):]
        if len(package) == 64 and all(c in "0123456789abcdef" for c in package):
            return package
    return None


def _module_path(value, what):
    """A py_modules entry: a path, or an imported module (its package
    directory, or its file)."""
    if isinstance(value, types.ModuleType):
        paths = list(getattr(value, "__path__", []) or [])
        if paths:
            return os.path.abspath(paths[0])
        if getattr(value, "__file__", None):
            return os.path.abspath(value.__file__)
        raise ConfigError(f"{what}: runtime_env py_modules: module {value.__name__} has no file to pack")
    return _local_path(value, what, "py_modules")


# The job's runtime_env from `troupe submit --runtime-env-json` (JSON).
SUBMITTED_RUNTIME_ENV = "TROUPE_RUNTIME_ENV"


def with_submitted_runtime_env(runtime_env):
    """`runtime_env` (troupe.init's) over the one `troupe submit` gave the
    driver, key by key (env_vars merged by name); `runtime_env` as it is
    when none was given, or either is no dict (parse_runtime_env names
    that)."""
    text = os.environ.get(SUBMITTED_RUNTIME_ENV)
    if not text:
        return runtime_env
    try:
        submitted = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{SUBMITTED_RUNTIME_ENV} (troupe submit --runtime-env-json) is not JSON: {e}") from None
    if not isinstance(submitted, dict):
        raise ConfigError(f"{SUBMITTED_RUNTIME_ENV} (troupe submit --runtime-env-json) must be a JSON object, "
                          f"got {text!r}")
    if runtime_env is None:
        return submitted
    if not isinstance(runtime_env, dict):
        return runtime_env
    merged = {**submitted, **runtime_env}
    if isinstance(submitted.get("env_vars"), dict) and isinstance(runtime_env.get("env_vars"), dict):
        merged["env_vars"] = {**submitted["env_vars"], **runtime_env["env_vars"]}
    return merged


def parse_runtime_env(runtime_env, what):
    """A runtime_env option as a RuntimeEnv (empty for None), checked: troupe
    takes Ray's env_vars, working_dir, py_modules, excludes and pip, and
    refuses any other key by name."""
    if runtime_env is None:
        return RuntimeEnv()
    if not isinstance(runtime_env, dict):
        raise ConfigError(f"{what}: runtime_env must be a dict such as {{'env_vars': {{...}}}}, "
                          f"got a {type(runtime_env).__name__}")
    for key in runtime_env:
        if key not in _RUNTIME_ENV_KEYS:
            raise ConfigError(f"{what}: runtime_env key {key!r} is not supported (troupe takes "
                              f"{', '.join(_RUNTIME_ENV_KEYS)})")
    env_vars = _checked_env_vars(runtime_env.get("env_vars") or {}, what)
    working_dir = runtime_env.get("working_dir")
    if working_dir is not None:
        working_dir = _local_path(working_dir, what, "working_dir")
        if not _package_id(working_dir) and not os.path.isdir(working_dir):
            raise ConfigError(f"{what}: runtime_env working_dir {working_dir!r} is not a directory")
    py_modules = runtime_env.get("py_modules")
    if py_modules is not None:
        if not isinstance(py_modules, (list, tuple)):
            raise ConfigError(f"{what}: runtime_env py_modules must be a list of paths or modules, "
                              f"got a {type(py_modules).__name__}")
        py_modules = tuple(_module_path(m, what) for m in py_modules)
        for path in py_modules:
            if not (os.path.isdir(path) or (os.path.isfile(path) and path.endswith(".py"))):
                raise ConfigError(f"{what}: runtime_env py_modules: {path!r} is not a directory or a .py file")
    excludes = runtime_env.get("excludes") or ()
    if not isinstance(excludes, (list, tuple)) or not all(isinstance(e, str) for e in excludes):
        raise ConfigError(f"{what}: runtime_env excludes must be a list of patterns (str), got {excludes!r}")
    if excludes and working_dir is None and py_modules is None:
        raise ConfigError(f"{what}: runtime_env excludes applies to the working_dir and py_modules of the same "
                          "runtime_env, and this one has neither")
    pip = _pip.parse(runtime_env["pip"], what) if runtime_env.get("pip") is not None else None
    return RuntimeEnv(env_vars, working_dir, py_modules, tuple(excludes), pip)


def _checked_env_vars(env_vars, what):
    if not isinstance(env_vars, dict):
        raise ConfigError(f"{what}: runtime_env env_vars must be a dict of str to str, "
                          f"got a {type(env_vars).__name__}")
    for name, value in env_vars.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise ConfigError(f"{what}: runtime_env env_vars: {name!r} is not an environment variable name")
        if name.startswith(("TROUPE_", "PYTROUPE_")):
            raise ConfigError(f"{what}: runtime_env env_vars: {name} is troupe's own variable")
        if not isinstance(value, str):
            raise ConfigError(f"{what}: runtime_env env_vars[{name!r}] must be a str, "
                              f"got a {type(value).__name__} ({value!r})")
        if "\0" in value:
            raise ConfigError(f"{what}: runtime_env env_vars[{name!r}] holds a NUL character")
        entry = _env_entry(name, value)
        if _env_bytes(entry) > _MAX_ENV_STRING:
            raise ConfigError(f"{what}: runtime_env env_vars[{name!r}] takes {_env_bytes(entry)} bytes as an "
                              f"environment string ({entry.partition('=')[0]}=...); the kernel takes at most "
                              f"{_MAX_ENV_STRING} (128 KiB) for one (MAX_ARG_STRLEN)")
    check_env_vars_size(env_vars, what)
    return dict(env_vars)


def _env_entry(name, value):
    """The worker environment string that carries env_vars[name]: a value
    with a reference in it as a template for the worker to expand."""
    return f"{ENV_TEMPLATE}{name}={value}" if "$" in value else f"{name}={value}"


def _env_bytes(entry):
    return len(entry.encode("utf-8", "surrogatepass")) + 1  # its NUL


def check_env_vars_size(env_vars, what):
    """ConfigError naming the sizes when `env_vars` (a worker's, all of
    them) would not fit into an exec's environment, which a worker may be
    started with at any time (one from the pool is not always there)."""
    names = f"{RUNTIME_ENV_VARS}={','.join(env_vars)}"
    if _env_bytes(names) > _MAX_ENV_STRING:
        raise ConfigError(f"{what}: runtime_env env_vars: the names of its {len(env_vars)} variables take "
                          f"{_packages._size(_env_bytes(names))} together ({RUNTIME_ENV_VARS}); the kernel takes "
                          f"at most {_packages._size(_MAX_ENV_STRING)} for one environment string")
    # Each string, its NUL and its pointer in the exec's environment.
    sizes = {name: _env_bytes(_env_entry(name, value)) + 8 for name, value in env_vars.items()}
    total = sum(sizes.values()) + _env_bytes(names) + 8
    if total > MAX_ENV_VARS_BYTES:
        largest = ", ".join(f"{name} ({_packages._size(sizes[name])})"
                            for name in sorted(sizes, key=lambda n: (-sizes[n], n))[:3])
        raise ConfigError(f"{what}: runtime_env env_vars take {_packages._size(total)} in all, over the "
                          f"{_packages._size(MAX_ENV_VARS_BYTES)} a worker's environment may hold of them (an "
                          "exec's arguments and environment together take at most 2 MiB by default); the "
                          f"largest: {largest}")


def _expand(value, env):
    """`value` with its references replaced from `env`, as Ray's runtime_env
    does: $NAME and ${NAME} by NAME's value where it is set, then an unset
    ${NAME} of capitals, digits and _ by nothing (any other stays as
    written)."""
    def value_of(match):
        name = match.group(1)
        if name.startswith("{") and name.endswith("}"):
            name = name[1:-1]
        return env.get(name, match.group(0))

    return _UNSET_REFERENCE.sub("", _REFERENCE.sub(value_of, value))


# This worker's env_vars by the PYTROUPE_ENV_VARS that named them: (as
# given, as set). Read once, before any task or constructor ran: what a
# task made of os.environ since is no part of them.
_env_vars_read = {}
_env_vars_lock = threading.Lock()


def _read_env_vars():
    """(given, applied, exec_again) of this worker's env_vars: as its
    runtime_env gave them (a template as written), as set in its
    environment (templates expanded, here the first time), and whether an
    expanded one is read at a process's start (_READ_AT_EXEC)."""
    names = _core.getenv(RUNTIME_ENV_VARS)
    with _env_vars_lock:
        if names in _env_vars_read:
            return _env_vars_read[names]
        given, templates = {}, {}
        for name in filter(None, names.split(",")):
            template = _core.getenv(ENV_TEMPLATE + name)
            given[name] = template or _core.getenv(name)
            if template:
                templates[name] = template
        applied = {name: _core.getenv(name) for name in given}
        exec_again = False
        if templates and not _core.getenv(_ENV_EXPANDED):
            # As Ray's: in name order, each against the environment as
            # the ones before left it (the others are there already).
            env = dict(os.environ)
            env.update((name, value) for name, value in applied.items() if name not in templates)
            for name in sorted(templates):
                env[name] = applied[name] = _expand(templates[name], env)
                os.environ[name] = applied[name]
            os.environ[_ENV_EXPANDED] = "1"
            exec_again = any(name.startswith(_READ_AT_EXEC) for name in templates)
        _env_vars_read[names] = (given, applied, exec_again)
        return _env_vars_read[names]


def apply_env_vars():
    """In a worker: os.environ holds its env_vars, those that reference
    variables expanded against its environment. True when one of those is
    read at a process's start (LD_LIBRARY_PATH, PYTHONPATH, ...), so that
    the worker, just started, should exec itself again with it."""
    _, applied, exec_again = _read_env_vars()
    os.environ.update(applied)  # an empty value included
    return exec_again


def inherited_env_vars():
    """The env_vars this worker was started with, which the tasks and
    actors it starts inherit (as in Ray): references as written, which
    their worker expands against its own environment."""
    return dict(_read_env_vars()[0])


def task_max_calls(options):
    """Tasks a worker runs before it exits (Ray's max_calls): as given, or
    as Ray's default, 1 for a task that asks for GPUs (a new process gives
    back what a library kept on the GPU) and no limit (0) otherwise."""
    calls = options.get("max_calls")
    if calls is None:
        return 1 if options.get("num_gpus") else 0
    return calls


def _runtime_options(options, default_cpus):
    """Ray's options -> the runtime's (resources, restarts, the worker)."""
    resources = {}
    for k, v in dict(options.get("resources") or {}).items():
        if k in ("CPU", "GPU", "memory"):
            raise ConfigError(f"use num_cpus/num_gpus/memory, not resources={{'{k}': ...}}")
        resources[str(k)] = float(v)
    cpus = options.get("num_cpus", default_cpus)
    if cpus:
        resources["CPU"] = float(cpus)
    elif "num_cpus" in options and not resources and not options.get("num_gpus") and default_cpus:
        # A task asked for num_cpus=0: said as such, so that such tasks are
        # not held to the CPU count (the task submitter's zero request).
        resources["CPU"] = 0.0
    if options.get("num_gpus"):
        resources["GPU"] = float(options["num_gpus"])
    if options.get("memory"):
        # Bytes of the node's "memory" resource, as Ray's: the scheduler
        # counts it, nothing enforces it.
        resources["memory"] = float(int(options["memory"]))  # whole bytes, rounded down as Ray's
    out = {
        "resources": resources,
        "executable": worker_executable(_preload(options)),
        "max_restarts": options.get("max_restarts", 0),
        "max_task_retries": options.get("max_task_retries", 0),
        "max_retries": options.get("max_retries", DEFAULT_TASK_RETRIES),
        "max_concurrency": options.get("max_concurrency", 1),
    }
    if options.get("concurrency_groups"):
        out["concurrency_groups"] = [(name, int(cap)) for name, cap in options["concurrency_groups"].items()]
    if options.get("name"):
        out["name"] = str(options["name"])
    placement = _placement(options)
    capture = placement.pop("capture", False)
    out.update(placement)
    if options.get("lifetime") == "detached":
        out["detached"] = True  # outlives this driver (the head gives it no owner)
    import troupe

    # Tasks and actors run in their driver's job and namespace (nested
    # ones too: a worker's state has its driver's).
    state = troupe._state
    env = []
    if state and state.job_id:
        env.append(f"PYTROUPE_JOB_ID={state.job_id}")
    if state and state.namespace:
        env.append(f"PYTROUPE_NAMESPACE={state.namespace}")
    if capture:
        # Its children (and theirs) go to the same group unless told otherwise.
        env.append(f"{CAPTURE_ENV}={out['placement_group']}")
    # The job's (or the starting worker's) env_vars, and on top those of
    # this task's or actor's runtime_env, as Ray merges them.
    runtime_env = parse_runtime_env(options.get("runtime_env"), "runtime_env option")
    env_vars = dict(state.env_vars) if state else {}
    env_vars.update(runtime_env.env_vars)
    if env_vars:
        check_env_vars_size(env_vars, "runtime_env option (with the env_vars it inherits)")
        env.append(f"{RUNTIME_ENV_VARS}={','.join(sorted(env_vars))}")
        env.extend(_env_entry(name, value) for name, value in sorted(env_vars.items()))
    # Its working_dir and py_modules (packages in the cluster's KV store),
    # or those of the job or the starting worker.
    inherited = state.packages if state else (None, ())
    env.extend(_packages.environment(*runtime_env.packages(_client(), inherited)))
    # Its pip packages, or those of the job or the starting worker.
    env.extend(_pip.environment(runtime_env.pip if runtime_env.pip is not None else (state.pip if state else None)))
    if env:
        out["env"] = env
    return out


def _placement(options):
    """The placement group and bundle of `options` ({} = none)."""
    from troupe.util.placement_group import PlacementGroup
    from troupe.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    strategy = options.get("scheduling_strategy")
    pg = options.get("placement_group")
    index = options.get("placement_group_bundle_index", -1)
    if isinstance(strategy, NodeAffinitySchedulingStrategy):
        if pg is not None:
            raise ConfigError("give either a NodeAffinitySchedulingStrategy or placement_group, not both")
        return {"node_affinity": int(strategy.node_id), "affinity_soft": strategy.soft}
    if isinstance(strategy, PlacementGroupSchedulingStrategy):
        if pg is not None:
            raise ConfigError("give either scheduling_strategy or placement_group, not both")
        pg, index = strategy.placement_group, strategy.placement_group_bundle_index
    elif strategy not in (None, "DEFAULT", "SPREAD"):
        raise ConfigError(f"scheduling_strategy {strategy!r} is not supported (known: 'DEFAULT', 'SPREAD', "
                          "PlacementGroupSchedulingStrategy, NodeAffinitySchedulingStrategy)")
    if pg is None and strategy is None and "placement_group" not in options:
        # Inside a task or actor whose group captures its children (Ray's
        # placement_group_capture_child_tasks): in that group, any bundle.
        captured = _captured_group()
        if captured:
            return {"placement_group": int(captured), "bundle_index": -1, "capture": True}
    if pg is None or pg == "default":
        return {}
    if not isinstance(pg, PlacementGroup):
        raise ConfigError(f"placement_group must be a PlacementGroup, got a {type(pg).__name__}")
    if not _is_int(index, -1):
        raise ConfigError(f"placement_group_bundle_index must be an int in [-1, {_INT_MAX}], got {index!r}")
    from troupe.util.placement_group import _client_of

    _client_of(pg)
    capture = bool(getattr(strategy, "placement_group_capture_child_tasks", False)
                   or options.get("placement_group_capture_child_tasks"))
    return {"placement_group": pg.id, "bundle_index": index, "capture": capture}


def _captured_group():
    """The placement group id that captures what this worker starts, or
    None: read from the worker's own environment, never from os.environ,
    so that a process it starts (a driver of its own) is not captured."""
    if not _core.in_worker():
        return None
    return _core.getenv(CAPTURE_ENV) or None


def function_reference(client_id, fn_hash):
    """The key by which client `client_id` holds task function `fn_hash`:
    the head erases the function once the last such key goes, each with
    its client (as a runtime_env package's)."""
    return f"troupe.client/{client_id}/ref/{_FUNCTION_KEY}{fn_hash}"


def export_function(client, fn_hash, blob):
    """Stores a task function on `client`'s cluster for as long as this
    client, or another that stored the same one, is connected."""
    # Held first: a function whose last holder goes meanwhile is then either
    # still there when a worker looks for it, or stored again.
    client.kv_put(function_reference(client.client_id, fn_hash), b"")
    client.kv_put(_FUNCTION_KEY + fn_hash, blob)


def _signature(fn, drop_first=False):
    """fn's signature (without its first parameter: a method's self), for
    checking a call's arguments at .remote(); None when Python cannot tell
    it (a builtin), and then nothing is checked."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if drop_first:
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return sig


def _check_arguments(sig, what, args, kwargs):
    """A TypeError at .remote(), as Ray raises it, for a call whose
    arguments the function cannot take (it failed only at get)."""
    if sig is None:
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{what}: {e}") from None


@functools.lru_cache(maxsize=1024)
def _method_signatures(cls):
    """{method: its signature without self} of an actor class's methods."""
    out = {}
    for name in _method_table(cls)[1]:
        for klass in cls.__mro__:
            if name in vars(klass):
                raw = vars(klass)[name]
                fn = getattr(cls, name)
                out[name] = _signature(fn, drop_first=inspect.isfunction(raw))
                break
    return out


class RemoteFunction:
    """A function decorated with @troupe.remote; f.remote(...) runs it as a
    task and returns an ObjectRef (a generator function: an
    ObjectRefGenerator)."""

    def __init__(self, fn, options, shared=None):
        _check_options(options, _TASK_OPTIONS, f"task {fn.__qualname__}")
        self._fn = fn
        self._options = options
        # The pickled function and its hash, shared by every .options() copy.
        self._shared = shared if shared is not None else {}
        self._key = None
        self._key_client = None
        self._num_returns = options.get("num_returns", "streaming" if is_generator_function(fn) else 1)
        if self._num_returns == "streaming" and _retry_kinds(options) is not None:
            raise ConfigError(f"task {fn.__qualname__}: retry_exceptions does not apply to a streaming generator "
                              "(its values already handed out cannot be taken back)")
        self._credits = _generator.credits(options.get(_generator.BACKPRESSURE_OPTION), f"task {fn.__qualname__}")
        self._sig = _signature(fn)
        self.__name__ = getattr(fn, "__name__", "task")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args, **kwargs):
        raise TypeError(f"remote function {self.__name__} cannot be called directly: use {self.__name__}.remote()")

    def __getstate__(self):
        # What travels when a task or actor that calls this function is
        # pickled: the function and its options; the session's key and
        # client stay here (a worker makes its own on first use).
        return {"fn": self._fn, "options": self._options}

    def __setstate__(self, state):
        self.__init__(state["fn"], state["options"])

    def options(self, **options):
        merged = {**self._options, **options}
        # The pickled function is shared unless what is shipped differs.
        retry = ("retry_exceptions", "max_retries")
        same = all(merged.get(k) == self._options.get(k) for k in retry)
        return RemoteFunction(self._fn, merged, self._shared if same else None)

    def _prepare(self, client):
        shared = self._shared
        if "hash" not in shared:
            kinds = _retry_kinds(self._options)
            shipped = self._fn if kinds is None else _RetryOnError(self._fn, self._options.get("max_retries", DEFAULT_TASK_RETRIES),
                                                                      kinds)
            blob = ser.dumps_code(shipped)
            if len(blob) > _core.HEAD_VALUE_LIMIT:
                # The head's message limit: more would cost the connection.
                raise ConfigError(f"task {self.__name__}: the function pickles to {len(blob)} bytes with what it "
                                  f"captures, more than the {_core.HEAD_VALUE_LIMIT} the cluster's function table "
                                  "takes; pass large values as arguments or troupe.put() refs")
            shared["blob"] = blob
            shared["hash"] = hashlib.sha256(blob).hexdigest()[:32]
        # By the cluster's address and token, not id(client): a later
        # session's client may be given the id of one that is gone. And by
        # the client: a new session's is a new holder.
        exported = shared.setdefault("exported", set())
        holder = (client.address, client.token, client.client_id)
        if holder not in exported:
            export_function(client, shared["hash"], shared["blob"])
            exported.add(holder)
        options = _runtime_options(self._options, 1)
        options["max_calls"] = task_max_calls(self._options)
        options.setdefault("name", self.__name__)
        if self._num_returns == "streaming":
            # The generator retries itself (ObjectRefGenerator), skipping
            # what it handed out; the runtime's resend would not.
            self._stream_retries = options["max_retries"]
            options["max_retries"] = 0
        self._key = client.task_key(options)
        self._key_client = client

    def remote(self, *args, **kwargs):
        client = _client_or_init()
        _check_arguments(self._sig, f"task {self.__name__}", args, kwargs)
        if self._key_client is not client:
            self._prepare(client)
        data, top = _call_args(f"task {self.__name__}", args, kwargs)
        if self._num_returns == "streaming":
            key, fn_hash, credits = self._key, self._shared["hash"], self._credits

            def start(skip):
                stream = client.stream(credits)
                done = client.submit(key, fn_hash, data, top, stream, skip)
                stream.watch(done)
                return stream, done

            return _generator.ObjectRefGenerator(start, self._stream_retries, f"task {self.__name__}")
        ref = client.submit(self._key, self._shared["hash"], data, top)
        hooks = sys.modules.get("troupe._worker_hooks")
        if hooks is not None:
            hooks.note_child(ref)  # for a recursive cancel of the task or method running here
        return ref if self._num_returns == 1 else ser.items(ref, self._num_returns, f"task {self.__name__}")


class ActorMethod:
    # Not the handle itself: a handle caches its methods, and a cycle would
    # keep an actor that went out of scope alive until Python's cycle GC.
    __slots__ = ("_actor", "_client", "_lifetime", "_name", "_num_returns", "_credits", "_pending", "_groups",
                 "_group", "_sig", "_retries", "_retry")

    def __init__(self, handle, name, num_returns=1, group=None, retries=None):
        self._actor = handle._actor
        self._client = handle._client
        self._lifetime = handle._lifetime
        self._name = name
        self._num_returns = num_returns
        self._credits = _generator.DEFAULT_CREDITS
        self._pending = handle._pending
        # The actor's concurrency groups by name (None: not known to this
        # handle), and the number of this method's (0: the default group).
        table = handle._table
        self._groups = table[3] if table is not None else None
        self._group = self._group_number(group) if group is not None else 0
        signatures = handle.__dict__.get("_signatures")
        self._sig = signatures.get(name) if signatures else None
        # Its max_task_retries (@troupe.method's, a call's .options'; None:
        # the actor's): how often a call lost with the actor's worker is
        # sent again. `_retry`, a _CallRetry, is what a call's .options
        # asked of the retries on exceptions, sent along with the call.
        self._retries = retries
        self._retry = None

    def _group_number(self, group):
        """A group's number in the calls' op: 1 + its place among the
        actor's concurrency groups."""
        what = f"actor method {self._name}"
        if self._groups is None:
            raise ConfigError(f"{what}: concurrency_group={group!r}, but this handle does not know the actor's "
                              "concurrency groups (a handle found by id); use one from the actor's creator or "
                              "troupe.get_actor")
        if group not in self._groups:
            known = ", ".join(repr(g) for g in self._groups) or "none"
            raise ConfigError(f"{what}: concurrency_group={group!r} is not one of the actor's concurrency groups "
                              f"({known})")
        return 1 + self._groups.index(group)

    def remote(self, *args, **kwargs):
        import troupe

        client = self._client
        if client is not troupe._current_client():  # the message only when needed
            client = _session_client(self, f"{self._name}.remote()")
        _check_arguments(self._sig, f"actor method {self._name}", args, kwargs)
        if self._retry is not None:
            args = (self._retry,) + args
        data, top = _call_args(f"actor method {self._name}", args, kwargs)
        if self._pending is None:
            return self._send(client, data, top)[0]
        with self._pending.lock:
            self._pending.make_room(client, f"actor method {self._name}", self._actor.id)
            result, call = self._send(client, data, top)
            self._pending.calls.append(call)
        return result

    def _send(self, client, data, top):
        """(what .remote() returns, the ref of the call itself)."""
        if self._num_returns == "streaming":
            generator = self._stream(client, data, top)
            return generator, generator.completed()
        ref = client.call(self._actor, self._name, data, top, self._lifetime, group=self._group,
                          retries=self._retries)
        if self._num_returns == 1:
            return ref, ref
        return ser.items(ref, self._num_returns, f"actor method {self._name}"), ref

    def _stream(self, client, data, top):
        """A streaming call (a generator method): its ObjectRefGenerator.
        As in Ray, a call whose actor died is made again once the actor has
        restarted, up to the actor's max_task_retries, past the values
        already handed out (the runtime never resends a streaming call
        itself: its stream takes one writer)."""
        actor, name, lifetime, credits, group = self._actor, self._name, self._lifetime, self._credits, self._group

        def start(skip):
            stream = client.stream(credits)
            done = client.call(actor, name, data, top, lifetime, stream, skip, group)
            stream.watch(done)
            return stream, done

        retries = self._retries if self._retries is not None else actor.info().get("max_task_retries", 0)
        return _generator.ObjectRefGenerator(start, retries, f"actor method {name}",
                                             _generator.actor_restarting(actor))

    def options(self, **options):
        """Ray's per-call options: `name` (a label), num_returns,
        concurrency_group, retry_exceptions, max_task_retries and
        _generator_backpressure_num_objects are taken; any other is refused
        rather than ignored."""
        count, credits, group = self._num_returns, self._credits, self._group
        what = f"actor method {self._name}"
        for key, value in options.items():
            if key == "num_returns":
                count = num_returns(value, what)
            elif key == _generator.BACKPRESSURE_OPTION:
                credits = _generator.credits(value, what)
            elif key == "concurrency_group":
                group = self._group_number(value)
            elif key not in ("name", "retry_exceptions", "max_task_retries"):
                raise ConfigError(f"{what}: option {key}={value!r} is not supported (per-call options are "
                                  "name, num_returns, concurrency_group, retry_exceptions, max_task_retries and "
                                  f"{_generator.BACKPRESSURE_OPTION})")
        retries = _method_retries_option(options, what)
        retry = self._retry
        if "retry_exceptions" in options or retries is not None:
            given = "retry_exceptions" in options
            kinds = _retry_kinds(options, what) if given else None
            if retry is not None:  # options(...).options(...): the later wins, key by key
                given, kinds = (True, kinds) if given else (retry.kinds_given, retry.kinds)
                retries = retries if retries is not None else retry.retries
            retry = _CallRetry(given, kinds, retries)
        copy = ActorMethod.__new__(ActorMethod)
        copy._actor, copy._client, copy._lifetime, copy._name = self._actor, self._client, self._lifetime, self._name
        copy._num_returns, copy._credits, copy._pending = count, credits, self._pending
        copy._groups, copy._group, copy._sig = self._groups, group, self._sig
        copy._retries = retries if retries is not None else self._retries
        copy._retry = retry
        return copy

    def __call__(self, *args, **kwargs):
        raise TypeError(f"actor method {self._name} cannot be called directly: use .{self._name}.remote()")


# Methods every actor has (troupe._worker_hooks.BUILTIN_METHODS).
_BUILTIN_METHODS = ("__ray_ready__", "__ray_terminate__", "__ray_call__")

# Special methods an actor class may define that are never its remote
# methods: how its instances are made, ended and copied. Python and pickle
# look these up on a handle, and must not find an ActorMethod there.
_NOT_REMOTE = frozenset({
    "__init__", "__new__", "__del__", "__init_subclass__", "__subclasshook__", "__class_getitem__",
    "__getattr__", "__getattribute__", "__setattr__", "__delattr__", "__dir__", "__reduce__", "__reduce_ex__",
    "__getstate__", "__setstate__", "__getnewargs__", "__getnewargs_ex__", "__copy__", "__deepcopy__",
    "__repr__", "__str__", "__format__", "__sizeof__", "__hash__", "__eq__", "__ne__",
    # What libraries probe any object for with hasattr (is it iterable, an
    # array, a tensor): a handle is none of these, whatever its class is.
    "__iter__", "__next__", "__aiter__", "__anext__", "__await__", "__array__", "__array_interface__",
    "__array_struct__", "__array_ufunc__", "__array_function__", "__array_priority__", "__dlpack__",
    "__dlpack_device__", "__cuda_array_interface__", "__torch_function__",
})


def _remote_dunder(cls, name):
    """Whether `name`, a special method, is one of the class's remote methods
    (as Ray's actor.__call__.remote()): one the class or a base other than
    object defines as a function."""
    if name in _NOT_REMOTE:
        return False
    for klass in cls.__mro__:
        if klass is object:
            return False
        if name in vars(klass):
            return inspect.isfunction(vars(klass)[name])
    return False


class _Id(int):
    """An id as Ray's ID objects are used: an int, with hex() giving the
    string form troupe's runtime context uses."""

    def hex(self):
        return str(int(self))


class ActorHandle:
    """A handle to an actor: handle.method.remote(...) returns an ObjectRef.
    Calls from one caller run in the order sent."""

    def __init__(self, actor, cls, client, lifetime=None, table=None, max_pending_calls=-1, groups=()):
        self._actor = actor
        self._client = client
        # Ray's max_pending_calls: this handle's calls under way, at most
        # that many (None: no limit). Not carried by copies or pickles.
        self._pending = _PendingCalls(max_pending_calls) if max_pending_calls > 0 else None
        # The actor's lifetime ref (client.actor_lifetime) when its creator
        # ends it once no handle is left anywhere; None for detached and
        # named actors and for handles found by name or id.
        self._lifetime = lifetime
        # The class's name, its methods' num_returns defaults and
        # concurrency groups by name (_method_table), and the actor's
        # concurrency groups: what a handle pickled into another process
        # takes along; None for a handle found by id, which checks nothing.
        self._table = _method_table(cls) + (list(groups), _method_retries(cls)) if cls is not None else table
        # Its methods' signatures, where the class is known here (not carried
        # by copies or pickles: the actor checks those calls itself).
        self._signatures = _method_signatures(cls) if cls is not None else None
        self._methods = {}

    def __getattr__(self, name):
        builtin = name in _BUILTIN_METHODS
        if name.startswith("__") and not builtin:
            # Only a special method the class defines (handle.__call__.remote()):
            # Python's protocols probe others on any object.
            table = self.__dict__.get("_table")
            if name in _NOT_REMOTE or table is None or name not in table[1]:
                raise AttributeError(name)
        methods = self.__dict__["_methods"]
        m = methods.get(name)
        if m is None:
            table = self.__dict__["_table"]
            if table is not None and name not in table[1] and not builtin:
                raise AttributeError(f"actor class {table[0]} has no method {name!r}")
            returns = table[1][name] if table is not None and not builtin else 1
            group = table[2].get(name) if table is not None and not builtin else None
            retries = table[4].get(name) if table is not None and not builtin else None
            m = methods[name] = ActorMethod(self, name, returns, group, retries)
        return m

    @property
    def _actor_id(self):
        """Ray's ActorHandle._actor_id: the actor's id (.hex() is the
        string get_runtime_context().get_actor_id() gives inside it)."""
        return _Id(self._actor.id)

    def __repr__(self):
        import troupe

        # The client's last view of the actor (no round trip): after
        # shutdown it is what the cluster said before it went away.
        info = self._actor.info()
        state = "session shut down" if troupe._is_stale(self._client) else info["state"]
        return f"ActorHandle({info['class_name']}, id={info['id']}, {state})"

    # Handles of one actor are equal and hash alike, as Ray's (by the
    # actor's id, in one session: another session numbers its actors from 1
    # again): a handle sent through a task and back, or found by name, is
    # the same key in a dict or set.
    def __eq__(self, other):
        if not isinstance(other, ActorHandle):
            return NotImplemented
        return self._actor.id == other._actor.id and self._client is other._client

    def __hash__(self):
        return hash(("troupe.ActorHandle", self._actor.id))

    def __copy__(self):
        # A copy holds the actor as the original does.
        return ActorHandle(self._actor, None, self._client, self._lifetime, self._table)

    def __deepcopy__(self, memo):
        return self.__copy__()

    def __reduce__(self):
        # The id travels: in another session it would name another actor.
        # So does the lifetime ref, when troupe pickles the handle (a copy
        # pickled elsewhere does not keep the actor alive).
        _session_client(self, "pickling its handle")
        lifetime = self._lifetime if self._lifetime is not None and ser.pickling_refs() else None
        return _handle_by_id, (self._actor.id, lifetime, self._table)


class _PendingCalls:
    """The calls under way through one actor handle, at most `limit`."""

    def __init__(self, limit):
        self.limit = limit
        self.calls = []  # their refs, oldest first
        # Held from the count to the append: two threads cannot both take
        # the last place.
        self.lock = threading.Lock()

    def make_room(self, client, what, actor_id):
        """Drops the calls that ended; PendingCallsLimitExceeded when
        `limit` are still under way."""
        if len(self.calls) < self.limit:
            return
        ended = set(client.wait([ser.parent(r) for r in self.calls], [], len(self.calls), 0.0))
        self.calls = [r for i, r in enumerate(self.calls) if i not in ended]
        if len(self.calls) >= self.limit:
            from troupe.exceptions import PendingCallsLimitExceeded

            raise PendingCallsLimitExceeded(
                f"{what} was not sent to actor {actor_id}: {len(self.calls)} calls through this handle are under "
                f"way, its max_pending_calls={self.limit}; wait for some (troupe.get/troupe.wait) and call again")


def _session_client(handle, what):
    """The client of `handle`, if its session is the current one; else the
    stale-handle TroupeError (troupe.kill's), naming the actor and `what`."""
    import troupe

    return troupe._same_session(handle._client, f"{what}: actor {handle._actor.id}")


def _handle_by_id(actor_id, lifetime=None, table=None):
    client = _client()
    return ActorHandle(client.actor_by_id(actor_id), None, client, lifetime, table)


@functools.lru_cache(maxsize=1024)
def _method_table(cls):
    """(class name, {method: its @troupe.method num_returns}, {method: its
    @troupe.method concurrency_group}) of an actor class: what its handles
    check calls against, here and wherever they are sent."""
    methods, groups = {}, {}
    for name in dir(cls):
        if name.startswith("__") and not _remote_dunder(cls, name):
            continue
        fn = getattr(cls, name, None)
        if callable(fn):
            methods[name] = getattr(fn, "_troupe_num_returns", "streaming" if is_generator_function(fn) else 1)
            if getattr(fn, "_troupe_concurrency_group", None) is not None:
                groups[name] = fn._troupe_concurrency_group
    return cls.__name__, methods, groups


@functools.lru_cache(maxsize=1024)
def _method_retries(cls):
    """{method: its @troupe.method max_task_retries} of an actor class, for
    the methods that give one."""
    out = {}
    for name in dir(cls):
        retries = getattr(getattr(cls, name, None), "_troupe_max_task_retries", None)
        if retries is not None:
            out[name] = retries
    return out


# Where a named actor's method table waits for get_actor: a key that lives
# as long as the actor (the head erases it at its death;
# runtime/client/actor_keys.h).
def _methods_key(actor_id):
    return f"troupe.actor/{actor_id}/py.methods"


def _named_handle(client, actor):
    """A handle to an actor found by name, with its class's method table
    when its creator left one (a Python actor's)."""
    blob = client.kv_get(_methods_key(actor.id))
    table = None
    try:
        name, methods, groups, names, retries = json.loads(blob) if blob is not None else (None,) * 5
        if isinstance(name, str) and isinstance(methods, dict) and isinstance(groups, dict) and isinstance(
                names, list) and isinstance(retries, dict):
            table = (name, methods, groups, names, retries)
    except (ValueError, TypeError):
        pass  # not a table this shim wrote: a handle that checks nothing
    return ActorHandle(actor, None, client, None, table)


class ActorClass:
    """A class decorated with @troupe.remote; Cls.remote(...) starts an actor
    and returns its handle."""

    def __init__(self, cls, options, shared=None):
        _check_options(options, _ACTOR_OPTIONS, f"actor {cls.__qualname__}")
        check_namespace(options.get("namespace"), f"actor {cls.__qualname__}")
        check_actor_name(options.get("name"), f"actor {cls.__qualname__}")
        self._cls = cls
        self._options = options
        self._shared = shared if shared is not None else {}
        self.__name__ = cls.__name__
        self.__doc__ = cls.__doc__

    def __call__(self, *args, **kwargs):
        raise TypeError(f"actor class {self.__name__} cannot be instantiated directly: use {self.__name__}.remote()")

    def options(self, **options):
        return ActorClass(self._cls, {**self._options, **options}, self._shared)

    def _existing(self, client, name, groups):
        """A handle to the actor `name` that exists (get_if_exists): with
        its creator's method table, whose concurrency groups are the ones
        the actor has; this class's while the creator has not written it."""
        handle = _named_handle(client, client.get_actor(name))
        return handle if handle._table is not None else ActorHandle(handle._actor, self._cls, client, groups=groups)

    def remote(self, *args, **kwargs):
        import troupe

        client = _client_or_init()
        if "blob" not in self._shared:
            self._shared["blob"] = ser.dumps_code(self._cls)
        # A named actor lives in the namespace given, else in its creator's.
        name = str(self._options["name"]) if self._options.get("name") else None
        if name is not None:
            name = full_actor_name(name, self._options.get("namespace") or troupe._namespace())
        if self._options.get("get_if_exists") and name is None:
            # Ray refuses it too: without a name every call made a new actor.
            raise ConfigError(f"actor {self.__name__}: get_if_exists=True needs a name (it gets the actor of that "
                              f"name, or makes it), got name={self._options.get('name')!r}")
        groups = _concurrency_groups(self._options, f"actor {self.__name__}")
        for method_name, group in sorted(_method_table(self._cls)[2].items()):
            if group not in groups:
                known = ", ".join(repr(g) for g in groups) or "none"
                raise ConfigError(f"actor {self.__name__}: method {method_name} is in concurrency group {group!r}, "
                                  f"which its concurrency_groups option does not define ({known})")
        if self._options.get("get_if_exists") and name is not None:
            try:
                return self._existing(client, name, groups)
            except ConfigError:
                pass
        _check_arguments(_signature(self._cls), f"actor {self.__name__}", args, kwargs)
        data, top = _call_args(f"actor {self.__name__}", args, kwargs)
        options = _runtime_options(self._options, 0)
        if name is not None:
            options["name"] = name
        if "max_concurrency" not in self._options and _has_async_methods(self._cls):
            options["max_concurrency"] = _ASYNC_MAX_CONCURRENCY
        try:
            actor = client.spawn(self._cls.__qualname__, self._shared["blob"], data, list(top), options)
        except ConfigError as e:
            # Another caller made it between the lookup and this spawn.
            if not (self._options.get("get_if_exists") and name is not None and "is already taken" in str(e)):
                raise
            return self._existing(client, name, groups)
        if name is not None:
            # For get_actor's handles: the methods to check calls against,
            # their num_returns defaults and concurrency groups.
            client.kv_put(_methods_key(actor.id),
                          json.dumps(_method_table(self._cls) + (groups, _method_retries(self._cls))).encode())
        if options.get("detached"):
            # It may outlive its creator, which holds the packages it runs
            # with no longer than it lives.
            _packages.hold_for_actor(client, actor.id, options.get("env", ()))
        # Unnamed and not detached: it ends once no handle is left (Ray's
        # rule; a named one stays for get_actor until killed or its owner
        # exits).
        lifetime = None
        if name is None and not options.get("detached"):
            lifetime = client.actor_lifetime(actor.id)
        return ActorHandle(actor, self._cls, client, lifetime,
                           max_pending_calls=self._options.get("max_pending_calls", -1), groups=groups)


def remote(*args, **options):
    """@troupe.remote, @troupe.remote(num_cpus=..., ...): a function becomes
    a RemoteFunction, a class an ActorClass."""
    def wrap(obj):
        if isinstance(obj, type):
            return ActorClass(obj, options)
        if callable(obj):
            return RemoteFunction(obj, options)
        raise TypeError(f"@troupe.remote applies to functions and classes, not to a {type(obj).__name__}")

    if len(args) == 1 and not options and (callable(args[0]) or isinstance(args[0], type)):
        return wrap(args[0])
    if args:
        raise TypeError("@troupe.remote takes keyword options only, e.g. @troupe.remote(num_cpus=1)")
    return wrap
