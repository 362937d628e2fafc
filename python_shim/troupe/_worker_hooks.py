"""What the C++ worker loop calls inside a Python worker (src/py_worker.cc):
build an actor, run one of its methods, run a task. Arguments arrive as
(data, buffers, refs) with the top-level refs already fetched; answers go
back as (error, data, buffers, refs). An exception in user code is an answer
(an _ErrorBox with the traceback), not a failure of the worker.
"""
import asyncio
import collections
import concurrent.futures
import contextvars
import ctypes
import inspect
import os
import sys
import threading
import traceback
import weakref

from troupe import _console, _core
from troupe import _serialization as ser
from troupe.exceptions import StreamError, _ErrorBox, _RebuildByState

_functions = {}  # task function by content hash, loaded once per worker
_FUNCTION_KEY = "troupe.py.fn."
_loop = None  # the worker's event loop for async def methods, made on first use
_loop_lock = threading.Lock()
_runs_tasks = False  # a task executor's worker (run_task was called)
_actor_class = None  # an actor's worker: its class (make_actor)
_lend_for = 0  # its CpuLender (_core.wait_observer() on a task's thread)
# troupe.cancel: the thread of each task running here by its token, the
# _Coroutine of each async task or method by its token (a call's token is
# its call id), and the tokens of those cancelled before they got there
# (more than a mailbox holds: the submitter pipelines at most 256 to an
# executor). Under _cancel_lock.
_running = {}
_coroutines = {}
_cancelled = collections.OrderedDict()
# troupe.cancel(recursive=True): weak references to the refs of the tasks
# each running task or plain method submitted, by its token. Under
# _cancel_lock.
_children = {}
# The token of the task or call running (get_runtime_context's
# get_task_id), none outside one: a context variable, which the coroutine
# of an async method or task takes along to the event loop's thread.
_current_token = contextvars.ContextVar("troupe_task_token", default=None)
_CANCELLED_KEPT = 4096
_cancel_lock = threading.Lock()


def _sync_environment():
    # A pooled worker receives its actor's environment (CUDA_VISIBLE_DEVICES,
    # runtime_env's env_vars) after the interpreter started: os.environ
    # catches up.
    from troupe import _remote

    # An empty value stays (an empty CUDA_VISIBLE_DEVICES hides every GPU;
    # popping it unset the variable of a worker that had it from its exec,
    # and CUDA then showed that actor every GPU of the host).
    # TROUPE_ROLE and the worker's descriptors are gone from the process's
    # environment (run_worker): gone from what subprocesses get too.
    for name in ("CUDA_VISIBLE_DEVICES", "PYTROUPE_JOB_ID", "PYTROUPE_NAMESPACE", _remote.RUNTIME_ENV_VARS,
                 "TROUPE_ROLE", "TROUPE_SERVING_FD", "TROUPE_POOL_FD", "TROUPE_READY_FD"):
        value = _core.getenv_or_none(name)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    # References expanded here too: a pooled worker was not started for
    # them (troupe.worker expands them in one that was).
    _remote.apply_env_vars()
    # runtime_env's working_dir and py_modules: on sys.path (the first the
    # current directory) before the code that may import from them loads.
    from troupe import _packages

    _packages.apply(_remote._client)


def _answer(value, what):
    """The answer of `what` (a task or method), which returned `value`."""
    if inspect.isasyncgen(value):
        raise TypeError(
            f"{what} returned an async generator, but its caller asked for a fixed num_returns: leave num_returns "
            "out of an async generator function's options (or give num_returns='streaming'), and its values stream "
            "to the caller; or return a list"
        )
    if inspect.isgenerator(value):  # from a plain function: a generator function's values are collected
        raise TypeError(
            f"{what} returned a generator, but it is no generator function: return a list, or make it a generator "
            "function (its values stream to the caller, or with a fixed num_returns are one per return)"
        )
    try:
        data, buffers, refs = ser.dumps(value)
    except Exception as e:
        raise TypeError(f"{what} returned a {type(value).__name__} that cannot be pickled: {e}") from e
    return False, data, buffers, refs


def _yielded(fn, value):
    """The values a generator function yields when its caller asked for a
    fixed num_returns, one per return, as Ray's static generators; any other
    value (a generator a plain function returns too) as it is."""
    if inspect.isgenerator(value) and inspect.isgeneratorfunction(fn):
        return ser.Yielded(value)
    return value


def _error(where, function_name=None):
    import pickle

    import cloudpickle

    exc = traceback.sys.exc_info()[1]
    text = traceback.format_exc()
    blob = None
    # As it pickles; else by class, args and attributes (an __init__ that
    # wants other arguments than its args); else only its class name.
    for form in (exc, _RebuildByState(exc)):
        try:
            blob = cloudpickle.dumps(form, 5)
            pickle.loads(blob)
            break
        except Exception:
            blob = None
    try:
        message = str(exc)
    except Exception:  # its __str__ raised, or returned no string
        message = f"<the {type(exc).__name__}'s str() failed>"
    box = _ErrorBox(blob, type(exc).__name__, message, text, where, function_name, os.getpid(),
                    _core.getenv("TROUPE_ADVERTISE_HOST") or "127.0.0.1")
    data, buffers, refs = ser.dumps(box)
    return True, data, buffers, refs


def make_actor(blob, args, top):
    global _actor_class
    _sync_environment()
    cls = _actor_class = ser.loads_code(blob)
    _console.mark_output(cls.__name__)
    a, kw = ser.load_call_args(args, top)
    return cls(*a, **kw)


def _event_loop():
    """The worker's one event loop, running forever in a daemon thread.
    One loop for all calls (as Ray's async actors): the coroutines of calls
    in flight at once (max_concurrency > 1, a worker thread each) interleave
    on it and can share asyncio objects (events, locks, queues)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            # Daemon: a worker that exits does not wait for the loop.
            threading.Thread(target=loop.run_forever, name="troupe-asyncio", daemon=True).start()
            _loop = loop
        return _loop


class _Coroutine:
    """A coroutine run as a task on the worker's loop, which any thread may
    cancel (asyncio's cancel: CancelledError at its current await).
    result() returns, or raises, only once the coroutine has ended, after a
    cancel too: its except and finally blocks have run before the call
    ends and the actor starts its next one."""

    def __init__(self, coroutine):
        self._loop = _event_loop()
        self._done = concurrent.futures.Future()
        self._task = None
        self._loop.call_soon_threadsafe(self._start, coroutine)

    def _start(self, coroutine):  # on the loop, before any _cancel (FIFO)
        self._task = self._loop.create_task(coroutine)
        self._task.add_done_callback(self._finish)

    def _finish(self, task):
        if task.cancelled():
            self._done.set_exception(asyncio.CancelledError("the call was cancelled (troupe.cancel)"))
        elif task.exception() is not None:
            self._done.set_exception(task.exception())
        else:
            self._done.set_result(task.result())

    def cancel(self):
        self._loop.call_soon_threadsafe(lambda: self._task.cancel())

    def result(self):
        return self._done.result()


def _settle(value, token=0):
    """The value of a call: an async def method's coroutine runs to its end
    on the worker's loop while this call's thread waits (without the GIL);
    its exception is raised here, for _error. troupe.cancel of `token`
    cancels the coroutine (asyncio.CancelledError inside it)."""
    if not inspect.iscoroutine(value):
        return value
    coroutine = _Coroutine(value)
    if not token:
        return coroutine.result()
    with _cancel_lock:
        _coroutines[token] = coroutine
        cancelled = _cancelled.pop(token, False)
    try:
        if cancelled:
            coroutine.cancel()
        return coroutine.result()
    finally:
        with _cancel_lock:
            _coroutines.pop(token, None)


class _ReaderGone(Exception):
    """The caller of a streaming call stopped reading (it dropped its
    ObjectRefGenerator, or the call was cancelled)."""


def _send(writer, parts):
    try:
        writer.write(parts)
    except StreamError as e:
        # Gone when the reader ended the stream (its generator dropped, the
        # call cancelled) or its process refused it ("... by its reader");
        # a connection that dropped ("stream reader disconnected") may
        # leave a reader waiting: the call fails, and tells it so (it was
        # answered as a success, and the caller's generator waited for
        # ever).
        if "by its reader" in str(e):
            raise _ReaderGone(str(e)) from None
        raise


async def _next_of(agen):
    return await agen.__anext__()


def _values(items, what, token):
    """The values a streaming call's generator yields (an async one's
    awaited on the worker's loop, cancellable by troupe.cancel as an async
    method is)."""
    if inspect.isgenerator(items):
        yield from items
    elif inspect.isasyncgen(items):
        while True:
            try:
                value = _settle(_next_of(items), token)
            except StopAsyncIteration:
                return
            yield value
    else:
        raise TypeError(f"{what} is a streaming call (num_returns='streaming') but returned a "
                        f"{type(items).__name__}, not a generator")


def _close(items):
    """Runs a stopped generator's finally blocks (an async one's on the loop)."""
    try:
        if inspect.isgenerator(items):
            items.close()
        elif inspect.isasyncgen(items):
            _settle(items.aclose())
    except Exception:
        pass


def _streamed(stream, produce, what, where, token, retry=None):
    """A streaming call: produce() makes its generator, each value it yields
    goes to the caller's stream (address, id, values to skip) as it is
    yielded, an exception it (or produce) raises as the stream's last item,
    unless retry(exception, attempt) says to make the generator again, past
    the values already sent. The call's own answer is how many values were
    sent. A caller that stops reading stops the generator at its next
    yield."""
    address, stream_id, skip = stream
    # Fails the call when the caller's process cannot be reached. One that
    # dropped its generator (or cancelled the call) before the call ran
    # refuses the stream: a first value sent before the refusal came is
    # dropped, and the write after it stops the generator as a reader that
    # stopped reading does.
    writer = _core.StreamWriter(address, stream_id)
    sent = 0
    items = None
    attempt = 0
    try:
        while True:
            first = skip + sent  # an attempt after an exception goes on past what the last one sent
            try:
                items = produce()
                for index, value in enumerate(_values(items, what, token)):
                    if index >= first:
                        _send(writer, _answer(value, f"{what}, value {index}"))
                        sent += 1
            except _ReaderGone:
                raise
            except BaseException as e:
                if retry is not None and isinstance(e, Exception) and retry(e, attempt):
                    attempt += 1
                    _close(items)
                    items = None
                    continue
                _send(writer, _error(where(), what))
            break
        writer.close()
    except _ReaderGone:
        pass
    finally:
        _close(items)
    return _answer(sent, what)


class _MethodRetry:
    """An actor call's retries on exceptions (Ray's retry_exceptions of an
    actor method): the exception classes and the count come from the call's
    .options (a _CallRetry in front of its arguments, taken off here), else
    from the method's @troupe.method, the count else from the actor's
    max_task_retries. Each attempt runs in this worker, on this actor, with
    the arguments as they arrived."""

    def __init__(self, instance, name, args, top):
        self._instance, self._name, self._args, self._top = instance, name, args, top
        self._asked = None

    def arguments(self):
        from troupe import _remote

        a, kw = ser.load_call_args(self._args, self._top)
        if a and isinstance(a[0], _remote._CallRetry):
            self._asked, a = a[0], a[1:]
        return a, kw

    def again(self, error, attempt):
        if _core.current_task_cancelled():
            return False  # troupe.cancel reached the call: no attempt after it
        fn = getattr(type(self._instance), self._name, None)
        asked = self._asked
        kinds = asked.kinds if asked is not None and asked.kinds_given else getattr(
            fn, "_troupe_retry_exceptions", None)
        if kinds is None or not isinstance(error, kinds):
            return False
        retries = asked.retries if asked is not None else None
        if retries is None:
            retries = getattr(fn, "_troupe_max_task_retries", None)
        if retries is None:
            retries = _actor_max_task_retries()
        return retries < 0 or attempt < retries


_own_max_task_retries = None


def _actor_max_task_retries():
    """This worker's actor's max_task_retries (asked of the head once)."""
    global _own_max_task_retries
    if _own_max_task_retries is None:
        import troupe

        _own_max_task_retries = troupe._client().actor_info(user_actor_id())["max_task_retries"]
    return _own_max_task_retries


def call_method(instance, name, args, top, token=0, stream=None):
    what = f"{type(instance).__name__}.{name}"
    where = lambda: f"{what} (pid {os.getpid()})"  # noqa: E731
    reset = _current_token.set(token)
    retry = _MethodRetry(instance, name, args, top)
    try:
        if stream is not None:
            return _streamed(stream, lambda: _method_call(instance, name, retry.arguments()), what, where, token,
                             retry.again)
        fn = getattr(type(instance), name, None)
        attempt = 0
        while True:
            try:
                value = _settle(_yielded(fn, _method_call(instance, name, retry.arguments())), token)
                break
            except Exception as e:
                if not retry.again(e, attempt):
                    raise
                attempt += 1
        return _answer(value, what)
    except SystemExit as e:
        # sys.exit() in an actor's method ends the actor, as in Ray (it
        # read as the method's error, and the actor served on).
        actor = user_actor_id()
        if actor:
            from troupe import actor as actor_module

            actor_module._end(actor, f"the actor called sys.exit({e.code!r}) in {what}")
        return _error(where(), what)
    except BaseException:
        return _error(where(), what)
    finally:
        _forget_children(token)
        _current_token.reset(reset)
        _console.end_lines()


def current_task_token():
    """The token of the task or actor call running here, or None."""
    return _current_token.get()


def _ray_terminate(instance):
    from troupe import actor

    actor.exit_actor()


# Every actor's methods of Ray's: `__ray_ready__` answers once the actor is
# constructed (to wait for a group of actors), `__ray_terminate__` ends it
# as exit_actor() does, after the calls queued before it, `__ray_call__(fn,
# *args, **kwargs)` runs fn(the actor's instance, *args, **kwargs) there.
BUILTIN_METHODS = {"__ray_ready__": lambda instance: True, "__ray_terminate__": _ray_terminate,
                   "__ray_call__": lambda instance, fn, *args, **kwargs: fn(instance, *args, **kwargs)}


def _method_call(instance, name, arguments):
    a, kw = arguments
    builtin = BUILTIN_METHODS.get(name)
    if builtin is not None:
        return builtin(instance, *a, **kw)
    return getattr(instance, name)(*a, **kw)


def _function(key):
    fn = _functions.get(key)
    if fn is None:
        import troupe

        blob = troupe._client().kv_get(_FUNCTION_KEY + key)
        if blob is None:
            raise troupe.exceptions.ConfigError(f"task function {key} is not in the cluster's function table")
        fn = _functions[key] = ser.loads_code(blob)
    return fn


def actor_class():
    """The class this actor's worker made its actor of (None: none)."""
    return _actor_class


def user_actor_id():
    """The id of the user's actor this worker runs; None in a driver or a
    task executor (a hidden actor, no actor of the user's)."""
    actor = _core.actor_id()
    return actor if actor and not _runs_tasks else None


def runs_tasks():
    """Whether this worker is a task executor (it has run a task)."""
    return _runs_tasks


def lend_for():
    """What an `await ref` in an async task passes to get(lend_for=): the
    executor's CPU is lent while the await waits, as for a plain get."""
    return _lend_for


def note_child(ref):
    """Called as a task is submitted: a task or plain method running here
    keeps a weak reference to the ref of each task it submits, which a
    recursive troupe.cancel of it cancels."""
    token = _current_token.get()
    if not token:
        return
    with _cancel_lock:
        children = _children.setdefault(token, [])
        if len(children) >= 64:
            # Keep the list to the refs still alive (a loop of tasks whose
            # refs are dropped would grow it without end).
            children[:] = [c for c in children if c() is not None]
        children.append(weakref.ref(ref))


def _forget_children(token):
    with _cancel_lock:
        _children.pop(token, None)


def _cancel_children(children):
    """A recursive cancel's second half: each child not finished is
    cancelled as its parent was (without force, recursively)."""
    import troupe

    for child in children:
        try:
            troupe.cancel(child)
        except Exception as e:  # noqa: BLE001 (a child's cancel must not stop the others')
            print(f"[troupe] cancelling a child task of a cancelled task: {e}", file=sys.stderr)


def interrupt_task(token, recursive=True, interrupted=None):
    """troupe.cancel (without force), on a thread of its own: cancels the
    coroutine of async task or method `token`, else raises
    KeyboardInterrupt in the thread that runs task `token` (at its next
    Python instruction: a blocking call such as time.sleep ends first). A
    plain actor method runs on (the C++ side has flagged it for
    is_canceled()). One that has not got this far yet is kept, so that it
    is cancelled as it gets there. With `recursive`, the tasks it submitted
    are cancelled after it is interrupted (their refs are taken first,
    before the interrupt drops the parent's). `interrupted` (the worker's
    fence: calls of the actor that came after the cancel wait for it) is
    called once the interrupt is made, before the children are cancelled.
    Whether it was running."""
    with _cancel_lock:
        refs = [c() for c in _children.get(token, ())] if recursive else []
        coroutine = _coroutines.get(token)
        thread = _running.get(token)
        if coroutine is not None:
            coroutine.cancel()
        elif thread is not None:
            _async_raise(thread, KeyboardInterrupt)
        else:
            _cancelled[token] = True
            while len(_cancelled) > _CANCELLED_KEPT:
                _cancelled.popitem(last=False)
    if interrupted is not None:
        interrupted()
    _cancel_children([r for r in refs if r is not None])
    return coroutine is not None or thread is not None


def _async_raise(thread, exc):
    """Raises `exc` in `thread` at its next Python instruction (None: drops
    one not yet raised)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(exc) if exc else None)


def run_task(key, args, top, token=0, stream=None):
    global _runs_tasks, _lend_for
    if not _runs_tasks:
        _console.mark_output("task")
    _runs_tasks = True
    _lend_for = _core.wait_observer()
    name = key
    thread = threading.get_ident()
    reset = _current_token.set(token)
    try:
        # The interrupt lands in this try (it is raised only while the token
        # is in _running, and one not raised by its end is dropped there),
        # never past it.
        with _cancel_lock:
            _running[token] = thread
            cancelled = _cancelled.pop(token, False)
        try:
            if cancelled:
                raise KeyboardInterrupt("the task was cancelled before it started")
            _sync_environment()
            fn = _function(key)
            name = getattr(fn, "__qualname__", key)
            if stream is not None:
                return _streamed(stream, lambda: _task_call(fn, args, top), f"task {name}",
                                 lambda: f"task {name} (pid {os.getpid()})", token)
            from troupe import _remote

            if isinstance(fn, _remote._RetryOnError):
                # Retried here, not in the wrapper: an async def function's
                # error comes when its coroutine runs, a generator's while
                # its values are collected (_yielded looks at the function).
                a, kw = ser.load_call_args(args, top)
                value = fn.attempts(lambda f, a, kw: _settle(_yielded(f, f(*a, **kw)), token), a, kw)
            else:
                value = _settle(_yielded(fn, _task_call(fn, args, top)), token)
            return _answer(value, f"task {name}")
        finally:
            with _cancel_lock:
                _running.pop(token, None)
                _async_raise(thread, None)
    except BaseException:
        return _error(f"task {name} (pid {os.getpid()})", name)
    finally:
        _forget_children(token)
        _current_token.reset(reset)
        _console.end_lines()


def _task_call(fn, args, top):
    a, kw = ser.load_call_args(args, top)
    return fn(*a, **kw)
