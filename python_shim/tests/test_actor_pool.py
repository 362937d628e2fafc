"""troupe.util.ActorPool, as Ray's ray.util.ActorPool: ordered and
unordered maps, submit/get_next, items waiting for a free actor, timeouts,
push and pop_idle; and ObjectRef.hex() and .future()."""
import threading

import pytest

import troupe
from troupe.exceptions import GetTimeoutError
from troupe.util import ActorPool

pytestmark = pytest.mark.usefixtures("cluster")


@troupe.remote
class Doubler:
    def __init__(self):
        self.gate = threading.Event()

    def double(self, x):
        return 2 * x

    def held(self, x):
        self.gate.wait(120)
        return x

    def open(self):
        self.gate.set()


def test_map_keeps_order_and_map_unordered_gets_everything():
    pool = ActorPool([Doubler.remote() for _ in range(2)])
    assert list(pool.map(lambda a, v: a.double.remote(v), range(10))) == [2 * v for v in range(10)]
    assert sorted(pool.map_unordered(lambda a, v: a.double.remote(v), range(10))) == [2 * v for v in range(10)]
    assert not pool.has_next() and pool.has_free()


def test_submit_waits_for_a_free_actor_and_get_next_times_out():
    gated = Doubler.options(max_concurrency=2).remote()
    pool = ActorPool([gated])
    pool.submit(lambda a, v: a.held.remote(v), 1)
    pool.submit(lambda a, v: a.double.remote(v), 5)  # waits: the one actor is busy
    assert not pool.has_free() and pool.has_next()
    with pytest.raises(GetTimeoutError):
        pool.get_next(timeout=0.1)
    troupe.get(gated.open.remote(), timeout=60)
    assert pool.get_next(timeout=60) == 1
    assert pool.get_next(timeout=60) == 10
    with pytest.raises(StopIteration):
        pool.get_next()


def test_push_pop_idle_and_bad_input():
    a, b = Doubler.remote(), Doubler.remote()
    pool = ActorPool([a])
    pool.push(b)
    with pytest.raises(ValueError, match="already"):
        pool.push(a)
    assert pool.pop_idle() is not None and pool.pop_idle() is not None and pool.pop_idle() is None
    with pytest.raises(TypeError, match="actor handles"):
        ActorPool([1])
    pool.push(a)
    with pytest.raises(TypeError, match="ref of a method call"):
        pool.submit(lambda actor, v: v, 1)
    assert pool.has_free()


def test_ref_hex_and_future():
    ref = troupe.put(7)
    assert isinstance(ref.hex(), str) and int(ref.hex(), 16) >= 0
    assert ref.future().result(timeout=60) == 7
    a, b = troupe.remote(num_returns=2)(lambda: (1, 2)).remote()
    assert a.hex() != b.hex()
    failing = troupe.remote(lambda: 1 // 0).remote()
    with pytest.raises(ZeroDivisionError):
        failing.future().result(timeout=60)


@troupe.remote
class Picky:
    def square(self, x):
        if x == 3:
            raise ValueError("three")
        return x * x


def test_map_drops_what_an_earlier_map_left_and_submits_at_once():
    """As Ray's: a map that raised left its other items in the pool, and the
    next map returned them before its own ([16, 25, ..., 100, 121] for
    [10, 11]); and map submitted nothing until read."""
    pool = ActorPool([Picky.remote() for _ in range(2)])
    with pytest.raises(troupe.exceptions.TaskError, match="three"):
        list(pool.map(lambda a, v: a.square.remote(v), range(8)))
    results = pool.map(lambda a, v: a.square.remote(v), [10, 11])
    assert pool.has_next()  # submitted before the first read
    assert list(results) == [100, 121]
    assert list(pool.map_unordered(lambda a, v: a.square.remote(v), [4])) == [16]


def test_a_timed_out_item_dropped_by_ignore_if_timedout_raises_and_is_gone():
    gated = Doubler.options(max_concurrency=2).remote()
    pool = ActorPool([gated])
    pool.submit(lambda a, v: a.held.remote(v), 1)
    with pytest.raises(GetTimeoutError, match="dropped"):
        pool.get_next(timeout=0.1, ignore_if_timedout=True)
    assert not pool.has_next()
    troupe.get(gated.open.remote(), timeout=60)
    pool.submit(lambda a, v: a.double.remote(v), 4)
    assert pool.get_next(timeout=60) == 8


@troupe.remote
class Pair:
    @troupe.method(num_returns=2)
    def two(self, x):
        return x, -x

    def double(self, x):
        return 2 * x


def test_a_pool_with_no_actor_for_its_items_says_so_instead_of_spinning():
    # get_next spun at 100% CPU for ever (its timeout ignored) when items
    # waited and no actor was there to run them.
    with pytest.raises(ValueError, match="wait for an actor and the pool has none"):
        list(ActorPool([]).map(lambda a, v: a.double.remote(v), range(3)))
    with pytest.raises(ValueError, match="push"):
        list(ActorPool([]).map_unordered(lambda a, v: a.double.remote(v), range(3)))
    actor = Pair.remote()
    pool = ActorPool([actor])
    assert pool.pop_idle() is actor
    pool.submit(lambda a, v: a.double.remote(v), 1)
    with pytest.raises(ValueError, match="1 submitted item"):
        pool.get_next(timeout=1)
    pool.push(actor)  # the waiting item goes to it
    assert pool.get_next(timeout=60) == 2


def test_a_fn_that_raises_keeps_its_actor_in_the_pool():
    # The actor was popped and never given back: a typo in fn shrank the
    # pool, and the next get_next hung.
    pool = ActorPool([Pair.remote()])
    with pytest.raises(AttributeError):
        pool.submit(lambda a, v: a.no_such_method.remote(v), 1)
    assert pool.has_free()
    pool.submit(lambda a, v: a.double.remote(v), 2)
    assert pool.get_next(timeout=60) == 4


def test_fn_may_return_the_refs_of_a_method_with_several_returns():
    # As Ray's: the result is the list of their values.
    pool = ActorPool([Pair.remote() for _ in range(2)])
    assert list(pool.map(lambda a, v: a.two.remote(v), range(4))) == [[v, -v] for v in range(4)]
    assert sorted(pool.map_unordered(lambda a, v: a.two.remote(v), range(4))) == sorted([v, -v] for v in range(4))
    with pytest.raises(TypeError, match="not an empty list"):
        pool.submit(lambda a, v: [], 1)


def test_a_waiting_items_fn_that_raises_loses_no_result_and_wedges_nothing():
    # The actor freed by get_next went to a waiting item whose fn raised:
    # get_next raised that instead of its own result (lost), and the pool
    # then said it had no actor while one sat idle.
    pool = ActorPool([Pair.remote()])
    pool.submit(lambda a, v: a.double.remote(v), 1)
    pool.submit(lambda a, v: a.no_such_method.remote(v), 2)
    pool.submit(lambda a, v: a.double.remote(v), 3)
    assert pool.get_next(timeout=60) == 2  # its own result first
    with pytest.raises(AttributeError):
        pool.get_next(timeout=60)  # then what the waiting item's fn raised
    assert pool.get_next(timeout=60) == 6
    assert not pool.has_next() and pool.has_free()
    # Two failing in a row behind a good one: each error once, then done
    # (the second spun for ever); a map keeps the error (it was dropped).
    pool.submit(lambda a, v: a.double.remote(v), 1)
    pool.submit(lambda a, v: a.no_such_method.remote(v), 2)
    pool.submit(lambda a, v: a.no_such_method.remote(v), 3)
    assert pool.get_next(timeout=60) == 2
    for _ in range(2):
        with pytest.raises(AttributeError):
            pool.get_next(timeout=60)
    assert not pool.has_next()
    with pytest.raises(AttributeError):
        list(pool.map(lambda a, v: a.double.remote(v) if v != 2 else a.nope.remote(v), [1, 2]))
