"""A first-in, first-out queue that tasks and actors share, as Ray's
ray.util.queue.Queue: an async actor holds an asyncio.Queue, and a Queue
object (which may be passed to any task or actor) calls it. Items go by
value (pickled), in the order put."""
import asyncio
import queue as _stdlib_queue

import troupe


class Empty(_stdlib_queue.Empty):
    """get without block, or past its timeout, found no item."""


class Full(_stdlib_queue.Full):
    """put without block, or past its timeout, found no room."""


class _QueueActor:
    """Every method is a coroutine: an asyncio.Queue is not thread-safe, and
    an actor's plain methods run on its call threads, not on its event
    loop (a put_nowait there would not wake a get waiting on the loop)."""

    def __init__(self, maxsize):
        self.maxsize = maxsize
        self._queue = None

    @property
    def queue(self):
        # Made on the loop, by the first call.
        if self._queue is None:
            self._queue = asyncio.Queue(self.maxsize)
        return self._queue

    async def qsize(self):
        return self.queue.qsize()

    async def empty(self):
        return self.queue.empty()

    async def full(self):
        return self.queue.full()

    async def put(self, item, timeout=None):
        # Room now goes first: wait_for(..., 0) times out before its
        # coroutine runs, so put(timeout=0) found no room in an empty queue.
        if not self.queue.full():
            self.queue.put_nowait(item)
            return
        try:
            await asyncio.wait_for(self.queue.put(item), timeout)
        except asyncio.TimeoutError:
            raise Full(f"no room in the queue (maxsize {self.maxsize}) within {timeout} s") from None

    async def get(self, timeout=None):
        if not self.queue.empty():  # as put: an item there is taken, whatever the timeout
            return self.queue.get_nowait()
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise Empty(f"no item in the queue within {timeout} s") from None

    async def put_nowait(self, item):
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            raise Full(f"the queue is full (maxsize {self.maxsize})") from None

    async def put_nowait_batch(self, items):
        # All or none: the room is checked before the first goes in.
        if self.maxsize > 0 and len(items) + self.queue.qsize() > self.maxsize:
            raise Full(f"{len(items)} items do not fit: {self.queue.qsize()} of {self.maxsize} places are taken")
        for item in items:
            self.queue.put_nowait(item)

    async def get_nowait(self):
        try:
            return self.queue.get_nowait()
        except asyncio.QueueEmpty:
            raise Empty("the queue is empty") from None

    async def get_nowait_batch(self, num_items):
        if num_items > self.queue.qsize():
            raise Empty(f"{num_items} items asked for, {self.queue.qsize()} in the queue")
        return [self.queue.get_nowait() for _ in range(num_items)]


# The queue actor's max_concurrency unless actor_options give one.
_WAITERS = 1000


def _check_timeout(block, timeout):
    if block and timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError(f"timeout must be a non-negative number of seconds or None, got {timeout!r}")


def _cancel_call(ref):
    try:
        troupe.cancel(ref)
    except Exception:  # noqa: BLE001 - it finished, or the queue is gone: nothing to undo
        pass


async def _awaited(ref):
    """A put_async or get_async whose await is cancelled cancels its call
    at the queue's actor too (a get left waiting there took the next item
    put, which nobody received), and the cancellation ends once the actor
    has answered it: a put right after it finds no stale get waiting.
    asyncio.wait_for waits for that. The cancel runs off the event loop
    (it waits for the actor's answer)."""
    try:
        return await ref
    except asyncio.CancelledError:
        await asyncio.get_running_loop().run_in_executor(None, _cancel_call, ref)
        raise


def _count(value, what):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    return value


class Queue:
    """Queue(maxsize=0, actor_options=None): maxsize 0 (or less, as the
    standard library's) holds any number of items. actor_options go to the queue's actor (.options(...), e.g.
    num_cpus or a scheduling_strategy). Pass the Queue itself to tasks and
    actors; it calls the same actor from anywhere."""

    def __init__(self, maxsize=0, actor_options=None):
        if isinstance(maxsize, bool) or not isinstance(maxsize, int):
            raise ValueError(f"maxsize must be an int, got {maxsize!r}")
        self.maxsize = maxsize
        # Each call waiting in put or get holds one of the actor's
        # concurrent calls: room for many waiting consumers and producers.
        options = {"max_concurrency": _WAITERS, **dict(actor_options or {})}
        self.actor = troupe.remote(_QueueActor).options(**options).remote(self.maxsize)

    def __len__(self):
        return self.size()

    def size(self):
        return troupe.get(self.actor.qsize.remote())

    qsize = size

    def empty(self):
        return troupe.get(self.actor.empty.remote())

    def full(self):
        return troupe.get(self.actor.full.remote())

    def put(self, item, block=True, timeout=None):
        """Adds `item`; with block, waits for room (up to `timeout` seconds,
        None: without limit), else raises Full at once when there is none."""
        _check_timeout(block, timeout)
        troupe.get(self.actor.put.remote(item, timeout) if block else self.actor.put_nowait.remote(item))

    async def put_async(self, item, block=True, timeout=None):
        _check_timeout(block, timeout)
        await _awaited(self.actor.put.remote(item, timeout) if block else self.actor.put_nowait.remote(item))

    def get(self, block=True, timeout=None):
        """The oldest item; with block, waits for one (up to `timeout`
        seconds, None: without limit), else raises Empty at once."""
        _check_timeout(block, timeout)
        return troupe.get(self.actor.get.remote(timeout) if block else self.actor.get_nowait.remote())

    async def get_async(self, block=True, timeout=None):
        _check_timeout(block, timeout)
        return await _awaited(self.actor.get.remote(timeout) if block else self.actor.get_nowait.remote())

    def put_nowait(self, item):
        return self.put(item, block=False)

    def put_nowait_batch(self, items):
        """Adds every item of `items`, or none (Full) when they do not all fit."""
        if not isinstance(items, (list, tuple)):
            raise TypeError(f"put_nowait_batch takes a list of items, got a {type(items).__name__}")
        troupe.get(self.actor.put_nowait_batch.remote(list(items)))

    def get_nowait(self):
        return self.get(block=False)

    def get_nowait_batch(self, num_items):
        """The `num_items` oldest items, or none (Empty) when there are fewer."""
        return troupe.get(self.actor.get_nowait_batch.remote(_count(num_items, "num_items")))

    def shutdown(self, force=False, grace_period_s=5):
        """Ends the queue's actor (its items go with it). `force` and
        `grace_period_s` are taken for Ray's signature: the actor is killed
        at once either way."""
        if self.actor is not None:
            troupe.kill(self.actor)
            self.actor = None
