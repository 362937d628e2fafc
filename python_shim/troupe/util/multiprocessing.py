"""A multiprocessing.Pool on troupe actors, as Ray's
ray.util.multiprocessing.Pool: code written for the standard library's Pool
runs its work on the cluster's workers (any node) by changing the import.

    from troupe.util.multiprocessing import Pool

    with Pool(4) as pool:
        print(pool.map(str.upper, ["a", "b"]))

Each of the pool's processes is an actor (one CPU each unless
ray_remote_args say otherwise) that ran `initializer(*initargs)` first.
Work goes in chunks (`chunksize`, as the standard library picks it when not
given) to the processes in turn; the function travels
once per call of map/imap/... as an object ref. imap and imap_unordered
read their iterable as results are taken, keeping two chunks per process
under way (as Ray's: an endless iterable works). An exception in the
function is raised by get (or the iterator) as its own class, with the
remote traceback.
"""
import collections
import itertools
import multiprocessing
import threading
import weakref

import troupe


class _PoolProcess:
    def __init__(self, initializer, initargs):
        if initializer is not None:
            initializer(*initargs)

    def run(self, func, chunk, star):
        return [func(*args) if star else func(args) for args in chunk]

    def ping(self):
        return True


# Submitted refs kept before the finished ones are dropped from the list.
_PRUNE_AT = 4096


class AsyncResult:
    """The result of apply_async, map_async or starmap_async."""

    def __init__(self, refs, flatten, callback=None, error_callback=None):
        self._refs = refs
        self._flatten = flatten
        self._outcome = None  # (ok, value) once known
        # As the standard library's: the result counts as ready (ready(),
        # wait(), get(), the pool's join()) once its callback has run.
        self._called_back = threading.Event()
        if callback is not None or error_callback is not None:
            threading.Thread(target=self._call_back, args=(callback, error_callback), daemon=True,
                             name="troupe-pool-callback").start()
        else:
            self._called_back.set()

    def _settle(self, timeout):
        if self._outcome is None:
            try:
                chunks = troupe.get(self._refs, timeout=timeout)
                value = [x for chunk in chunks for x in chunk] if self._flatten else chunks[0][0]
                self._outcome = (True, value)
            except troupe.exceptions.GetTimeoutError:
                # The standard library's (not the builtin TimeoutError).
                raise multiprocessing.TimeoutError(f"the result is not ready within {timeout} s") from None
            except Exception as e:
                self._outcome = (False, e)
        return self._outcome

    def _call_back(self, callback, error_callback):
        try:
            ok, value = self._settle(None)
            if ok and callback is not None:
                callback(value)
            elif not ok and error_callback is not None:
                error_callback(value)
        finally:
            self._called_back.set()

    def get(self, timeout=None):
        ok, value = self._settle(timeout)
        self._called_back.wait(timeout)
        if not ok:
            raise value
        return value

    def wait(self, timeout=None):
        troupe.wait(list(self._refs), num_returns=len(self._refs), timeout=timeout)
        self._called_back.wait(timeout)

    def ready(self):
        if not self._called_back.is_set():
            return False
        ready, _ = troupe.wait(list(self._refs), num_returns=len(self._refs), timeout=0)
        return len(ready) == len(self._refs)

    def successful(self):
        if not self.ready():
            raise ValueError("the result is not ready")
        return self._settle(None)[0]


class Pool:
    """Pool(processes=None, initializer=None, initargs=None,
    maxtasksperchild=None, context=None, ray_address=None,
    ray_remote_args=None): `processes` actors (default: as many as the
    cluster's CPUs hold at each one's num_cpus, 1 unless ray_remote_args
    say). Connects with troupe.init(address=ray_address) when troupe is
    not initialized yet. maxtasksperchild and context are taken for the
    standard library's signature and not used."""

    def __init__(self, processes=None, initializer=None, initargs=None, maxtasksperchild=None, context=None,
                 ray_address=None, ray_remote_args=None):
        if not troupe.is_initialized():
            troupe.init(address=ray_address)
        options = {"num_cpus": 1, **dict(ray_remote_args or {})}
        if processes is None:
            # As many as the cluster's CPUs hold at each one's num_cpus.
            per = options["num_cpus"]
            cpus = troupe.cluster_resources().get("CPU", 1)
            processes = max(1, int(cpus // per) if isinstance(per, (int, float)) and per > 0 else int(cpus))
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise ValueError(f"processes must be an int >= 1, got {processes!r}")
        if initializer is not None and not callable(initializer):
            raise TypeError(f"initializer must be callable, got a {type(initializer).__name__}")
        _check_room(processes, options)
        cls = troupe.remote(_PoolProcess).options(**options)
        self._processes = [cls.remote(initializer, tuple(initargs or ())) for _ in range(processes)]
        self._in_flight = []  # refs of work submitted (some may have finished)
        self._callbacks = []  # events of the async results' callbacks not known to have run
        self._turn = 0
        self._lock = threading.Lock()
        self._closed = False
        self._lazy_runs = weakref.WeakSet()  # imap iterators not read to their end (join submits their rest)
        # Every process ran its initializer (its error is raised here).
        troupe.get([p.ping.remote() for p in self._processes])

    # -- submitting ------------------------------------------------------

    def _check_open(self):
        if self._closed:
            raise ValueError("Pool not running (close() or terminate() was called)")

    def _submit(self, func_ref, chunk, star):
        with self._lock:
            if not self._processes:
                raise ValueError("Pool not running: terminate() or join() ended its processes")
            i = self._turn % len(self._processes)
            self._turn += 1
            ref = self._processes[i].run.remote(func_ref, chunk, star)
            self._in_flight.append(ref)
            if len(self._in_flight) > _PRUNE_AT:  # forget what finished, now and then
                _, self._in_flight = troupe.wait(self._in_flight, num_returns=len(self._in_flight), timeout=0)
            return ref

    def _func_ref(self, func, what, shown=None):
        """`func` put for the processes; `shown`: the user's function when
        `func` wraps it with its arguments (apply_async)."""
        self._check_open()
        if not callable(func):
            raise TypeError(f"func must be callable, got a {type(func).__name__}")
        try:
            return troupe.put(func)
        except TypeError as e:
            named = shown if shown is not None else func
            also = " (or its arguments)" if shown is not None else ""
            raise TypeError(f"Pool.{what}: func {getattr(named, '__qualname__', named)!r}{also} cannot be sent to "
                            f"the pool's processes: {e}") from e

    def _chunks(self, func, iterable, chunksize, star, what):
        func_ref = self._func_ref(func, what)
        items = list(iterable)
        if chunksize is None:
            chunksize, extra = divmod(len(items), len(self._processes) * 4)
            chunksize = max(1, chunksize + (1 if extra else 0))
        _check_chunksize(chunksize)
        return [self._submit(func_ref, items[i:i + chunksize], star) for i in range(0, len(items), chunksize)]

    def _lazy(self, func, iterable, chunksize, what):
        """`iterable`'s chunks, submitted as their results are taken: two
        per process under way (the first of them now, as Ray's)."""
        func_ref = self._func_ref(func, what)
        _check_chunksize(chunksize)
        run = _LazyRun(self, func_ref, iter(iterable), chunksize)
        run.fill(2 * len(self._processes))
        self._lazy_runs.add(run)
        return run

    # -- the standard library's methods ----------------------------------

    def apply(self, func, args=(), kwds=None):
        return self.apply_async(func, args, kwds).get()

    def apply_async(self, func, args=(), kwds=None, callback=None, error_callback=None):
        self._check_open()
        if not callable(func):
            raise TypeError(f"func must be callable, got a {type(func).__name__}")
        call = self._func_ref(_Call(func, tuple(args), dict(kwds or {})), "apply_async", shown=func)
        return self._result([self._submit(call, [()], True)], False, callback, error_callback)

    def map(self, func, iterable, chunksize=None):
        return self.map_async(func, iterable, chunksize).get()

    def map_async(self, func, iterable, chunksize=None, callback=None, error_callback=None):
        return self._result(self._chunks(func, iterable, chunksize, False, "map"), True, callback, error_callback)

    def starmap(self, func, iterable, chunksize=None):
        return self.starmap_async(func, iterable, chunksize).get()

    def starmap_async(self, func, iterable, chunksize=None, callback=None, error_callback=None):
        return self._result(self._chunks(func, iterable, chunksize, True, "starmap"), True, callback,
                            error_callback)

    def _result(self, refs, flatten, callback, error_callback):
        result = AsyncResult(refs, flatten, callback, error_callback)
        if callback is not None or error_callback is not None:
            with self._lock:
                # join() waits for the callbacks too; those that ran go.
                self._callbacks = [e for e in self._callbacks if not e.is_set()] + [result._called_back]
        return result

    def imap(self, func, iterable, chunksize=1):
        """Results in the order of `iterable`, each as soon as its chunk is
        done; `iterable` is read as results are taken."""
        run = self._lazy(func, iterable, chunksize, "imap")

        def results():
            while True:
                ref = run.take()
                if ref is None:
                    return
                yield from troupe.get(ref)

        return results()

    def imap_unordered(self, func, iterable, chunksize=1):
        """Results in the order their chunks finish; `iterable` is read as
        results are taken."""
        run = self._lazy(func, iterable, chunksize, "imap_unordered")

        def results():
            while True:
                ref = run.take(unordered=True)
                if ref is None:
                    return
                yield from troupe.get(ref)

        return results()

    def close(self):
        """No more work is taken; what was submitted runs on."""
        self._closed = True

    def join(self):
        """Waits for the work submitted, then ends the processes (after
        close). As the standard library's, that is all of an imap's items:
        what its iterator has not submitted yet is submitted now (an endless
        iterable never ends)."""
        if not self._closed:
            raise ValueError("join() needs close() or terminate() first")
        if self._processes:
            for run in list(self._lazy_runs):
                run.fill(None)
        with self._lock:
            pending = list(self._in_flight)
            callbacks = list(self._callbacks)
        if pending:
            troupe.wait(pending, num_returns=len(pending))
        for called_back in callbacks:
            called_back.wait()
        self._end()

    def terminate(self):
        """Ends the processes now: work in flight fails (ActorDiedError)."""
        self._closed = True
        self._end()

    def _end(self):
        for run in list(self._lazy_runs):
            run.ended_by_pool = True
        for p in self._processes:
            troupe.kill(p)
        self._processes = []

    def __enter__(self):
        self._check_open()
        return self

    def __exit__(self, *exc):
        self.terminate()  # as the standard library's Pool


def _check_chunksize(chunksize):
    if isinstance(chunksize, bool) or not isinstance(chunksize, int) or chunksize < 1:
        raise ValueError(f"chunksize must be an int >= 1, got {chunksize!r}")


def _check_room(processes, options):
    """As Ray's: more processes than the cluster's CPUs hold is a ValueError
    at once (their actors would wait for ever to be placed)."""
    per = options.get("num_cpus", 1)
    total = troupe.cluster_resources().get("CPU", 0)
    if isinstance(per, (int, float)) and per > 0 and processes * per > total:
        raise ValueError(f"Pool(processes={processes}) needs {processes * per:g} CPUs ({per:g} per process) and the "
                         f"cluster has {total:g}: ask for fewer processes, or less per process with "
                         "ray_remote_args={'num_cpus': ...}")


class _LazyRun:
    """An imap's chunks: submitted as results are taken (take), or all at
    once (fill(None), for join). Thread-safe: join may run on another
    thread than the one reading the results."""

    def __init__(self, pool, func_ref, items, chunksize):
        self._pool, self._func_ref, self._items, self._chunksize = pool, func_ref, items, chunksize
        self._refs = collections.deque()  # submitted, result not taken yet
        self._ended = False  # the iterable gave its last item
        self.ended_by_pool = False  # terminate() or join() ended the processes first
        self._lock = threading.Lock()

    def fill(self, n):
        """Submits up to n more chunks (None: the rest)."""
        with self._lock:
            while not self._ended and (n is None or n > 0):
                chunk = list(itertools.islice(self._items, self._chunksize))
                if not chunk:
                    self._ended = True
                    break
                self._refs.append(self._pool._submit(self._func_ref, chunk, False))
                n = None if n is None else n - 1

    def take(self, unordered=False):
        """The next chunk's ref (the first done, `unordered`), one more
        chunk submitted in its place; None at the end."""
        with self._lock:
            refs = list(self._refs)
            cut_short = not refs and not self._ended and self.ended_by_pool
        if cut_short:
            # Its items past those taken were never run: say so rather
            # than end as if the iterable had.
            raise ValueError("Pool not running: terminate() ended its processes before this imap's remaining items "
                             "were run")
        if not refs:
            return None
        if unordered:
            done, _ = troupe.wait(refs, num_returns=1)
            ref = done[0]
        else:
            ref = refs[0]
        with self._lock:
            del self._refs[next(i for i, r in enumerate(self._refs) if r is ref)]
        if not self._pool._closed or self._pool._processes:
            self.fill(1)
        return ref


class _Call:
    """apply_async's function with its arguments, called as one item."""

    def __init__(self, func, args, kwds):
        self.func, self.args, self.kwds = func, args, kwds

    def __call__(self):
        return self.func(*self.args, **self.kwds)
