"""The Ray-shaped API on an embedded cluster: tasks, actors, refs, put/get,
wait, options, errors by class, named actors, cluster information."""
import asyncio
import collections
import copy
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import troupe
from conftest import wait_until, when_blocked_in
from troupe.exceptions import ActorDiedError, ConfigError, GetTimeoutError, TaskError

pytestmark = pytest.mark.usefixtures("cluster")


@troupe.remote
def square(x):
    return x * x


@troupe.remote
def add(a, b):
    return a + b


@troupe.remote
class Counter:
    def __init__(self, start=0):
        self.n = start

    def add(self, k=1):
        self.n += k
        return self.n

    def pid(self):
        return os.getpid()

    def actor_id(self):
        return troupe.get_runtime_context().get_actor_id()


def test_troupe_util_is_there_right_after_import():
    # As ray.util after `import ray`: the docs' node-resource snippet used
    # troupe.util before anything had imported it, and failed.
    code = "import troupe; print(troupe.util.ActorPool.__name__, troupe.util.get_node_ip_address.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ActorPool", "get_node_ip_address"]


def test_tasks_and_chained_refs():
    assert troupe.get([square.remote(i) for i in range(8)], timeout=60) == [i * i for i in range(8)]
    chained = add.remote(square.remote(3), square.remote(4))
    assert troupe.get(add.remote(chained, 1), timeout=60) == 26


def test_tasks_that_wait_for_tasks_lend_their_cpu():
    # Five tasks of one CPU each on two CPUs: top waits for two middles,
    # each middle for a leaf. Without lending, top and a middle hold both
    # CPUs and the leaves never start (the gets time out and say so).
    @troupe.remote
    def leaf(x):
        return x + 1

    @troupe.remote
    def middle(x):
        return troupe.get(leaf.remote(x), timeout=60) * 10

    @troupe.remote
    def top(x):
        return sum(troupe.get([middle.remote(x), middle.remote(x + 1)], timeout=90))

    assert troupe.get(top.remote(1), timeout=180) == 50


@troupe.remote
class Signal:
    def __init__(self):
        self.event = asyncio.Event()
        self.waiting = 0

    async def wait(self):
        self.waiting += 1
        await self.event.wait()

    async def send(self):
        self.event.set()

    def waiters(self):
        return self.waiting


def test_a_task_sent_after_tasks_that_wait_runs_beside_them():
    # Ray's signal pattern with tasks: two waiters hold both executors the
    # cluster fits; the setter must not queue behind a waiter (it would
    # wait for ever) but run on an executor that the lent CPUs make room for.
    @troupe.remote
    def waiter(signal, i):
        troupe.get(signal.wait.remote(), timeout=60)
        return i

    @troupe.remote
    def setter(signal):
        troupe.get(signal.send.remote(), timeout=60)
        return "set"

    signal = Signal.remote()
    waiting = [waiter.remote(signal, i) for i in range(2)]
    wait_until(lambda: troupe.get(signal.waiters.remote(), timeout=60) == 2, what="both waiters to wait")
    wait_until(lambda: troupe.available_resources().get("CPU") == 2.0, what="both waiters to lend their CPUs")
    assert troupe.get(setter.remote(signal), timeout=60) == "set"
    assert troupe.get(waiting, timeout=60) == [0, 1]


def test_refs_a_task_returns_outlive_its_idle_executor():
    # The task's worker owns what it put: its executor is kept, and lends
    # its CPU once idle, so the cluster is whole again and the refs resolve.
    @troupe.remote
    def chunks(n):
        return [troupe.put(bytes([i]) * 1000) for i in range(n)]

    refs = troupe.get(chunks.remote(3), timeout=60)
    wait_until(lambda: troupe.available_resources().get("CPU") == 2.0, what="the idle executor to lend its CPU")
    assert troupe.get(refs, timeout=60) == [bytes([i]) * 1000 for i in range(3)]


def test_actor_calls_run_in_order():
    c = Counter.remote(10)
    refs = [c.add.remote(1) for _ in range(100)]
    assert troupe.get(refs, timeout=60) == list(range(11, 111))
    assert troupe.get(c.add.remote(k=5), timeout=60) == 115


def test_an_actor_whose_handles_are_all_gone_ends_and_frees_its_cpu():
    # Ray's rule: a loop that makes a one-CPU actor per round and drops it
    # must not fill the cluster (two CPUs here: the third round would wait
    # for ever if dropped actors lived on).
    for i in range(5):
        c = Counter.options(num_cpus=1).remote(i)
        assert troupe.get(c.add.remote(), timeout=60) == i + 1
    # A call in flight keeps its actor until it is answered.
    actor = c._actor
    ref = c.add.remote(10)
    del c
    assert troupe.get(ref, timeout=60) == 15
    del ref
    wait_until(lambda: actor.info()["state"] == "DEAD", what="the dropped actor's end")
    assert "out of scope" in actor.info()["death_cause"]


@troupe.remote
class HandleKeeper:
    def keep(self, handle):
        self.handle = handle
        return True

    def use(self):
        return troupe.get(self.handle.add.remote(5), timeout=60)

    def drop(self):
        self.handle = None
        return True


def test_a_handle_passed_to_another_process_keeps_its_actor():
    holder = HandleKeeper.remote()
    c = Counter.remote()
    actor = c._actor
    assert troupe.get(holder.keep.remote(c), timeout=60)
    del c
    # The creator holds no handle now; the holder's borrowed one keeps it.
    assert troupe.get(holder.use.remote(), timeout=60) == 5
    assert actor.info()["state"] == "ALIVE"
    assert troupe.get(holder.drop.remote(), timeout=60)
    wait_until(lambda: actor.info()["state"] == "DEAD", what="the actor's end once the holder let go")
    # A copy of a handle holds the actor as the original does.
    d = Counter.remote()
    d_actor = d._actor
    copied = copy.deepcopy({"handle": d})["handle"]
    del d
    assert troupe.get(copied.add.remote(), timeout=60) == 1
    assert d_actor.info()["state"] == "ALIVE"
    del copied
    wait_until(lambda: d_actor.info()["state"] == "DEAD", what="the copied handle's actor's end")
    # Named and detached actors are not ended this way: kill them.
    named = Counter.options(name="kept_by_name").remote()
    named_actor = named._actor
    del named
    assert troupe.get(troupe.get_actor("kept_by_name").add.remote(), timeout=60) == 1
    assert named_actor.info()["state"] == "ALIVE"
    troupe.kill(troupe.get_actor("kept_by_name"))


@troupe.remote
class Sleeper:
    def __init__(self):
        self.inside = 0
        self.both_inside = None  # an asyncio.Event, made on the worker's loop

    async def double_later(self, x):
        await asyncio.sleep(0.01)
        return 2 * x

    def threads(self):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))

    async def fail_later(self):
        await asyncio.sleep(0.01)
        raise ValueError("async bad value")

    async def get_nested(self, refs):
        # Awaiting a ref leaves the loop free for the actor's other calls
        # (a troupe.get on the loop itself would hold them all up).
        return await refs[0]

    async def wait_for_peer(self):
        # True once a second call is inside too: only calls that run at
        # the same time on the loop can both see it (bounded if not).
        if self.both_inside is None:
            self.both_inside = asyncio.Event()
        self.inside += 1
        if self.inside >= 2:
            self.both_inside.set()
        try:
            await asyncio.wait_for(self.both_inside.wait(), timeout=30)
            return True
        except asyncio.TimeoutError:
            return False


def test_async_actor_methods_run_on_an_event_loop():
    s = Sleeper.remote()
    assert troupe.get([s.double_later.remote(i) for i in range(5)], timeout=60) == [0, 2, 4, 6, 8]
    with pytest.raises(ValueError, match="async bad value") as info:
        troupe.get(s.fail_later.remote(), timeout=60)
    assert isinstance(info.value, TaskError) and "fail_later" in str(info.value)
    assert troupe.get(s.get_nested.remote([square.remote(7)]), timeout=60) == 49
    # A class with async methods and no max_concurrency runs calls at once.
    assert troupe.get([s.wait_for_peer.remote(), s.wait_for_peer.remote()], timeout=60) == [True, True]


def test_async_remote_functions_run_to_their_end():
    @troupe.remote
    async def later(x):
        await asyncio.sleep(0.01)
        return x + await square.remote(x)

    assert troupe.get(later.remote(3), timeout=60) == 12


def test_lambda_closure_and_kwargs():
    offset = 7
    f = troupe.remote(lambda x, y=1: x + y + offset)
    assert troupe.get(f.remote(1, y=2), timeout=60) == 10


def test_a_task_or_actor_that_calls_a_remote_function_pickles():
    # Defined here, so pickled by value with what they use: `mid` and
    # `Caller` carry `leaf`, a RemoteFunction the driver has used (its
    # session key and client must not travel).
    @troupe.remote
    def leaf(x):
        return x + 1

    @troupe.remote
    def mid(x):
        return troupe.get(leaf.remote(x), timeout=60) * 10

    @troupe.remote
    class Caller:
        def call(self, x):
            return troupe.get(leaf.remote(x), timeout=60)

    assert troupe.get(leaf.remote(1), timeout=60) == 2
    assert troupe.get(mid.remote(1), timeout=60) == 20
    assert troupe.get(Caller.remote().call.remote(5), timeout=60) == 6


def test_retry_exceptions_runs_a_failing_task_again(tmp_path):
    @troupe.remote(max_retries=3, retry_exceptions=True)
    def flaky(path):
        n = int(open(path).read()) + 1 if os.path.exists(path) else 1
        with open(path, "w") as f:
            f.write(str(n))
        if n < 3:
            raise ValueError(f"attempt {n}")
        return n

    assert troupe.get(flaky.remote(str(tmp_path / "a")), timeout=60) == 3
    # Only the classes listed are retried.
    with pytest.raises(ValueError, match="attempt 1"):
        troupe.get(flaky.options(retry_exceptions=[KeyError]).remote(str(tmp_path / "b")), timeout=60)
    # Retries run out: the last attempt's error is the task's.
    with pytest.raises(ValueError, match="attempt 2"):
        troupe.get(flaky.options(max_retries=1).remote(str(tmp_path / "c")), timeout=60)
    # Without retry_exceptions, one attempt.
    with pytest.raises(ValueError, match="attempt 1"):
        troupe.get(flaky.options(retry_exceptions=False).remote(str(tmp_path / "d")), timeout=60)
    with pytest.raises(ConfigError, match="retry_exceptions must be"):
        flaky.options(retry_exceptions="yes")

    # Each attempt gets the arguments as they arrived: one that changed them
    # before raising used to hand its changes to the next.
    # A tensor pickles out of band, as a view of its memory: each attempt
    # still gets its own copy. (A NumPy argument arrives read-only, as in
    # Ray.)
    @troupe.remote(max_retries=2, retry_exceptions=True)
    def mutating(items, counts, tensor):
        items.append("x")
        counts["n"] = counts.get("n", 0) + 1
        tensor.add_(1)
        if len(items) < 3 and tensor[0] < 3:
            raise ValueError(f"len={len(items)} tensor={float(tensor[0]):g}")
        return items, counts

    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="len=1 tensor=1"):
        troupe.get(mutating.remote([], {}, torch.zeros(1000)), timeout=60)


@troupe.remote
def identity(x):
    return x


@troupe.remote
def slow(seconds, value):
    time.sleep(seconds)  # a task that takes a while: the work, not a wait for state
    return value


@troupe.remote
class Log:
    def __init__(self):
        self.items = []

    def add(self, v):
        self.items.append(v)
        return v

    def items_(self):
        return self.items


def test_one_callers_actor_calls_run_in_the_order_made_when_one_waits_for_an_argument():
    # As Ray: a call made after one that waits for its argument runs after
    # it. The later ones used to overtake it.
    log = Log.remote()
    troupe.get(log.items_.remote(), timeout=60)
    calls = [log.add.remote(slow.remote(0.5, "waited")), log.add.remote("ready"), log.add.remote(troupe.put("put"))]
    troupe.get(calls, timeout=60)
    assert troupe.get(log.items_.remote(), timeout=60) == ["waited", "ready", "put"]
    # A call cancelled while it waits for its argument holds up nothing.
    never = slow.remote(600, "never")
    try:
        waiting = log.add.remote(never)
        troupe.cancel(waiting)
        assert troupe.get(log.add.remote("after"), timeout=60) == "after"
    finally:
        troupe.cancel(never, force=True)


@troupe.remote(concurrency_groups={"control": 1})
class Stoppable:
    def __init__(self):
        self.stopped = threading.Event()

    def wait_for_stop(self):
        return self.stopped.wait(60)

    def report(self, value):
        return value

    @troupe.method(concurrency_group="control")
    def stop(self):
        self.stopped.set()


def test_calls_to_a_grouped_actor_keep_no_order_that_could_deadlock_them():
    # As Ray: only an actor that runs one call at a time keeps a caller's
    # order. Here report waits (in the caller) for wait_for_stop, which
    # waits for stop: held behind report, stop never ran.
    s = Stoppable.remote()
    waited = s.wait_for_stop.remote()
    reported = s.report.remote(waited)
    troupe.get(s.stop.remote(), timeout=60)
    assert troupe.get(reported, timeout=60) is True


@troupe.remote(max_restarts=1, max_task_retries=-1)
class Configured:
    def __init__(self, cfg, nested):
        self.cfg, self.nested = cfg, nested

    def pid(self):
        return os.getpid()

    def config(self):
        return self.cfg, troupe.get(self.nested[0], timeout=60)


def test_refs_a_restart_or_a_retry_needs_stay_held_by_their_caller(tmp_path):
    # An actor's constructor refs: a restart runs it again with them,
    # although the driver dropped its own (they used to be freed, and the
    # restart failed with ObjectLostError).
    a = Configured.remote(troupe.put({"lr": 0.1}), [troupe.put("nested")])
    first = troupe.get(a.pid.remote(), timeout=60)
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: troupe.get(a.pid.remote(), timeout=60) != first, what="the actor restarted")
    assert troupe.get(a.config.remote(), timeout=60) == ({"lr": 0.1}, "nested")

    # A task's nested refs: its retry after its worker died sends them again.
    @troupe.remote(max_retries=2)
    def dies_once(top, nested, flag):
        if not os.path.exists(flag):
            open(flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return top, troupe.get(nested[0], timeout=60)

    ref = dies_once.remote(troupe.put("top"), [troupe.put("inside")], str(tmp_path / "died"))
    assert troupe.get(ref, timeout=90) == ("top", "inside")

    # Refs inside a top-level argument that was another call's answer (the
    # map/reduce shape): that value goes inline, and the refs in it were
    # held by no one once the first attempt's worker died.
    @troupe.remote
    def wrap(x):
        return x

    @troupe.remote(max_retries=2)
    def dies_once_then_reads(listed, flag):
        if not os.path.exists(flag):
            open(flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return troupe.get(listed[0], timeout=60)

    ref = dies_once_then_reads.remote(wrap.remote([troupe.put("inside an answer")]), str(tmp_path / "died-2"))
    assert troupe.get(ref, timeout=90) == "inside an answer"


def test_get_of_a_list_raises_an_error_without_waiting_for_the_rest():
    # As Ray: the error of one ref ends the get; it used to wait for every
    # other ref first (for ever, for one that never ends).
    blocked = slow.remote(600, "never")
    try:
        with pytest.raises(TaskError, match="ZeroDivisionError"):
            troupe.get([blocked, troupe.remote(lambda: 1 // 0).remote()], timeout=120)
    finally:
        troupe.cancel(blocked, force=True)


def test_a_node_address_resource_pins_work_to_that_node():
    # Ray's node:<address> resource: one per node, asked for in parts.
    import troupe.util

    address = troupe.util.get_node_ip_address()
    key = f"node:{address}"
    assert troupe.cluster_resources().get(key, 0) >= 1
    pinned = troupe.remote(lambda: troupe.util.get_node_ip_address()).options(resources={key: 0.01})
    assert troupe.get(pinned.remote(), timeout=60) == address
    assert any(key in n["Resources"] for n in troupe.nodes())


def test_awaits_in_flight_share_one_thread():
    # Each `await ref` used to start a thread: 5,000 awaits in flight were
    # 3,000 threads. The tasks here take 5 s on two CPUs: most refs are
    # not there while the threads are counted.
    async def main():
        before = threading.active_count()
        pending = [asyncio.ensure_future(_awaited(r)) for r in [slow.remote(0.05, i) for i in range(200)]]
        await asyncio.sleep(0)  # every await has started
        during = threading.active_count()
        values = await asyncio.wait_for(asyncio.gather(*pending), 120)
        return before, during, values

    before, during, values = asyncio.run(main())
    assert values == list(range(200))
    assert during - before <= 2, (before, during)
    # ref.future() goes through the same thread.
    assert square.remote(6).future().result(timeout=60) == 36


async def _awaited(ref):
    return await ref


def test_refs_to_one_object_are_equal_and_ids_are_stable_and_unique():
    p = troupe.put("v")
    back = troupe.get(identity.remote([p]), timeout=60)[0]
    assert p == back and hash(p) == hash(back) and {p: 1}[back] == 1
    r = slow.remote(0, "x")
    before = r.hex()
    troupe.get(identity.remote([r]), timeout=60)  # sent on nested: stored
    assert r.hex() == before and repr(r) == f"ObjectRef({before})"
    seen = set()
    for _ in range(200):
        x = slow.remote(0, 1)
        seen.add(x.hex())
        troupe.get(x, timeout=60)
        del x
    assert len(seen) == 200
    pair = troupe.remote(num_returns=2)(lambda: (1, 2)).remote()
    assert pair[0] != pair[1] and pair[0] == pair[0] and len({pair[0].hex(), pair[1].hex()}) == 2


def test_an_argument_that_cannot_be_pickled_is_named():
    with pytest.raises(TypeError, match=r"task square: argument 0 \(a lock\) cannot be pickled"):
        square.remote(threading.Lock())
    c = Counter.remote()
    with pytest.raises(TypeError, match=r"actor method add: keyword argument 'k' \(a lock\) cannot be pickled"):
        c.add.remote(k=threading.Lock())
    with pytest.raises(ConfigError, match="lifetime must be"):
        Counter.options(lifetime="bogus")
    # troupe.put's value too (its error was pickle's alone, naming nothing).
    with pytest.raises(TypeError, match=r"troupe.put: the value \(a dict\) cannot be pickled: .*lock"):
        troupe.put({"k": threading.Lock()})


def test_a_result_that_cannot_travel_is_named():
    @troupe.remote
    def counts_up():
        # Not a generator function (that would stream): it returns one.
        return (i for i in range(3))

    @troupe.remote
    def makes_lock():
        return threading.Lock()

    with pytest.raises(TypeError, match="task .*counts_up returned a generator, but it is no generator function: "
                                        "return a list"):
        troupe.get(counts_up.remote(), timeout=60)
    with pytest.raises(TypeError, match="task .*makes_lock returned a lock that cannot be pickled"):
        troupe.get(makes_lock.remote(), timeout=60)

    @troupe.remote
    class Streams:
        def items(self, n):
            yield from range(n)

        async def later(self):
            yield 1

    # A generator function with a fixed num_returns: one value per return,
    # as Ray's static generators (it was refused).
    streams = Streams.remote()
    assert troupe.get(streams.items.options(num_returns=1).remote(1), timeout=60) == 0
    assert troupe.get(streams.items.options(num_returns=3).remote(3), timeout=60) == [0, 1, 2]
    assert troupe.get(add.remote(streams.items.options(num_returns=1).remote(1), 5), timeout=60) == 5
    with pytest.raises(ValueError, match="yielded 2 values, but num_returns=3"):
        troupe.get(streams.items.options(num_returns=3).remote(2)[0], timeout=60)
    with pytest.raises(ValueError, match="yielded 2 values, but num_returns=1"):
        troupe.get(streams.items.options(num_returns=1).remote(2), timeout=60)

    @troupe.remote(num_returns=2)
    def pair():
        yield "a"
        yield "b"

    assert troupe.get(pair.remote(), timeout=60) == ["a", "b"]
    with pytest.raises(TypeError, match="Streams.later returned an async generator"):
        troupe.get(streams.later.options(num_returns=1).remote(), timeout=60)


def test_a_constructor_that_raises_is_named_in_the_actors_death():
    @troupe.remote
    class Refuses:
        def __init__(self):
            raise ValueError("ctor-bad")

        def ping(self):
            return 1

    r = Refuses.remote()
    with pytest.raises(ActorDiedError) as e:
        troupe.get(r.ping.remote(), timeout=60)
    text = str(e.value)
    assert "ValueError: ctor-bad" in text and "Traceback" in text, text
    assert "pybind11" not in text and "error_already_set" not in text and "troupe::Error" not in text, text


def test_put_large_array_zero_copy():
    a = np.arange(16 << 20, dtype=np.float32)  # 64 MiB
    ref = troupe.put(a)
    total = troupe.remote(lambda x: float(x.sum()))
    assert troupe.get(total.remote(ref), timeout=120) == float(a.sum())
    back = troupe.get(ref, timeout=60)
    assert back.shape == a.shape and np.array_equal(back[:10], a[:10])


def test_a_borrower_fetching_more_than_the_write_bound_at_once_gets_it_all():
    # 312 MiB asked for at once (one get of a list sends each object's
    # request together): past the connection's write bound of 256 MiB the
    # owner dropped the borrower as "not reading", and its gets failed with
    # ObjectLostError although it was reading.
    refs = [troupe.put(np.full(13 << 20, float(i + 1))) for i in range(3)]  # 104 MiB each

    @troupe.remote
    def sum_all(arrays):
        return sum(float(a.sum()) for a in troupe.get(arrays, timeout=240))

    assert troupe.get(sum_all.remote(refs), timeout=300) == float(6 * (13 << 20))


def test_a_value_is_what_it_was_when_sent():
    # As Ray's object store: writing an array after put or .remote() is not
    # seen (large arrays used to travel as views of the caller's memory).
    a = np.zeros(1 << 20)  # 8 MiB: out of band
    ref = troupe.put(a)
    a[0] = 42
    first = troupe.remote(lambda x: float(x[0]))
    assert troupe.get(ref, timeout=60)[0] == 0 and troupe.get(first.remote(ref), timeout=60) == 0
    buf = np.zeros(1 << 20)
    refs = []
    for i in range(4):
        buf[:] = i
        refs.append(first.remote(buf))
    assert troupe.get(refs, timeout=120) == [0.0, 1.0, 2.0, 3.0]
    # What a get returns cannot change: a NumPy array is read-only, and one
    # put again travels without a copy (the same memory).
    got = troupe.get(ref, timeout=60)
    assert not got.flags.writeable
    assert np.shares_memory(troupe.get(troupe.put(got), timeout=60), got)


def test_large_array_result_and_argument():
    make = troupe.remote(lambda n: np.ones(n, dtype=np.float64))
    out = troupe.get(make.remote(4 << 20), timeout=120)
    assert out.nbytes == 32 << 20 and out[-1] == 1.0
    c = Counter.remote(0)
    assert troupe.get(c.add.remote(np.int64(3)), timeout=60) == 3


def test_values_with_thousands_of_arrays():
    # Each NumPy array is an out-of-band buffer, a frame attachment; a frame
    # takes at most 4096. A value with more used to make the receiver close
    # the connection: the task failed as WorkerCrashedError, a put value as
    # ObjectLostError. Such a value is pickled in band instead.
    arrays = [np.full(4096, i, dtype=np.float64) for i in range(5000)]
    total = troupe.remote(lambda xs: float(sum(x[0] for x in xs)))
    expected = float(sum(range(5000)))
    assert troupe.get(total.remote(arrays), timeout=120) == expected
    assert troupe.get(total.remote(troupe.put(arrays)), timeout=120) == expected
    back = troupe.get(troupe.remote(lambda n: [np.full(4096, i, dtype=np.float64) for i in range(n)]).remote(5000),
                      timeout=120)
    assert len(back) == 5000 and all(x[0] == i and x.shape == (4096,) for i, x in enumerate(back))


def test_nested_refs_stay_refs():
    inner = troupe.put(41)
    kind = troupe.remote(lambda box: (type(box[0]).__name__, troupe.get(box[0]) + 1))
    assert troupe.get(kind.remote([inner]), timeout=60) == ("ObjectRef", 42)
    from_call = square.remote(5)
    assert troupe.get(kind.remote([from_call]), timeout=60) == ("ObjectRef", 26)


def test_a_ref_not_yet_answered_travels_inside_a_value_at_once(tmp_path):
    # As Ray's owner does: sending a pending result on (in a list, to a
    # task, an actor, put) does not wait for it; the receiver's get does.
    # It used to block .remote() until the upstream task ended (for ever,
    # if it never did).
    release = str(tmp_path / "release")

    @troupe.remote
    def held():
        while not os.path.exists(release):
            time.sleep(0.01)
        return 5

    total = troupe.remote(lambda box: sum(troupe.get(box)))
    upstream = held.remote()
    sent = {}

    def send():
        sent["task"] = total.remote([upstream, upstream])
        sent["put"] = troupe.put({"r": upstream})
        sent["actor"] = Counter.remote(0)
        sent["call"] = sent["actor"].add.remote(1)

    t = threading.Thread(target=send)
    t.start()
    t.join(60)
    assert not t.is_alive(), ".remote() or put waited for the ref inside its value"
    assert not troupe.wait([sent["task"]], timeout=0.2)[0]
    open(release, "w").close()
    assert troupe.get(sent["task"], timeout=60) == 10
    assert troupe.get(troupe.get(sent["put"], timeout=60)["r"], timeout=60) == 5
    # A failure upstream is what getting the nested ref raises, typed.
    crash = troupe.remote(lambda: os._exit(1))
    with pytest.raises(TaskError, match="WorkerCrashedError") as failed:
        troupe.get(total.remote([crash.remote()]), timeout=60)
    assert isinstance(failed.value.cause, troupe.exceptions.WorkerCrashedError)


def test_short_tasks_do_not_wait_behind_a_long_one(tmp_path):
    # Two CPUs, one long task and a burst of short ones: those pipelined
    # behind the long one go to the other executor once it is idle
    # (HandBackQueued); before, they waited for the long one to end.
    release, started = str(tmp_path / "release"), str(tmp_path / "started")

    @troupe.remote
    def long_one():
        open(started, "w").close()
        while not os.path.exists(release):
            time.sleep(0.01)
        return "long"

    held = long_one.remote()
    wait_until(lambda: os.path.exists(started), what="the long task started")
    assert troupe.get([square.remote(i) for i in range(30)], timeout=60) == [i * i for i in range(30)]
    open(release, "w").close()
    assert troupe.get(held, timeout=60) == "long"


@troupe.remote
class Napper:
    def ping(self):
        return "pong"

    def sleep(self, seconds):
        threading.Event().wait(seconds)
        return seconds


def test_a_get_that_times_out_says_what_the_value_waits_for():
    # Ray's GetTimeoutError says only that it timed out; a user then looks
    # for why in the dashboard. The first missing value's wait is named.
    pending = Napper.options(resources={"no_node_has_this": 1}).remote()
    with pytest.raises(GetTimeoutError, match=r"no result within 0\.2 s: Napper\.ping on actor \d+: the actor is "
                                              r"PENDING \(.*no_node_has_this.*\)"):
        troupe.get(pending.ping.remote(), timeout=0.2)
    troupe.kill(pending)
    alive = Napper.remote()
    assert troupe.get(alive.ping.remote(), timeout=60) == "pong"
    with pytest.raises(GetTimeoutError, match=r"1 of 2 results not there within 0\.2 s; the first: Napper\.sleep on "
                                              r"actor \d+: the actor \(worker pid \d+\) has not answered it yet"):
        troupe.get([alive.ping.remote(), alive.sleep.remote(30)], timeout=0.2)
    slow = troupe.remote(lambda s: threading.Event().wait(s) or s).options(name="nap")
    ref = slow.remote(30)
    # A call whose argument is not there was never sent: the actor is not to blame.
    with pytest.raises(GetTimeoutError, match=r"no result within 0\.2 s: Napper\.sleep on actor \d+ waits for its "
                                              r"arguments"):
        troupe.get(alive.sleep.remote(ref), timeout=0.2)
    troupe.kill(alive)
    with pytest.raises(GetTimeoutError, match=r"no result within 0\.2 s: task 'nap' (runs on its executor, worker pid "
                                              r"\d+|is queued \(1 queued\) for an executor of \{CPU: 1\}.*)"):
        troupe.get(ref, timeout=0.2)
    troupe.cancel(ref, force=True)


def test_a_get_that_waits_for_an_actor_no_node_can_hold_warns_once(monkeypatch, capsys):
    # The head's warning went to its log only: a driver whose actor asked
    # for a resource no node has waited without a word (Ray warns).
    monkeypatch.setenv("TROUPE_UNPLACEABLE_WARN_MS", "200")
    pending = Napper.options(resources={"no_node_has_this": 1}).remote()
    for _ in range(2):
        with pytest.raises(GetTimeoutError):
            troupe.get(pending.ping.remote(), timeout=1.5)
    said = capsys.readouterr().err  # through sys.stderr (a notebook shows it)
    assert re.search(r"troupe: \(warning\) a get waits for Napper\.ping on actor \d+: the actor is PENDING \(.*"
                     r"no_node_has_this.*at all", said), said
    assert said.count("troupe: (warning)") == 1, said
    troupe.kill(pending)


@troupe.remote
class Keeper:
    def keep(self):
        # Large enough to stay with its owner (a small value travels with its ref).
        return troupe.put(np.arange(2_000_000)), os.getpid()


def _all_threads_stopped(pid):
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue  # a thread that ended
        if state not in ("T", "t"):
            return False
    return True


def test_a_get_of_an_object_whose_owner_does_not_answer_names_the_object_and_its_owner():
    # It said only "no result within 5 s".
    keeper = Keeper.remote()
    ref, pid = troupe.get(keeper.keep.remote(), timeout=60)
    os.kill(pid, signal.SIGSTOP)
    # kill() returns before every thread has stopped: under load the owner's
    # object server served the get first (1 run in 10).
    wait_until(lambda: _all_threads_stopped(pid), timeout=30, what=f"pid {pid} to stop")
    try:
        with pytest.raises(GetTimeoutError, match=rf"no result within 0\.5 s: object \d+ of \S+ \(pid {pid}, actor "
                                                  r"\d+\): its owner has not sent it"):
            troupe.get(ref, timeout=0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert troupe.get(ref, timeout=60)[-1] == 1_999_999
    troupe.kill(keeper)


def test_wait_and_get_timeout():
    slow = troupe.remote(lambda s: threading.Event().wait(s) or s)
    fast_ref, slow_ref = square.remote(2), slow.remote(8)
    ready, not_ready = troupe.wait([slow_ref, fast_ref], num_returns=1, timeout=60)
    assert ready == [fast_ref] and not_ready == [slow_ref]
    ready, not_ready = troupe.wait([slow_ref], num_returns=1, timeout=0.1)
    assert ready == [] and not_ready == [slow_ref]
    with pytest.raises(GetTimeoutError, match=r"no result within 0\.1 s"):
        troupe.get(slow_ref, timeout=0.1)
    with pytest.raises(GetTimeoutError, match=r"1 of 2 results not there within 0\.1 s"):
        troupe.get([fast_ref, slow_ref], timeout=0.1)
    with pytest.raises(ValueError):
        troupe.wait([fast_ref], num_returns=2)
    # As Ray: nothing to wait for is no error; zero of something is.
    assert troupe.wait([]) == ([], [])
    with pytest.raises(ValueError, match="num_returns=0"):
        troupe.wait([fast_ref], num_returns=0)
    # A negative or NaN timeout is refused by name, as Ray does, not taken as
    # "do not wait"; infinity waits without limit.
    for bad in (-1, -0.5, float("nan")):
        with pytest.raises(ValueError, match=f"troupe.get: timeout={float(bad)!r}"):
            troupe.get(fast_ref, timeout=bad)
        with pytest.raises(ValueError, match=f"troupe.wait: timeout={float(bad)!r}"):
            troupe.wait([fast_ref], timeout=bad)
    with pytest.raises(TypeError, match="timeout"):
        troupe.get(fast_ref, timeout="1")
    assert troupe.get(fast_ref, timeout=float("inf")) == 4
    assert troupe.wait([fast_ref], timeout=float("inf"))[0] == [fast_ref]


class _Interrupted(Exception):
    pass


def test_signal_handlers_run_while_get_or_wait_blocks():
    # Ctrl-C in a driver blocked in troupe.get or troupe.wait must raise
    # there (KeyboardInterrupt) instead of waiting on for the result: the
    # native wait runs Python's signal handlers between slices.
    @troupe.remote(max_concurrency=2)
    class Gate:
        def __init__(self):
            self.open = threading.Event()

        def wait(self):
            return self.open.wait(300)

    def on_signal(signum, frame):
        raise _Interrupted()

    previous = signal.signal(signal.SIGUSR1, on_signal)
    gate = Gate.remote()
    try:
        ref = gate.wait.remote()
        for function, call in ((troupe.get, lambda: troupe.get(ref, timeout=30)),
                               (troupe.wait, lambda: troupe.wait([ref], timeout=30))):
            when_blocked_in(function, lambda: os.kill(os.getpid(), signal.SIGUSR1))
            start = time.monotonic()
            with pytest.raises(_Interrupted):
                call()
            assert time.monotonic() - start < 25, f"troupe.{function.__name__} ran on past the signal"
        # The interrupted ref is intact.
        assert troupe.wait([ref], timeout=0) == ([], [ref])
    finally:
        signal.signal(signal.SIGUSR1, previous)
        troupe.kill(gate)


class MyError(Exception):
    pass


class CodedError(Exception):
    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def test_remote_exceptions_keep_their_class():
    @troupe.remote
    def fail(kind):
        if kind == "value":
            raise ValueError("bad value 42")
        raise MyError("mine")

    with pytest.raises(ValueError, match="bad value 42") as info:
        troupe.get(fail.remote("value"), timeout=60)
    assert isinstance(info.value, TaskError) and "Traceback" in str(info.value)
    with pytest.raises(MyError):
        troupe.get(fail.remote("mine"), timeout=60)
    # An error flows on through a task that takes the failed result.
    with pytest.raises(ValueError):
        troupe.get(add.remote(fail.remote("value"), 1), timeout=60)

    @troupe.remote
    class Broken:
        def boom(self):
            raise KeyError("k")

    with pytest.raises(KeyError):
        troupe.get(Broken.remote().boom.remote(), timeout=60)

    # The original's attributes read through the error, as in Ray.
    @troupe.remote
    def coded():
        raise CodedError("with a code", 7)

    with pytest.raises(CodedError) as info:
        troupe.get(coded.remote(), timeout=60)
    assert info.value.code == 7 and info.value.cause.code == 7
    with pytest.raises(AttributeError):
        info.value.no_such_attribute

    # A task that re-raises a nested task's error shows both tracebacks,
    # its own first, as Ray chains them (it showed only the nested one).
    @troupe.remote
    def calls_fail():
        return troupe.get(fail.remote("value"), timeout=60)

    with pytest.raises(ValueError, match="bad value 42") as info:
        troupe.get(calls_fail.remote(), timeout=60)
    text = str(info.value)
    assert text.startswith("ValueError: bad value 42\n\ntask ") and "calls_fail" in text, text
    assert text.index("in calls_fail") < text.index("raise ValueError(\"bad value 42\")"), text
    assert isinstance(info.value.cause, ValueError) and "in calls_fail" in info.value.traceback_str


@troupe.remote(max_restarts=1, max_task_retries=-1)
class Holder:
    def __init__(self, value):
        self.size = len(value)

    def size_and_pid(self):
        return self.size, os.getpid()


def test_large_actor_arguments_and_task_closures():
    # An actor's class and constructor arguments go through the head (which
    # keeps them for restarts). From 16 KiB up they used to travel as
    # attachments the head's messages do not carry: the head closed the
    # driver's connection and every later call failed. Up to the head's
    # limit they work, restarts included; past it, and for a task whose
    # closure is past it, the error names the size, and the driver goes on.
    from troupe import _core

    limit = _core.HEAD_VALUE_LIMIT
    for size in (20_000, 1 << 20, limit - 8192):
        h = Holder.remote(b"x" * size)
        got, pid = troupe.get(h.size_and_pid.remote(), timeout=120)
        assert got == size
    troupe.kill(h, no_restart=False)
    wait_until(lambda: h._actor.info()["restarts"] == 1, what="the actor's restart")
    got, new_pid = troupe.get(h.size_and_pid.remote(), timeout=120)
    assert (got, new_pid != pid) == (limit - 8192, True)  # the restart had the arguments
    big_class = troupe.remote(type("BigClass", (), {"blob": "y" * 40_000, "size": lambda self: len(self.blob)}))
    assert troupe.get(big_class.remote().size.remote(), timeout=120) == 40_000
    with pytest.raises(ConfigError, match=r"actor Holder: .* pickle to \d+ bytes, more than the \d+ .*troupe.put"):
        Holder.remote(b"x" * (limit + 1))
    captured = b"z" * (limit + 1)
    with pytest.raises(ConfigError, match=r"task <lambda>: the function pickles to \d+ bytes"):
        troupe.remote(lambda: len(captured)).remote()
    assert troupe.get(square.remote(5), timeout=60) == 25
    h2 = Holder.remote(troupe.put(b"x" * (limit + 1)))  # the way past the limit
    assert troupe.get(h2.size_and_pid.remote(), timeout=120)[0] == limit + 1


class StrFails(Exception):
    def __str__(self):
        raise RuntimeError("__str__ of StrFails")


class NeedsTwo(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")
        self.a, self.b = a, b


class OwnNew(Exception):
    def __new__(cls, a, b):
        return super().__new__(cls, a, b)


def test_remote_exceptions_that_resist_rebuilding_still_report():
    # Exceptions whose constructor takes other arguments than a message
    # (json's, unicode's, a __new__ of their own, a group) or whose __str__
    # fails reach the caller as a TaskError with their class name, message
    # and remote traceback, not as an error of troupe's own code.
    import json

    @troupe.remote
    def fail(kind):
        if kind == "json":
            json.loads("{oops")
        if kind == "unicode":
            b"\xff".decode("utf-8")
        if kind == "new":
            raise OwnNew(1, 2)
        if kind == "group":
            raise ExceptionGroup("two failed", [ValueError(1), KeyError(2)])
        raise StrFails()

    with pytest.raises(json.JSONDecodeError, match="JSONDecodeError: Expecting property name") as info:
        troupe.get(fail.remote("json"), timeout=60)
    assert isinstance(info.value, TaskError) and "json.loads" in info.value.traceback_str
    with pytest.raises(UnicodeDecodeError, match="can't decode byte 0xff"):
        troupe.get(fail.remote("unicode"), timeout=60)
    with pytest.raises(TaskError, match="OwnNew: \\(1, 2\\)") as info:
        troupe.get(fail.remote("new"), timeout=60)
    assert type(info.value.cause) is OwnNew and "raise OwnNew" in str(info.value)
    with pytest.raises(TaskError, match="ExceptionGroup: two failed") as info:
        troupe.get(fail.remote("group"), timeout=60)
    assert isinstance(info.value.cause, ExceptionGroup)
    with pytest.raises(StrFails, match="StrFails: <the StrFails's str\\(\\) failed>") as info:
        troupe.get(fail.remote("str"), timeout=60)
    assert "raise StrFails()" in info.value.traceback_str


def test_an_exception_whose_init_wants_other_arguments_keeps_its_class():
    # pickle would call NeedsTwo("1 and 2"), which raises: it is rebuilt
    # from its class, args and attributes instead.
    @troupe.remote
    def fail():
        raise NeedsTwo(1, 2)

    with pytest.raises(NeedsTwo, match="NeedsTwo: 1 and 2") as info:
        troupe.get(fail.remote(), timeout=60)
    assert isinstance(info.value, TaskError)
    assert type(info.value.cause) is NeedsTwo and (info.value.cause.a, info.value.cause.b) == (1, 2)


def test_named_actor_kill_and_options():
    c = Counter.options(name="the_counter", max_concurrency=2).remote(1)
    assert troupe.get(c.add.remote(1), timeout=60) == 2
    same = troupe.get_actor("the_counter")
    assert troupe.get(same.add.remote(1), timeout=60) == 3
    troupe.kill(c)
    with pytest.raises(ActorDiedError):
        troupe.get(c.add.remote(1), timeout=60)
    with pytest.raises(ValueError):
        troupe.get_actor("the_counter")


def test_eighty_actors_started_at_once_all_serve():
    # 80 Python workers starting at once on two cores starved the node
    # agent past its heartbeat timeout: the head declared the node dead and
    # every actor with it. The agent now starts as many at once as the
    # machine has cores (the warm pool's aside) and the rest as they serve.
    @troupe.remote
    class Small:
        def one(self):
            return 1

    actors = [Small.remote() for _ in range(80)]
    assert sum(troupe.get([a.one.remote() for a in actors], timeout=300)) == 80
    assert all(n["Alive"] for n in troupe.nodes())
    for a in actors:
        troupe.kill(a)


def test_get_if_exists_from_racing_callers_gives_one_actor():
    # Each looks the name up, misses, and spawns: all but one spawn find the
    # name taken, and must return the actor that took it.
    @troupe.remote(num_cpus=0)
    def make():
        handle = Counter.options(name="raced", get_if_exists=True).remote(0)
        return troupe.get(handle.actor_id.remote(), timeout=60)

    ids = troupe.get([make.remote() for _ in range(6)], timeout=120)
    assert len(set(ids)) == 1
    troupe.kill(troupe.get_actor("raced"))


def test_resources_options_and_cluster_info():
    assert troupe.cluster_resources()["CPU"] == 2.0
    assert len(troupe.nodes()) == 1 and troupe.nodes()[0]["Alive"]
    assert troupe.get(square.options(num_cpus=2).remote(3), timeout=60) == 9
    with pytest.raises(ConfigError, match="fit on no node"):
        square.options(num_gpus=4).remote(1)
    with pytest.raises(ConfigError, match="unknown option"):
        square.options(num_cpu=1)
    ctx = troupe.remote(lambda: (troupe.get_runtime_context().get_actor_id(),
                                 troupe.get_runtime_context().get_node_id()))
    actor_id, node_id = troupe.get(ctx.remote(), timeout=60)
    # As in Ray: a task is in no actor (its executor is troupe's, not the user's).
    assert actor_id is None and node_id == troupe.nodes()[0]["NodeID"]
    c = Counter.remote()
    assert troupe.get(c.actor_id.remote(), timeout=60) == str(c._actor.id)
    assert troupe.get_runtime_context().get_actor_id() is None
    assert troupe.get_runtime_context().get_job_id()
    # Per-call options: a label and num_returns are taken, what else would
    # change the call is refused.
    assert troupe.get(c.add.options(name="labelled").remote(), timeout=60) == 1
    with pytest.raises(ConfigError, match=r"actor method add: option max_retries=2 is not supported"):
        c.add.options(max_retries=2)


@troupe.remote(num_returns=2)
def split_pair(x):
    return x, x * 10


@troupe.remote
class Pairs:
    @troupe.method(num_returns=2)
    def two(self, x):
        return [x, -x]

    def three(self):
        return "a", "b", "c"

    async def doubled(self, box):
        return (await box[0]) * 2


def test_a_handle_sent_to_another_process_checks_methods_and_keeps_their_defaults():
    @troupe.remote
    def use(handles):
        handle = handles[0]
        try:
            handle.missing
            missing = None
        except AttributeError as e:
            missing = str(e)
        low, high = handle.two.remote(4)  # @troupe.method(num_returns=2)
        return missing, troupe.get([low, high], timeout=60)

    missing, values = troupe.get(use.remote([Pairs.remote()]), timeout=60)
    assert missing == "actor class Pairs has no method 'missing'"
    assert values == [4, -4]


def test_a_handle_found_by_name_checks_methods_and_keeps_their_defaults():
    p = Pairs.options(name="pairs_by_name").remote()
    found = troupe.get_actor("pairs_by_name")
    with pytest.raises(AttributeError, match="actor class Pairs has no method 'missing'"):
        found.missing
    low, high = found.two.remote(4)  # @troupe.method(num_returns=2)
    assert troupe.get([low, high], timeout=60) == [4, -4]
    # The table lives as long as the actor: its death erases it.
    key = f"troupe.actor/{p._actor.id}/py.methods"
    assert troupe._client().kv_get(key) is not None
    troupe.kill(p)
    wait_until(lambda: troupe._client().kv_get(key) is None, what="the method table erased")


def test_num_returns_gives_one_ref_per_value():
    low, high = split_pair.remote(3)
    assert isinstance(low, troupe.ObjectRef) and isinstance(high, troupe.ObjectRef)
    assert troupe.get(high, timeout=60) == 30 and troupe.get([high, low], timeout=60) == [30, 3]
    assert troupe.wait([low, high], num_returns=2, timeout=60) == ([low, high], [])
    # As arguments: at the top level the item's value, inside a value a
    # ref that the task gets (and an async method awaits).
    assert troupe.get(add.remote(low, high), timeout=60) == 33
    assert troupe.get(troupe.remote(lambda box: troupe.get(box["r"]) + 1).remote({"r": high}), timeout=60) == 31
    p = Pairs.remote()
    assert troupe.get(p.doubled.remote([high]), timeout=60) == 60
    # Actor methods: @troupe.method's default, and per call.
    assert troupe.get(p.two.remote(5), timeout=60) == [5, -5]
    assert troupe.get(p.three.options(num_returns=3).remote()[2], timeout=60) == "c"
    assert troupe.get(p.two.options(num_returns=1).remote(2), timeout=60) == [2, -2]
    # A result that is not num_returns values fails each ref, naming it.
    for ref in p.three.options(num_returns=2).remote():
        with pytest.raises(ValueError, match=r"actor method three returned 3 values, but num_returns=2"):
            troupe.get(ref, timeout=60)
    with pytest.raises(ValueError, match=r"task split_pair returned 2 values, but num_returns=3"):
        troupe.get(split_pair.options(num_returns=3).remote(1)[0], timeout=60)
    with pytest.raises(ValueError, match=r"task <lambda> returned a value of type int, but num_returns=2"):
        troupe.get(troupe.remote(num_returns=2)(lambda: 7).remote()[1], timeout=60)
    # A remote error is every ref's.
    boom = troupe.remote(num_returns=2)(lambda: 1 // 0)
    for ref in boom.remote():
        with pytest.raises(TaskError, match="ZeroDivisionError"):
            troupe.get(ref, timeout=60)
    # num_returns=0 runs the task and gives no ref, as Ray.
    marker = troupe.remote(lambda: None)
    assert marker.options(num_returns=0).remote() is None
    for bad in ("dynamic", "all", -1, 1.5, True):
        with pytest.raises(ConfigError, match="num_returns"):
            split_pair.options(num_returns=bad)
    with pytest.raises(ConfigError, match="num_returns"):
        p.two.options(num_returns=-2)
    with pytest.raises(ConfigError, match="unknown option"):
        troupe.method(concurrency_groups="io")


def test_bad_input_is_a_clear_python_error():
    lock = threading.Lock()
    with pytest.raises(TypeError, match="lock"):
        square.remote(lock)
    with pytest.raises(ValueError, match="no_such_actor"):
        troupe.get_actor("no_such_actor")
    with pytest.raises(TypeError, match="remote"):
        square(3)
    with pytest.raises(TypeError):
        troupe.get(3)
    with pytest.raises(RuntimeError):
        troupe.init()


@troupe.remote
class Held:
    """Calls to hold() stay under way until release() is called."""

    def __init__(self):
        self.event = asyncio.Event()

    async def hold(self):
        await self.event.wait()
        return "held"

    async def release(self):
        self.event.set()


def test_max_pending_calls_refuses_calls_past_it_until_some_end():
    from troupe.exceptions import PendingCallsLimitExceeded

    held = Held.options(max_pending_calls=2).remote()
    first, second = held.hold.remote(), held.hold.remote()
    with pytest.raises(PendingCallsLimitExceeded, match="max_pending_calls=2"):
        held.hold.remote()
    # The limit is the handle's: a copy has none.
    copy.copy(held).release.remote()
    assert troupe.get([first, second], timeout=60) == ["held", "held"]
    # The ended calls made room.
    assert troupe.get([held.hold.remote(), held.hold.remote()], timeout=60) == ["held", "held"]
    for bad in (0, -2, True, "2"):
        with pytest.raises(ConfigError, match=f"max_pending_calls must be -1 .* got {bad!r}"):
            Held.options(max_pending_calls=bad).remote()


def test_memory_option_reserves_the_nodes_memory_resource():
    from troupe.util.state import list_actors

    total = troupe.cluster_resources()["memory"]  # the machine's, in bytes
    assert total >= 1 << 20
    big = int(total * 0.6)
    first = Counter.options(memory=big).remote()
    assert troupe.get(first.add.remote(), timeout=60) == 1
    assert troupe.available_resources()["memory"] == pytest.approx(total - big)
    # A second one does not fit beside it: it waits, saying for what.
    second = Counter.options(memory=big, name="memory-second").remote()
    wait_until(lambda: [a.pending_reason for a in list_actors(filters=[("name", "=", "memory-second")])
                        if a.state == "PENDING_CREATION" and "memory" in (a.pending_reason or "")],
               what="the second actor pending for memory")
    troupe.kill(first)
    assert troupe.get(second.add.remote(), timeout=60) == 1
    # Tasks ask for it too; what no node has is the runtime's to hold back.
    assert troupe.get(square.options(memory=1 << 20).remote(3), timeout=60) == 9
    with pytest.raises(ConfigError, match="memory must be a number, got 'lots'"):
        Counter.options(memory="lots").remote()
    with pytest.raises(ConfigError, match="use num_cpus/num_gpus/memory, not resources=\\{'memory'"):
        Counter.options(resources={"memory": 1}).remote()


@troupe.remote(max_restarts=2)
class Quitter:
    def __init__(self, path):
        import atexit

        atexit.register(lambda: open(path, "w").write("atexit ran"))

    def quit(self):
        troupe.actor.exit_actor()
        return "not reached"

    def ping(self):
        return "pong"


def test_exit_actor_ends_the_actor_for_good_after_its_atexit_handlers(tmp_path):
    marker = tmp_path / "atexit"
    quitter = Quitter.remote(str(marker))
    assert troupe.get(quitter.ping.remote(), timeout=60) == "pong"
    # The call that exits sees the actor's death, not a value; the actor is
    # not restarted, whatever its max_restarts.
    with pytest.raises(ActorDiedError, match="exit_actor"):
        troupe.get(quitter.quit.remote(), timeout=60)
    with pytest.raises(ActorDiedError, match="exit_actor"):
        troupe.get(quitter.ping.remote(), timeout=60)
    assert marker.read_text() == "atexit ran"
    with pytest.raises(TypeError, match="exit_actor"):
        troupe.actor.exit_actor()  # the driver is no actor
    with pytest.raises(TaskError, match="exit_actor"):
        troupe.get(troupe.remote(lambda: troupe.actor.exit_actor()).remote(), timeout=60)


@troupe.remote(max_restarts=1)
class SelfAware:
    def me(self):
        ctx = troupe.get_runtime_context()
        return ctx.current_actor, ctx.was_current_actor_reconstructed

    def ping(self):
        return "pong"


def test_runtime_context_knows_the_current_actor_and_its_restarts():
    actor = SelfAware.remote()
    handle, restarted = troupe.get(actor.me.remote(), timeout=60)
    assert restarted is False
    assert troupe.get(handle.ping.remote(), timeout=60) == "pong"  # the handle the actor gave out works
    with pytest.raises(AttributeError, match="has no method 'nope'"):
        handle.nope  # it knows the class's methods
    troupe.kill(actor, no_restart=False)
    wait_until(lambda: _restarted(actor), what="the restarted actor to say so")
    for attribute in ("current_actor", "was_current_actor_reconstructed"):
        with pytest.raises(RuntimeError, match=f"{attribute} is for an actor's methods"):
            getattr(troupe.get_runtime_context(), attribute)


def _assigned_resources():
    return troupe.get_runtime_context().get_assigned_resources()


@troupe.remote
class ResourceHolder:
    def assigned(self):
        return _assigned_resources()


def test_runtime_context_names_the_resources_an_actor_or_task_holds():
    holder = ResourceHolder.options(num_cpus=1, memory=3 << 20).remote()
    assert troupe.get(holder.assigned.remote(), timeout=60) == {"CPU": 1.0, "memory": float(3 << 20)}
    task = troupe.remote(_assigned_resources)
    assert troupe.get(task.options(num_cpus=0.5).remote(), timeout=60) == {"CPU": 0.5}
    assert troupe.get(task.options(num_cpus=1, memory=1 << 20).remote(), timeout=60) == {
        "CPU": 1.0, "memory": float(1 << 20)}
    with pytest.raises(RuntimeError, match="get_assigned_resources\\(\\) is for actors and tasks"):
        _assigned_resources()


def _restarted(actor):
    try:
        return troupe.get(actor.me.remote(), timeout=60)[1]
    except ActorDiedError:
        return False  # a call that met the kill


def test_out_of_range_options_are_named():
    # Counts past the runtime's 32-bit ints and resource amounts that are
    # no numbers used to fail in the binding ("Unable to cast Python
    # instance to C++ type") or as float()'s error, naming neither.
    huge = 2**40
    for bad in ({"max_retries": huge}, {"max_restarts": huge}, {"max_task_retries": huge},
                {"max_concurrency": huge}, {"max_concurrency": 1025}, {"max_retries": True}):
        (key, value), = bad.items()
        target = square if key == "max_retries" else Counter
        with pytest.raises(ConfigError, match=f"{key} must be an int in .*, got {value!r}"):
            target.options(**bad).remote()
    for key in ("num_cpus", "num_gpus"):
        with pytest.raises(ConfigError, match=f"{key} must be a number, got 'two'"):
            square.options(**{key: "two"}).remote(1)
    with pytest.raises(ConfigError, match="resources\\['x'\\] must be a number, got \\[1\\]"):
        Counter.options(resources={"x": [1]}).remote()
    # None and NumPy numbers still mean what they did.
    assert troupe.get(square.options(num_cpus=np.int64(1), num_gpus=None).remote(4), timeout=60) == 16


def test_torch_tensors_travel_out_of_band():
    torch = pytest.importorskip("torch")
    t = torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024)
    double = troupe.remote(lambda x: x * 2)
    assert torch.equal(troupe.get(double.remote(t), timeout=120), t * 2)
    half = torch.ones(3, 5, dtype=torch.bfloat16)
    back = troupe.get(troupe.put(half), timeout=60)
    assert back.dtype == torch.bfloat16 and torch.equal(back, half)
    # Tensors are writable: each get is a tensor of its own, and writing the
    # source after put is not seen.
    src = torch.zeros(1 << 20)
    ref = troupe.put(src)
    src[0] = 5
    troupe.get(ref, timeout=60).add_(1)
    assert troupe.get(ref, timeout=60)[0].item() == 0


def test_tasks_queued_behind_a_task_that_waits_run_elsewhere():
    # Ray's signal pattern in one burst: four waiters and then the setter,
    # on two CPUs. Once the key has both executors it can lease, the
    # submitter queues the rest behind the first two, the setter behind a
    # waiter: when that waiter blocks, its executor hands the setter back,
    # and it runs on the CPU the waiters lend (it used to wait for ever).
    signal = Signal.remote()

    @troupe.remote
    def waiter(s):
        troupe.get(s.wait.remote(), timeout=120)
        return "woken"

    @troupe.remote
    def setter(s):
        troupe.get(s.send.remote(), timeout=60)
        return "set"

    refs = [waiter.remote(signal) for _ in range(4)] + [setter.remote(signal)]
    assert troupe.get(refs, timeout=150) == ["woken"] * 4 + ["set"]


def test_an_async_task_awaiting_a_child_lends_its_cpu():
    # The parent holds both CPUs; its child runs only on what the parent
    # lends while its `await` waits (on a thread of its own, not the task's).
    @troupe.remote
    def child(x):
        return x + 1

    @troupe.remote(num_cpus=2)
    async def parent(x):
        return await child.remote(x) * 10

    assert troupe.get(parent.remote(1), timeout=90) == 20


def test_an_async_actor_starts_threads_as_its_calls_need_them():
    # max_concurrency is 100 for a class with async methods; its worker
    # used to start 100 threads up front.
    s = Sleeper.remote()
    assert troupe.get([s.double_later.remote(i) for i in range(3)], timeout=60) == [0, 2, 4]
    assert troupe.get(s.threads.remote(), timeout=60) < 40
    # Calls that wait for each other still all run at once.
    assert troupe.get([s.wait_for_peer.remote() for _ in range(2)], timeout=60) == [True, True]


@troupe.remote(concurrency_groups={"io": 2, "control": 1})
class Gate:
    """Calls that wait until let through, counted by kind: enter in the
    default group (one at a time), enter_io in "io" (two), the rest in
    "control"."""

    def __init__(self):
        self.cv = threading.Condition()
        self.permits = {"plain": 0, "io": 0}
        self.counts_ = {"plain": [0, 0, 0], "io": [0, 0, 0]}  # inside, let through, most inside at once

    def _pass(self, kind):
        with self.cv:
            c = self.counts_[kind]
            c[0] += 1
            c[2] = max(c[2], c[0])
            let = self.cv.wait_for(lambda: self.permits[kind] > 0, timeout=60)
            c[0] -= 1
            if not let:
                raise TimeoutError("no permit")
            self.permits[kind] -= 1
            c[1] += 1

    def enter(self):
        self._pass("plain")

    @troupe.method(concurrency_group="io")
    def enter_io(self):
        self._pass("io")

    @troupe.method(concurrency_group="control")
    def release(self, kind, n):
        with self.cv:
            self.permits[kind] += n
            self.cv.notify_all()

    @troupe.method(concurrency_group="control")
    def counts(self, kind):
        with self.cv:
            return list(self.counts_[kind])

    def plain_counts(self, kind):  # in the default group
        with self.cv:
            return list(self.counts_[kind])

    @troupe.method(concurrency_group="control")
    def own_counts(self, kind):  # through its own handle, whose methods know their groups
        me = troupe.get_runtime_context().current_actor
        return troupe.get(me.plain_counts.options(concurrency_group="io").remote(kind), timeout=60)


def test_concurrency_groups_run_beside_the_default_group_each_to_its_cap():
    g = Gate.remote()
    plain = g.enter.remote()
    # counts runs in "control" while enter holds the default group's one thread.
    wait_until(lambda: troupe.get(g.counts.remote("plain"), timeout=60)[0] == 1, what="enter started")
    io = [g.enter_io.remote() for _ in range(3)]
    wait_until(lambda: troupe.get(g.counts.remote("io"), timeout=60)[0] == 2, what="two io calls inside")
    troupe.get(g.release.remote("io", 1), timeout=60)
    # The third io call waited for one of its group's two threads.
    wait_until(lambda: troupe.get(g.counts.remote("io"), timeout=60)[:2] == [2, 1], what="the third io call inside")
    troupe.get(g.release.remote("io", 2), timeout=60)
    troupe.get(io, timeout=60)
    assert troupe.get(g.counts.remote("io"), timeout=60)[2] == 2
    # A call names another group than its method's: plain_counts is in the
    # default group, busy with enter, but runs in "control" when told to.
    assert troupe.get(g.plain_counts.options(concurrency_group="control").remote("plain"), timeout=60)[0] == 1
    assert troupe.get(g.own_counts.remote("plain"), timeout=60)[0] == 1
    troupe.get(g.release.remote("plain", 1), timeout=60)
    troupe.get(plain, timeout=60)
    # A handle sent to a task, and one found by name, route calls the same.
    named = Gate.options(name="gate_by_name").remote()

    @troupe.remote
    def through(handle):
        blocked = handle.enter.remote()
        deadline = time.monotonic() + 60
        while troupe.get(handle.counts.remote("plain"), timeout=60)[0] != 1:
            assert time.monotonic() < deadline, "enter never started"
        troupe.get(handle.release.remote("plain", 1), timeout=60)
        troupe.get(blocked, timeout=60)
        return True

    assert troupe.get(through.remote(named), timeout=120)
    found = troupe.get_actor("gate_by_name")
    blocked = found.enter.remote()
    wait_until(lambda: troupe.get(found.counts.remote("plain"), timeout=60)[0] == 1, what="enter via get_actor")
    troupe.get(found.release.remote("plain", 1), timeout=60)
    troupe.get(blocked, timeout=60)
    troupe.kill(named)


def test_bad_concurrency_groups_are_clear_errors_and_a_bad_group_number_leaves_the_actor_serving():
    g = Gate.remote()
    with pytest.raises(ConfigError, match=r"concurrency_group='disk' is not one of the actor's concurrency groups "
                                          r"\('io', 'control'\)"):
        g.enter.options(concurrency_group="disk")
    with pytest.raises(ConfigError, match=r"max_concurrency in \[1, 1024\], got 0"):
        Gate.options(concurrency_groups={"io": 0})
    with pytest.raises(ConfigError, match="must be a dict"):
        Gate.options(concurrency_groups=["io"])
    with pytest.raises(ConfigError, match=r"method counts is in concurrency group 'control', which its "
                                          r"concurrency_groups option does not define \('io'\)"):
        Gate.options(concurrency_groups={"io": 1}).remote()
    # A call whose op names a group the actor lacks (another client's
    # mistake) is answered with an error; the actor serves on.
    from troupe import _remote

    data, top = _remote._call_args("counts", ("io",), {})
    with pytest.raises(ConfigError, match="names concurrency group #9; actor Gate has 2"):
        troupe.get(troupe._client().call(g._actor, "counts", data, top, group=9), timeout=60)
    assert troupe.get(g.counts.remote("io"), timeout=60) == [0, 0, 0]


@troupe.remote(concurrency_groups={"io": 1})
class AsyncGrouped:
    def __init__(self):
        self.event = asyncio.Event()

    async def wait(self):
        await asyncio.wait_for(self.event.wait(), 60)
        return "let through"

    @troupe.method(concurrency_group="io")
    async def open(self):
        self.event.set()


def test_an_async_actors_groups_share_its_event_loop():
    a = AsyncGrouped.remote()
    waiting = a.wait.remote()
    troupe.get(a.open.remote(), timeout=60)
    assert troupe.get(waiting, timeout=60) == "let through"


@troupe.remote
def worker_pid():
    return os.getpid()


def test_max_calls_gives_each_worker_that_many_tasks():
    # Ray's max_calls: a worker runs that many tasks, then another takes its
    # place (Ray's default for a task that asks for GPUs is 1).
    pids = troupe.get([worker_pid.options(max_calls=1).remote() for _ in range(4)], timeout=120)
    assert len(set(pids)) == 4
    twice = [troupe.get(worker_pid.options(max_calls=2).remote(), timeout=60) for _ in range(4)]
    assert sorted(collections.Counter(twice).values()) == [2, 2]
    with pytest.raises(ConfigError, match="max_calls must be an int in \\[0, .*got -1"):
        worker_pid.options(max_calls=-1).remote()
    with pytest.raises(ConfigError, match="unknown option\\(s\\) for .*max_calls"):
        Counter.options(max_calls=1).remote()


def test_init_names_a_bad_resource_amount():
    # They used to fail in float() as "could not convert string to float".
    with pytest.raises(ConfigError, match="troupe.init: num_cpus must be a number, got 'two'"):
        troupe.init(num_cpus="two")
    with pytest.raises(ConfigError, match="troupe.init: resources\\['foo'\\] must be a number, got 'bar'"):
        troupe.init(resources={"foo": "bar"})
    with pytest.raises(ConfigError, match="resources must be a dict"):
        troupe.init(resources=["CPU"])


def test_init_takes_cpus_and_gpus_by_their_own_arguments_only():
    # One of the two used to be ignored without a word; Ray refuses both.
    with pytest.raises(ConfigError, match="resources has 'CPU': 1 \\(and num_cpus=2 was given too\\); "
                                          "give the node's CPUs with num_cpus="):
        troupe.init(resources={"CPU": 1}, num_cpus=2)
    with pytest.raises(ConfigError, match="resources has 'GPU': 1; give the node's GPUs with num_gpus="):
        troupe.init(resources={"GPU": 1})


@troupe.remote
class Named:
    def whoami(self):
        ctx = troupe.get_runtime_context()
        return ctx.get_actor_id(), ctx.get_actor_name(), ctx.get_task_id(), ctx.get_worker_id()

    def fail(self):
        raise KeyError("missing")


@troupe.remote
class AsyncNamed:
    async def task_id(self):
        await asyncio.sleep(0)
        return troupe.get_runtime_context().get_task_id()


@troupe.remote
def task_ids():
    ctx = troupe.get_runtime_context()
    return ctx.get_task_id(), ctx.get_worker_id(), ctx.get_actor_name()


@troupe.remote
class OneAtATime:
    def __init__(self):
        self.total = 0.0

    def add(self, a):
        time.sleep(0.002)
        self.total += float(a[0])
        return self.total

    def quick(self, i):
        return i

    def slow(self, seconds):
        time.sleep(seconds)
        return "slow"

    def leave(self):
        troupe.actor.exit_actor()


def test_a_one_at_a_time_actor_takes_arguments_faster_than_it_works():
    # 300 MiB of arguments for an actor that reads a call when it gets to
    # it: past 256 MiB queued the caller dropped the connection, and calls
    # failed with ActorDiedError (some after they had run). Now the caller
    # waits for room.
    actor = OneAtATime.remote()
    refs = [actor.add.remote(np.ones(1 << 17)) for _ in range(300)]  # 1 MiB each
    assert troupe.get(refs, timeout=300) == [float(i + 1) for i in range(300)]
    troupe.kill(actor)


def test_a_calls_reply_goes_when_it_ends_not_with_the_calls_read_beside_it():
    # Calls read together used to send their replies together, after the
    # last: quick calls' results waited for a long call sent behind them,
    # and were lost when the actor exited after them.
    actor = OneAtATime.remote()
    troupe.get(actor.quick.remote(-1), timeout=60)
    quick = [actor.quick.remote(i) for i in range(5)]
    slow = actor.slow.remote(120)
    assert troupe.get(quick, timeout=60) == list(range(5))
    troupe.kill(actor)

    leaving = OneAtATime.remote()
    troupe.get(leaving.quick.remote(-1), timeout=60)
    done = [leaving.quick.remote(i) for i in range(10)]
    leaving.leave.remote()
    assert troupe.get(done, timeout=60) == list(range(10))


def test_arguments_a_function_cannot_take_are_a_type_error_at_remote():
    # As Ray's: they failed only at get, after a worker ran the call.
    with pytest.raises(TypeError, match=r"task square: too many positional arguments"):
        square.remote(1, 2)
    with pytest.raises(TypeError, match=r"task add: missing a required argument: 'b'"):
        add.remote(1)
    with pytest.raises(TypeError, match=r"actor Counter: got an unexpected keyword argument 'begin'"):
        Counter.remote(begin=3)
    counter = Counter.remote(start=1)
    with pytest.raises(TypeError, match=r"actor method add: too many positional arguments"):
        counter.add.remote(1, 2)
    assert troupe.get(counter.add.remote(k=2), timeout=60) == 3
    assert troupe.get(add.remote(a=1, b=square.remote(3)), timeout=60) == 10
    troupe.kill(counter)


@troupe.remote
def fails_here():
    raise KeyError("missing")


def test_errors_say_what_raised_them_where_as_rays():
    with pytest.raises(TaskError) as info:
        troupe.get(fails_here.remote(), timeout=60)
    e = info.value
    assert isinstance(e, KeyError) and e.function_name == "fails_here", e.function_name
    assert isinstance(e.pid, int) and e.pid != os.getpid() and e.ip == "127.0.0.1", (e.pid, e.ip)
    # A caught error pickles (a queue, a log handler, multiprocessing): its
    # class had no name pickle could find.
    import pickle

    again = pickle.loads(pickle.dumps(e))
    assert type(again) is type(e) and str(again) == str(e) and again.pid == e.pid
    assert isinstance(again.cause, KeyError) and again.function_name == "fails_here"
    counter = Counter.remote()
    with pytest.raises(TaskError) as info:
        troupe.get(counter.add.remote("not a number"), timeout=60)
    assert info.value.function_name == "Counter.add", info.value.function_name
    troupe.kill(counter)
    with pytest.raises(ActorDiedError) as died:
        troupe.get(counter.add.remote(1), timeout=60)
    assert died.value.actor_id == str(counter._actor_id) and died.value.error_msg == str(died.value)


@troupe.remote
class Callable:
    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return x * 2

    def __len__(self):
        return 7

    def __iter__(self):
        return iter(range(3))

    def __array__(self, dtype=None):
        import numpy

        return numpy.arange(3)


@troupe.remote
def call_through(handle, x):
    return troupe.get(handle.__call__.remote(x), timeout=60)


def test_special_methods_a_class_defines_are_called_through_its_handle():
    # As Ray's actor.__call__.remote(): they raised AttributeError.
    actor = Callable.remote()
    assert troupe.get(actor.__call__.remote(21), timeout=60) == 42
    assert troupe.get(actor.__len__.remote(), timeout=60) == 7
    assert troupe.get(call_through.remote(actor, 5), timeout=60) == 10  # a handle passed on keeps them
    named = Callable.options(name="callable-by-name").remote()
    assert troupe.get(troupe.get_actor("callable-by-name").__call__.remote(1), timeout=60) == 2
    # Ray's __ray_call__: a function run on the actor's instance.
    assert troupe.get(actor.__ray_call__.remote(lambda self, k: self.calls + k, 10), timeout=60) == 12
    # What Python's protocols look up stays the handle's own: copies and
    # pickles of it work, and a special method the class lacks is none.
    assert troupe.get(copy.deepcopy(actor).__len__.remote(), timeout=60) == 7
    with pytest.raises(AttributeError):
        actor.__getitem__
    # Nor is a handle iterable or an array because its class is: numpy
    # called the class's __array__ through the handle (and failed).
    import numpy

    assert not hasattr(actor, "__iter__") and not hasattr(actor, "__array__")
    assert numpy.asarray(actor, dtype=object).shape == ()
    troupe.kill(named)


def test_code_written_for_ray_finds_rays_names():
    # ray.exceptions' names, catching what troupe raises.
    from troupe import exceptions as ex

    for name in ("RayError", "RayTaskError", "RayActorError", "ActorUnavailableError", "OwnerDiedError",
                 "NodeDiedError", "OutOfMemoryError", "ObjectStoreFullError", "RuntimeEnvSetupError",
                 "TaskUnschedulableError", "ActorUnschedulableError", "RaySystemError"):
        assert issubclass(getattr(ex, name), ex.RayError), name
    actor = Named.options(name="ray-names").remote()
    with pytest.raises(ex.RayTaskError) as info:
        troupe.get(actor.fail.remote(), timeout=60)
    assert isinstance(info.value.as_instanceof_cause(), KeyError)
    # Actor built-ins: ready once constructed; terminate ends it.
    assert troupe.get(actor.__ray_ready__.remote(), timeout=60) is True
    actor_id, name, call_id, worker = troupe.get(actor.whoami.remote(), timeout=60)
    assert actor._actor_id.hex() == actor_id and name == "ray-names"
    assert call_id and int(worker, 16) > 0
    assert troupe.get(AsyncNamed.remote().task_id.remote(), timeout=60)  # on the event loop's thread too
    assert isinstance(actor, troupe.actor.ActorHandle)
    with pytest.raises(ex.RayActorError):
        troupe.get(actor.__ray_terminate__.remote(), timeout=60)
    with pytest.raises(ex.RayActorError):
        troupe.get(actor.whoami.remote(), timeout=60)
    # Tasks: an id each, no actor name; a driver has no task id.
    (a, wa, na), (b, _, _) = troupe.get([task_ids.remote(), task_ids.remote()], timeout=60)
    assert a and b and a != b and na is None and int(wa, 16) > 0
    ctx = troupe.get_runtime_context()
    assert ctx.get_task_id() is None and ctx.job_id == ctx.get_job_id() and ctx.gcs_address
    # Resources there are none of are left out (this cluster has no GPU).
    assert "GPU" not in troupe.cluster_resources() and "CPU" in troupe.cluster_resources()
    node = troupe.nodes()[0]
    assert node["alive"] is node["Alive"] is True and node["NodeName"] and node["Labels"] == {}
    assert "GPU" not in node["Resources"]
    # AvailableResources names what Resources names (it had 'GPU': 0.0).
    assert set(node["AvailableResources"]) <= set(node["Resources"]), node


def test_inspect_serializability_names_what_cannot_be_pickled():
    from troupe.util import inspect_serializability

    lock = threading.Lock()

    def uses_lock():
        with lock:
            return 1

    ok, failures = inspect_serializability(uses_lock, name="uses_lock", print_file=open(os.devnull, "w"))
    assert not ok and failures == {("uses_lock.lock", "lock")}
    assert inspect_serializability(square)[0] is True


@troupe.remote(num_cpus=0)
def gang_member(folder, i, n):
    with open(os.path.join(folder, str(i)), "w"):
        pass
    deadline = time.monotonic() + 60
    while len(os.listdir(folder)) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(os.listdir(folder))


def test_tasks_with_num_cpus_0_are_not_held_to_the_cpu_count(tmp_path):
    # As in Ray: three that each wait for all three, on two CPUs, all run.
    assert troupe.get([gang_member.remote(str(tmp_path), i, 3) for i in range(3)], timeout=120) == [3, 3, 3]


def test_a_copy_of_a_ref_is_the_ref():
    """copy.copy and copy.deepcopy of an ObjectRef raised TypeError, so a
    deepcopy of a config holding refs failed; Ray's refs copy."""
    import copy

    ref = troupe.put(41)
    config = {"weights": ref, "lr": 0.1}
    assert copy.copy(ref) is ref and copy.deepcopy(ref) is ref
    deep = copy.deepcopy(config)
    assert deep["weights"] is ref and troupe.get(deep["weights"]) == 41


@troupe.remote(max_restarts=2)
class SysExiter:
    def leave(self, code):
        import sys

        sys.exit(code)

    def ping(self):
        return "pong"


def test_sys_exit_in_an_actor_method_ends_the_actor_as_in_ray():
    """It read as the method's TaskError(SystemExit), and the actor served
    on; in Ray the actor exits (no restart) and its callers see it die."""
    leaver = SysExiter.remote()
    assert troupe.get(leaver.ping.remote(), timeout=60) == "pong"
    with pytest.raises(ActorDiedError, match=r"sys.exit\(0\)"):
        troupe.get(leaver.leave.remote(0), timeout=60)
    with pytest.raises(ActorDiedError, match=r"sys.exit\(0\) in SysExiter.leave"):
        troupe.get(leaver.ping.remote(), timeout=60)
    # In a task it stays the task's error (the executor serves on).
    with pytest.raises(TaskError, match="SystemExit"):
        troupe.get(troupe.remote(lambda: __import__("sys").exit(3)).remote(), timeout=60)


@troupe.remote
def make_worker_only_thing(directory):
    import sys

    sys.path.insert(0, directory)
    import only_in_the_worker

    return only_in_the_worker.Thing()


def test_a_value_the_driver_cannot_unpickle_names_its_ref(tmp_path):
    """Its class's module is on the worker's path only: the get said a bare
    "No module named ...", naming neither the ref nor what to do; as in
    Ray, it is a RaySystemError."""
    (tmp_path / "only_in_the_worker.py").write_text("class Thing:\n    pass\n")
    ref = make_worker_only_thing.remote(str(tmp_path))
    with pytest.raises(troupe.exceptions.RaySystemError) as e:
        troupe.get(ref, timeout=60)
    text = str(e.value)
    assert ref.hex() in text and "No module named 'only_in_the_worker'" in text and "py_modules" in text, text
    assert isinstance(e.value.__cause__, ModuleNotFoundError)


class _BadOnLoad:
    """Pickles fine, and fails where it is loaded (int("notanint"))."""

    def __reduce__(self):
        return int, ("notanint",)


class _BadOnDump:
    def __reduce__(self):
        raise RuntimeError("cannot reduce me 77")


@troupe.remote
def returns_bad_on_load():
    return _BadOnLoad()


def test_values_that_fail_to_pickle_or_unpickle_are_named():
    # A value that fails as the driver loads it: RaySystemError naming the
    # ref (it was a bare ValueError); an argument whose __reduce__ raises:
    # a TypeError naming the task and the argument (a bare RuntimeError).
    ref = returns_bad_on_load.remote()
    with pytest.raises(troupe.exceptions.RaySystemError, match="ValueError: invalid literal") as e:
        troupe.get(ref, timeout=60)
    assert ref.hex() in str(e.value) and "py_modules" not in str(e.value)
    with pytest.raises(TypeError, match=r"task .*square: argument 0 \(a _BadOnDump\) cannot be pickled: "
                                        r"RuntimeError: cannot reduce me 77"):
        square.remote(_BadOnDump())


@troupe.remote
class InitProbe:
    def __init__(self):
        # Ray code's idiom; troupe is the worker's cluster already.
        self.was = troupe.is_initialized()
        troupe.init(ignore_reinit_error=True)

    def seen(self):
        try:
            troupe.init()
            twice = "no error"
        except RuntimeError as e:
            twice = str(e)
        return self.was, [n["NodeID"] for n in troupe.nodes()], twice


def test_in_an_actor_troupe_is_initialized_and_init_joins_nothing_new():
    # is_initialized() was False in a worker, and init() joined the cluster
    # again as a new driver (another namespace) or embedded a second one.
    was, nodes, twice = troupe.get(InitProbe.remote().seen.remote(), timeout=120)
    assert was is True
    assert nodes == [n["NodeID"] for n in troupe.nodes()]
    assert "called in a worker" in twice, twice


@troupe.remote
def echo_handle(handle):
    return handle


def test_handles_of_one_actor_are_equal_and_hash_alike():
    a = Counter.remote()
    back = troupe.get(echo_handle.remote(a), timeout=60)
    assert a == back and hash(a) == hash(back)
    assert len({a, back}) == 1
    assert a != Counter.remote()
    named = Counter.options(name="equal_by_name").remote()
    assert troupe.get_actor("equal_by_name") == named
    troupe.kill(named)


def test_get_if_exists_without_a_name_is_refused():
    with pytest.raises(ConfigError, match="get_if_exists=True needs a name"):
        Counter.options(get_if_exists=True).remote()
