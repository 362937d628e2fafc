"""ActorPool: work spread over a fixed set of actors, as Ray's
ray.util.ActorPool. Each actor runs one item at a time; items submitted
while every actor is busy wait here and go to the first actor that frees.

    pool = ActorPool([Worker.remote() for _ in range(4)])
    for result in pool.map(lambda a, v: a.work.remote(v), range(100)):
        ...

`fn(actor, value)` must call one method of `actor` and return its ref (or,
as in Ray, the list of refs of a method with several return values: the
result is then the list of their values).
"""
import time

import troupe
from troupe.exceptions import GetTimeoutError


def _refs(future):
    """The refs of what fn returned: one ref, or a list of them."""
    return future if isinstance(future, list) else [future]


def _shown(value):
    if isinstance(value, list):
        return "an empty list" if not value else "a list of " + ", ".join(sorted({type(v).__name__ for v in value}))
    return f"a {type(value).__name__}"


class ActorPool:
    def __init__(self, actors):
        actors = list(actors)
        for a in actors:
            if not isinstance(a, troupe.ActorHandle):
                raise TypeError(f"ActorPool takes actor handles, got a {type(a).__name__}")
        self._idle = actors
        self._busy = {}  # id(ref) -> (ref, submission index, actor)
        self._by_index = {}  # submission index -> ref, for the ordered gets
        self._next_index = 0  # of the next submission
        self._next_return = 0  # the ordered gets' next submission index
        self._waiting = []  # (fn, value) submitted while no actor was idle
        # What a waiting item's fn raised as an actor freed for it, inside a
        # get that had its result: raised by the next get or submit.
        self._deferred = None

    def submit(self, fn, value):
        """Runs fn(actor, value) on an idle actor, or once one frees."""
        if not self._idle:
            self._waiting.append((fn, value))
            return
        actor = self._idle.pop()
        try:
            ref = fn(actor, value)
        except BaseException:
            self._idle.append(actor)  # a fn that raised leaves the pool as it was
            raise
        if isinstance(ref, tuple):
            ref = list(ref)
        if not (isinstance(ref, troupe.ObjectRef) or
                (isinstance(ref, list) and ref and all(isinstance(r, troupe.ObjectRef) for r in ref))):
            self._idle.append(actor)
            raise TypeError(f"ActorPool: fn(actor, value) must return the ref of a method call (or the list of "
                            f"refs of one with several return values), not {_shown(ref)}")
        self._busy[id(ref)] = (ref, self._next_index, actor)
        self._by_index[self._next_index] = ref
        self._next_index += 1

    def has_next(self):
        """Whether a result is still to be had (submitted, not yet got), or
        an error to raise (a waiting item's fn that raised)."""
        return bool(self._busy) or bool(self._waiting) or self._deferred is not None

    def has_free(self):
        """Whether an actor is idle and nothing waits for one."""
        return bool(self._idle) and not self._waiting

    def get_next(self, timeout=None, ignore_if_timedout=False):
        """The next result in submission order; GetTimeoutError (a
        TimeoutError) when it is not there within `timeout` s. The item
        stays for the next get_next, unless ignore_if_timedout: then it is
        dropped, and the error says so (as Ray's)."""
        self._raise_deferred()
        if not self.has_next():
            raise StopIteration("ActorPool: no more results to get")
        self._check_runnable("get_next")
        # Skip what get_next_unordered took already. An item still waiting
        # for an actor comes after every submitted one, so the next one in
        # order has been submitted.
        while self._next_return not in self._by_index:
            self._next_return += 1
        ref = self._by_index[self._next_return]
        refs = _refs(ref)
        ready, _ = troupe.wait(refs, num_returns=len(refs), timeout=timeout)
        if len(ready) < len(refs):
            if ignore_if_timedout:
                self._finish(ref)
                self._next_return += 1
                raise GetTimeoutError(f"ActorPool.get_next: no result within {timeout} s; the item was dropped "
                                      "(ignore_if_timedout)")
            raise GetTimeoutError(f"ActorPool.get_next: no result within {timeout} s")
        self._finish(ref)
        self._next_return += 1
        return troupe.get(ref)

    def get_next_unordered(self, timeout=None, ignore_if_timedout=False):
        """The first result to be ready, whatever its order; GetTimeoutError
        when none is within `timeout` s (no item is dropped: none was the
        next)."""
        self._raise_deferred()
        if not self.has_next():
            raise StopIteration("ActorPool: no more results to get")
        self._check_runnable("get_next_unordered")
        ref = self._first_ready(timeout)
        if ref is None:
            raise GetTimeoutError(f"ActorPool.get_next_unordered: no result within {timeout} s")
        self._finish(ref)
        return troupe.get(ref)

    def map(self, fn, values):
        """fn over values, results in their order (a generator). As Ray's:
        what earlier submissions left ungot (a map that raised) is dropped
        first, and every value is submitted now, not as the results are
        read."""
        self._drop_earlier()
        for v in values:
            self.submit(fn, v)
        return self._results(self.get_next)

    def map_unordered(self, fn, values):
        """fn over values, results as they are ready (a generator); as map."""
        self._drop_earlier()
        for v in values:
            self.submit(fn, v)
        return self._results(self.get_next_unordered)

    def _results(self, get):
        while self.has_next():
            yield get()

    def _drop_earlier(self):
        """Forgets what was submitted and not got: items still waiting for
        an actor are never run; results, errors and calls under way are let
        go (an actor whose call runs takes the next item after it)."""
        self._waiting.clear()
        self._deferred = None
        for ref, _, actor in list(self._busy.values()):
            self._busy.pop(id(ref))
            self._idle.append(actor)
        self._by_index.clear()
        self._next_return = self._next_index

    def push(self, actor):
        """Adds an actor (it takes a waiting item at once, if any)."""
        if not isinstance(actor, troupe.ActorHandle):
            raise TypeError(f"ActorPool.push takes an actor handle, not a {type(actor).__name__}")
        if any(actor is a for a in self._idle) or any(actor is a for _, _, a in self._busy.values()):
            raise ValueError("ActorPool.push: the actor is in the pool already")
        self._idle.append(actor)
        self._submit_waiting()

    def pop_idle(self):
        """Removes and returns an idle actor, or None when all are busy."""
        return self._idle.pop() if self.has_free() else None

    def _raise_deferred(self):
        if self._deferred is not None:
            error, self._deferred = self._deferred, None
            raise error

    def _check_runnable(self, what):
        """Items wait for an actor while none is in the pool (none given,
        or all taken by pop_idle): no result can come, so say so rather
        than wait for ever."""
        self._raise_deferred()
        self._submit_waiting()
        self._raise_deferred()  # a fn that raised just now, with nothing before it to return
        if not self._busy and self._waiting:
            raise ValueError(f"ActorPool.{what}: {len(self._waiting)} submitted item(s) wait for an actor and the "
                             "pool has none (none was given, or pop_idle took them all): push() one")

    def _first_ready(self, timeout):
        """The first submission whose refs are all ready, or None at the
        timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            futures = [ref for ref, _, _ in self._busy.values()]
            if not futures:
                return None
            if not any(isinstance(f, list) for f in futures):
                # One ref each (the common case): one wait.
                ready, _ = troupe.wait(futures, num_returns=1,
                                       timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                return ready[0] if ready else None
            flat = [r for f in futures for r in _refs(f)]
            done, _ = troupe.wait(flat, num_returns=len(flat), timeout=0)
            done_ids = {id(r) for r in done}
            for f in futures:
                if all(id(r) in done_ids for r in _refs(f)):
                    return f
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            waiting = [r for r in flat if id(r) not in done_ids]
            troupe.wait(waiting, num_returns=1, timeout=left)

    def _finish(self, ref):
        _, index, actor = self._busy.pop(id(ref))
        self._by_index.pop(index, None)
        self._release(actor)

    def _release(self, actor):
        self._idle.append(actor)
        self._submit_waiting()

    def _submit_waiting(self):
        """Waiting items to idle actors. A fn that raises leaves its actor
        idle and its error for the next get or submit: the get that freed
        the actor returns its own result first."""
        while self._idle and self._waiting and self._deferred is None:
            fn, value = self._waiting.pop(0)
            try:
                self.submit(fn, value)
            except Exception as e:  # noqa: BLE001 - fn's own error, raised later
                self._deferred = e
