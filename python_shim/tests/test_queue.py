"""troupe.util.queue.Queue, as Ray's ray.util.queue.Queue: tasks and actors
share one FIFO queue; blocking, timeouts, batches, and the Empty and Full
errors (also the standard library's queue.Empty and queue.Full)."""
import asyncio
import queue as stdlib_queue

import pytest

import troupe
from timebox import bounded_fixture
from troupe.util.queue import Empty, Full, Queue

pytestmark = pytest.mark.usefixtures("cluster")
bounded = bounded_fixture(180)


@troupe.remote
def produce(q, items):
    for item in items:
        q.put(item)
    return len(items)


@troupe.remote
class Consumer:
    def take(self, q, n):
        return [q.get(timeout=60) for _ in range(n)]


def test_tasks_and_actors_share_one_queue_in_order():
    q = Queue()
    consumer = Consumer.remote()
    taken = consumer.take.remote(q, 20)  # waits for items not put yet
    assert troupe.get(produce.remote(q, list(range(20))), timeout=60) == 20
    assert troupe.get(taken, timeout=60) == list(range(20))
    assert q.empty() and len(q) == 0


def test_a_nowait_put_wakes_a_get_that_waits():
    q = Queue()
    taken = Consumer.remote().take.remote(q, 1)
    ready, _ = troupe.wait([taken], timeout=0.5)
    assert not ready  # its get waits for an item
    q.put_nowait("x")
    assert troupe.get(taken, timeout=60) == ["x"]
    # And a get without waiting makes room for a put that waits.
    full = Queue(maxsize=1)
    full.put(1)
    done = produce.remote(full, [2])
    ready, _ = troupe.wait([done], timeout=0.5)
    assert not ready
    assert full.get_nowait() == 1
    assert troupe.get(done, timeout=60) == 1 and full.get(timeout=60) == 2


def test_a_full_queue_blocks_a_put_until_a_get_makes_room():
    q = Queue(maxsize=2)
    q.put("a")
    q.put("b")
    assert q.full() and q.size() == 2
    with pytest.raises(Full):
        q.put("c", block=False)
    with pytest.raises(stdlib_queue.Full, match="maxsize 2"):
        q.put("c", timeout=0.2)
    # A producer waiting for room goes on once the driver takes one.
    done = produce.remote(q, ["c"])
    assert q.get() == "a"
    assert troupe.get(done, timeout=60) == 1
    assert q.get_nowait_batch(2) == ["b", "c"]


def test_empty_gets_and_batches_are_all_or_nothing():
    q = Queue(maxsize=3)
    with pytest.raises(Empty):
        q.get_nowait()
    with pytest.raises(stdlib_queue.Empty, match="within 0.1 s"):
        q.get(timeout=0.1)
    with pytest.raises(Full, match="do not fit"):
        q.put_nowait_batch([1, 2, 3, 4])
    assert q.size() == 0
    q.put_nowait_batch([1, 2])
    with pytest.raises(Empty, match="3 items asked for, 2"):
        q.get_nowait_batch(3)
    assert q.get_nowait() == 1 and q.get(block=False) == 2
    with pytest.raises(ValueError, match="timeout"):
        q.get(timeout=-1)
    with pytest.raises(ValueError, match="maxsize"):
        Queue(maxsize="8")


def test_async_put_and_get():
    q = Queue()

    async def roundtrip():
        await q.put_async({"x": 1})
        return await q.get_async(timeout=60)

    assert asyncio.run(roundtrip()) == {"x": 1}


def test_shutdown_ends_the_queue_actor():
    q = Queue()
    q.put(1)
    actor = q.actor
    q.shutdown()
    with pytest.raises(troupe.exceptions.ActorDiedError):
        troupe.get(actor.qsize.remote(), timeout=60)


def test_a_zero_timeout_takes_what_is_there_and_puts_where_there_is_room():
    # asyncio.wait_for(..., 0) times out before its coroutine runs: put
    # with timeout=0 raised Full into an empty queue, get raised Empty with
    # items queued (and the standard library's take them).
    q = Queue(maxsize=2)
    q.put("a", timeout=0)
    q.put("b", timeout=0)
    with pytest.raises(Full):
        q.put("c", timeout=0)
    assert q.get(timeout=0) == "a"
    assert q.get(block=True, timeout=0) == "b"
    with pytest.raises(Empty):
        q.get(timeout=0)
    assert Queue(maxsize=-1).maxsize == -1  # as the standard library's: no bound
    with pytest.raises(ValueError, match="maxsize must be an int"):
        Queue(maxsize=1.5)


def test_a_cancelled_get_async_takes_no_item_and_a_cancelled_put_adds_none():
    # The awaiting coroutine was cancelled, not the call at the queue's
    # actor: that get took the next item put, which nobody received (and
    # a cancel sent in the background still lost half of them when the
    # put came at once); a cancelled put added its item later.
    q = Queue()
    bounded_q = Queue(maxsize=1)

    async def give_up_then_use():
        for i in range(5):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(q.get_async(), 0.1)
            await q.put_async(i)
            assert await q.get_async(timeout=60) == i
            await bounded_q.put_async("first")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(bounded_q.put_async("ghost"), 0.1)
            assert await bounded_q.get_async(timeout=60) == "first"
            assert bounded_q.qsize() == 0

    asyncio.run(give_up_then_use())
