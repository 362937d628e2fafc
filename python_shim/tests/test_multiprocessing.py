"""troupe.util.multiprocessing.Pool, as Ray's: the standard library's Pool
API over troupe actors (map, imap, starmap, apply_async with callbacks,
initializer, errors, close/join/terminate)."""
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest

from timebox import bounded_fixture
from troupe.util.multiprocessing import Pool

pytestmark = pytest.mark.usefixtures("cluster")
bounded = bounded_fixture(180)


def square(x):
    return x * x


def remember(value):
    os.environ["POOL_INIT"] = value


def from_init(_):
    return os.environ.get("POOL_INIT"), os.getpid()


def test_map_imap_and_starmap_give_the_standard_librarys_results():
    with Pool(2) as pool:
        assert pool.map(square, range(50)) == [x * x for x in range(50)]
        assert pool.map(square, range(7), chunksize=3) == [x * x for x in range(7)]
        assert list(pool.imap(square, range(10))) == [x * x for x in range(10)]
        assert sorted(pool.imap_unordered(square, range(10), chunksize=2)) == sorted(x * x for x in range(10))
        assert pool.starmap(pow, [(2, 3), (3, 2)]) == [8, 9]
        assert pool.map(square, []) == []
        assert pool.apply(divmod, (7, 2)) == (3, 1)


def test_the_work_runs_in_the_pools_own_processes_after_their_initializer():
    with Pool(2, initializer=remember, initargs=("set",)) as pool:
        got = pool.map(from_init, range(20), chunksize=1)
    assert {value for value, _ in got} == {"set"}
    pids = {pid for _, pid in got}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


def test_apply_async_calls_back_and_errors_keep_their_class():
    results, errors = [], []
    done = threading.Event()
    with Pool(1) as pool:
        r = pool.apply_async(square, (9,), callback=lambda v: (results.append(v), done.set()))
        assert r.get(timeout=60) == 81
        assert done.wait(60) and results == [81]
        assert r.ready() and r.successful()
        failed = pool.apply_async(int, ("x",), error_callback=errors.append)
        with pytest.raises(ValueError, match="invalid literal"):
            failed.get(timeout=60)
        assert not failed.successful()
        with pytest.raises(ZeroDivisionError):
            pool.map(lambda x: 1 // x, [1, 0, 2])
        # The standard library's TimeoutError, as its Pool raises.
        with pytest.raises(multiprocessing.TimeoutError):
            pool.apply_async(time.sleep, (30,)).get(timeout=0.1)
    assert len(errors) == 1 and isinstance(errors[0], ValueError)


def test_a_result_is_ready_only_once_its_callback_has_run():
    # As the standard library's Pool: the callback runs before the result
    # counts as ready. It ran on a thread nothing waited for, so ready(),
    # wait() and the pool's join() could return before it had run.
    import troupe

    gate, seen = threading.Event(), []

    def slow_callback(value):
        gate.wait(60)
        seen.append(value)

    pool = Pool(1)
    r = pool.apply_async(square, (3,), callback=slow_callback)
    troupe.wait(list(r._refs), num_returns=1, timeout=60)  # the work itself is done
    assert not r.ready()
    pool.close()
    joined = threading.Thread(target=pool.join)
    joined.start()
    joined.join(0.5)  # it cannot end while the callback waits
    assert joined.is_alive() and seen == []
    gate.set()
    joined.join(60)
    assert not joined.is_alive() and seen == [9]
    assert r.ready() and r.get(timeout=0) == 9


def test_close_join_and_terminate():
    pool = Pool(2)
    pending = pool.map_async(square, range(8))
    pool.close()
    with pytest.raises(ValueError, match="not running"):
        pool.map(square, [1])
    pool.join()
    assert pending.get(timeout=60) == [x * x for x in range(8)]
    with pytest.raises(ValueError, match="processes"):
        Pool(0)
    unclosed = Pool(1)
    with pytest.raises(ValueError, match="join"):
        unclosed.join()
    unclosed.terminate()


def test_imap_reads_its_iterable_as_results_are_taken():
    # imap read the whole iterable and submitted it all first: an endless
    # one hung and grew the driver by gigabytes.
    import itertools

    read = []

    def counted():
        for i in itertools.count():
            read.append(i)
            yield i

    with Pool(2) as pool:
        results = pool.imap(square, counted())
        assert [next(results) for _ in range(5)] == [0, 1, 4, 9, 16]
        assert len(read) <= 5 + 2 * 2 + 1  # what was taken, and two chunks per process ahead
        unordered = pool.imap_unordered(square, itertools.count(), chunksize=3)
        assert len({next(unordered) for _ in range(30)}) == 30
        with pytest.raises(ValueError, match="chunksize must be an int >= 1, got 0"):
            pool.imap(square, range(3), chunksize=0)
        with pytest.raises(ValueError, match="chunksize"):
            pool.map(square, range(3), chunksize=0)


def test_join_waits_for_every_item_of_an_imap_as_the_standard_librarys():
    # imap submitted its chunks as results were taken, so join() waited for
    # the first few, ended the processes, and the iterator then failed.
    pool = Pool(2)
    ordered = pool.imap(square, range(40))
    unordered = pool.imap_unordered(square, range(40), chunksize=3)
    pool.close()
    pool.join()
    assert list(ordered) == [x * x for x in range(40)]
    assert sorted(unordered) == [x * x for x in range(40)]
    terminated = Pool(1)
    rest = terminated.imap(square, range(40))
    terminated.terminate()
    import troupe

    # Its processes are gone: the work in flight fails, or (when it had
    # finished) the items never run are said to be: not ZeroDivisionError,
    # nor an end as if the iterable had ended.
    with pytest.raises((troupe.exceptions.ActorDiedError, ValueError)):
        list(rest)
    # Pool() at 2 CPUs a process on a 2-CPU cluster: one process, not a refusal.
    with Pool(ray_remote_args={"num_cpus": 2}) as one:
        assert one.map(square, range(3)) == [0, 1, 4]


def test_more_processes_than_the_cluster_has_cpus_is_refused_at_once():
    # As Ray's: the actors could never all be placed, and Pool(4) on two
    # CPUs waited for ever in its constructor.
    with pytest.raises(ValueError, match=r"Pool\(processes=4\) needs 4 CPUs .* the cluster has 2"):
        Pool(4)
    with Pool(4, ray_remote_args={"num_cpus": 0.5}) as pool:
        assert pool.map(square, range(4)) == [0, 1, 4, 9]


def test_a_function_that_cannot_be_pickled_is_named():
    lock = threading.Lock()
    with Pool(1) as pool:
        with pytest.raises(TypeError, match="Pool.map: func .* cannot be sent to the pool's processes: troupe.put"):
            pool.map(lambda x: (lock, x), range(2))

        def holds_the_lock():
            return lock

        with pytest.raises(TypeError, match="Pool.apply_async: func '.*holds_the_lock' .*cannot be sent"):
            pool.apply_async(holds_the_lock)


FORK_SCRIPT = r"""
import os, sys, troupe
troupe.init()

@troupe.remote
def one():
    return 1

assert troupe.get(one.remote()) == 1
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    try:
        troupe.get(one.remote(), timeout=30)
        said = "used the parent's runtime"
    except troupe.exceptions.TroupeError as e:
        said = str(e)
    os.write(w, said.encode()[:4000])
    sys.exit(0)  # runs the atexit shutdown the child inherited
os.close(w)
said = os.read(r, 4096).decode()
_, status = os.waitpid(pid, 0)
print("child said:", said)
print("child exit:", os.waitstatus_to_exitcode(status))
print("parent:", troupe.get(one.remote(), timeout=30))
"""


def test_a_forked_child_exits_and_is_told_it_cannot_use_the_parents_runtime(tmp_path):
    """os.fork() after troupe.init() (multiprocessing's 'fork'): the child's
    runtime calls fail naming the fork, its sys.exit() ends it, and the
    parent carries on. Before, the child's inherited atexit shutdown waited
    for answers no thread read: it never ended."""
    out = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "child exit: 0" in out.stdout, out.stdout + out.stderr
    assert "forked from" in out.stdout and "'spawn'" in out.stdout, out.stdout
    assert "parent: 1" in out.stdout, out.stdout
