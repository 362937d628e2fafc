"""Streaming generators, as Ray's num_returns="streaming" (the default of a
generator function or method): the call returns an ObjectRefGenerator at
once, and each value the remote generator yields reaches the caller as it
is yielded, as one ObjectRef (src/py_stream.h carries them). The caller
owns those values. A generator that gets ahead of its consumer by more than
the stream's credits (_generator_backpressure_num_objects) waits.
"""
import collections
import threading

from troupe.exceptions import ConfigError, GetTimeoutError, WorkerCrashedError

# How many values a generator may yield ahead of its consumer when no
# _generator_backpressure_num_objects is given.
DEFAULT_CREDITS = 32
# How long one async next waits on an executor thread before it lets the
# loop look again (and a cancelled await free the thread).
_ASYNC_SLICE_S = 0.1
BACKPRESSURE_OPTION = "_generator_backpressure_num_objects"
_ITEM, _END, _FAILED = 0, 1, 2


def credits(value, what):
    """_generator_backpressure_num_objects, checked (None: the default)."""
    if value is None:
        return DEFAULT_CREDITS
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
        raise ConfigError(f"{what}: {BACKPRESSURE_OPTION} must be an int in [1, 1000000], got {value!r}")
    return value


class ObjectRefGenerator:
    """What a streaming call returns: iterate it (for, next, async for) for
    one ObjectRef per value the remote generator yields, in order, each as
    soon as it is yielded. An exception the generator raises is the last
    ref (getting it raises); so is a failure of the call itself (its worker
    died, it was cancelled). A task whose worker died runs again, up to its
    max_retries, and the values already handed out are not handed out
    twice (the generator is run again from its start and its first values
    are skipped, so it should yield the same values each time, as in Ray);
    so does an actor method whose actor died and restarts, up to the
    actor's max_task_retries. Dropping the generator stops the remote one
    at its next yield."""

    def __init__(self, start, retries, what, retryable=None):
        # start(skip) -> (stream, done): makes the call again, past the
        # first `skip` values; retryable(ref): whether the failure in `ref`
        # (ready) is one a new attempt can mend.
        self._start = start
        self._retries = retries
        self._retryable = retryable or _worker_died
        self._what = what
        self._delivered = 0
        self._finished = False
        self._cancelled = False
        # Refs fetched and not handed out yet (None: the end): what an
        # async next fetched for an await that was cancelled meanwhile
        # waits here for the next one.
        self._ahead = collections.deque()
        self._lock = threading.Lock()
        self._stream, self._done = start(0)

    def __iter__(self):
        return self

    def __next__(self):
        return self._next_sync()

    def _next_sync(self, timeout_s=None):
        """The next ref; StopIteration at the end; GetTimeoutError when none
        came within `timeout_s` seconds (None: no limit)."""
        ref = self._next(timeout_s)
        if ref is None:
            raise StopIteration
        return ref

    def __aiter__(self):
        return self

    async def __anext__(self):
        import asyncio

        loop = asyncio.get_running_loop()
        # On a thread of the loop's executor, in slices: the loop runs on
        # meanwhile, and a cancelled await frees its thread within a slice.
        while not self._ahead and not self._finished:
            await loop.run_in_executor(None, self._fetch_ahead, _ASYNC_SLICE_S)
        ref = self._ahead.popleft() if self._ahead else None
        if ref is None:
            raise StopAsyncIteration
        return ref

    def _fetch_ahead(self, timeout):
        with self._lock:
            if self._ahead or self._finished:
                return
            try:
                self._ahead.append(self._fetch(timeout))
            except GetTimeoutError:
                pass

    def _poll(self):
        """Whether next() would return at once (troupe.wait): a ref fetched
        ahead, the end, or one the stream holds now, which is fetched ahead.
        Never blocks: None while another thread reads from it."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._ahead or self._finished:
                return True
            if not self._stream.ready():
                return False
            try:
                # At once; a failure that a retry mends starts the retry
                # and is not ready.
                self._ahead.append(self._fetch(0))
            except GetTimeoutError:
                return False
            return True
        finally:
            self._lock.release()

    def _wait_target(self):
        """The stream troupe.wait sleeps on (None once finished)."""
        return self._stream

    def _next(self, timeout):
        with self._lock:
            if self._ahead:
                return self._ahead.popleft()
            return self._fetch(timeout)

    def _fetch(self, timeout):
        """The next ref from the stream (None at the end); under the lock."""
        while not self._finished:
            got = self._stream.next(timeout)
            if got is None:
                raise GetTimeoutError(f"{self._what}: no value within {timeout:g} s")
            kind, ref = got
            if kind == _ITEM:
                self._delivered += 1
                return ref
            if kind == _END:
                self._finish()
                return None
            if self._retries != 0 and not self._cancelled and self._retryable(ref):
                if self._retries > 0:
                    self._retries -= 1
                self._stream, self._done = self._start(self._delivered)
                continue
            self._finish()
            return ref
        return None

    def _finish(self):
        # The stream is done with: its reader leaves the stream listener.
        self._finished = True
        self._stream = None

    def _cancel_target(self):
        """troupe.cancel of this generator: its call's latest attempt, never
        made again. (Not under the lock: another thread may be waiting in
        next for what this cancel ends.)"""
        self._cancelled = True
        return self._done

    def completed(self):
        """The ref of the call itself (of its latest attempt): ready once the
        generator has ended; its value is how many values it sent."""
        return self._done

    def is_finished(self):
        """Whether the last ref was handed out."""
        return self._finished

    def __reduce__(self):
        raise TypeError(f"{self._what}: an ObjectRefGenerator stays with its caller; pass the refs it gives "
                        "(or a list of them) to other tasks")

    def __repr__(self):
        state = "finished" if self._finished else f"{self._delivered} handed out"
        return f"ObjectRefGenerator({self._what}, {state})"


def actor_restarting(actor):
    """retryable() of an actor method's stream: the call failed because its
    actor died (ActorDiedError) and the actor is not dead for good (it
    restarts). A new attempt on an actor that is dead fails at once, with
    the death's cause."""
    from troupe.exceptions import ActorDiedError

    def retryable(ref):
        import troupe

        try:
            troupe.get(ref, timeout=0)
        except ActorDiedError:
            return actor.info()["state"] != "DEAD"
        except BaseException:
            return False
        return False

    return retryable


def _worker_died(ref):
    """Whether the call behind `ref` (ready, failed) failed because its
    worker died: what a retry can mend."""
    import troupe

    try:
        troupe.get(ref, timeout=0)
    except WorkerCrashedError:
        return True
    except BaseException:
        return False
    return False
