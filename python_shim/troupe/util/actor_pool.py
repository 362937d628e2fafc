"""ActorPool: work spread over a fixed set of actors, as Ray's
ray.util.ActorPool. Each actor runs one item at a time; items submitted
while every actor is busy wait here and go to the first actor that frees.

    pool = ActorPool([Worker.remote() for _ in range(4)])
    for result in pool.map(lambda a, v: a.work.remote(v), range(100)):
        ...

`fn(actor, value)` must call one method of `actor` and return its ref.
"""
import troupe
from troupe.exceptions import GetTimeoutError


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

    def submit(self, fn, value):
        """Runs fn(actor, value) on an idle actor, or once one frees."""
        if not self._idle:
            self._waiting.append((fn, value))
            return
        actor = self._idle.pop()
        ref = fn(actor, value)
        if not isinstance(ref, troupe.ObjectRef):
            self._idle.append(actor)
            raise TypeError(f"ActorPool: fn(actor, value) must return the ref of a method call, "
                            f"not a {type(ref).__name__}")
        self._busy[id(ref)] = (ref, self._next_index, actor)
        self._by_index[self._next_index] = ref
        self._next_index += 1

    def has_next(self):
        """Whether a result is still to be had (submitted, not yet got)."""
        return bool(self._busy) or bool(self._waiting)

    def has_free(self):
        """Whether an actor is idle and nothing waits for one."""
        return bool(self._idle) and not self._waiting

    def get_next(self, timeout=None, ignore_if_timedout=False):
        """The next result in submission order; GetTimeoutError (a
        TimeoutError) when it is not there within `timeout` s. The item
        stays for the next get_next, unless ignore_if_timedout: then it is
        dropped, and the error says so (as Ray's)."""
        if not self.has_next():
            raise StopIteration("ActorPool: no more results to get")
        # Skip what get_next_unordered took already. An item still waiting
        # for an actor comes after every submitted one, so the next one in
        # order has been submitted.
        while self._next_return not in self._by_index:
            self._next_return += 1
        ref = self._by_index[self._next_return]
        ready, _ = troupe.wait([ref], timeout=timeout)
        if not ready:
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
        if not self.has_next():
            raise StopIteration("ActorPool: no more results to get")
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

    def _first_ready(self, timeout):
        if not self._busy:
            return None
        refs = [ref for ref, _, _ in self._busy.values()]
        ready, _ = troupe.wait(refs, num_returns=1, timeout=timeout)
        return ready[0] if ready else None

    def _finish(self, ref):
        _, index, actor = self._busy.pop(id(ref))
        self._by_index.pop(index, None)
        self._release(actor)

    def _release(self, actor):
        self._idle.append(actor)
        self._submit_waiting()

    def _submit_waiting(self):
        while self._idle and self._waiting:
            fn, value = self._waiting.pop(0)
            self.submit(fn, value)
