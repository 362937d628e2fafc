"""troupe.cancel, as Ray's ray.cancel: a task not started never runs, a
running one is interrupted (KeyboardInterrupt) or, forced, its worker is
killed; its ref raises TaskCancelledError; other work goes on. An actor
call not started never runs; a running plain method runs on and sees
is_canceled(), an async one's coroutine is cancelled."""
import gc
import os

import pytest

import troupe
from conftest import wait_until
from troupe.exceptions import ConfigError, TaskCancelledError


def _exists(path):
    return lambda: os.path.exists(path)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@troupe.remote
def until_file(started, release):
    """Says it started, then waits (in Python, so an interrupt lands) until
    `release` exists."""
    import time

    with open(started, "w") as f:
        f.write(str(os.getpid()))
    while not os.path.exists(release):
        time.sleep(0.01)
    return "released"


@troupe.remote
def touch(path, value=None):
    with open(path, "w") as f:
        f.write("ran")
    return value


pytestmark = pytest.mark.usefixtures("cluster")


@troupe.remote
def waits_on(children, started, interrupted):
    """Says it started, then waits in troupe.get for its child."""
    with open(started, "w") as f:
        f.write(str(os.getpid()))
    try:
        return troupe.get(children[0])
    except KeyboardInterrupt:
        with open(interrupted, "w") as f:
            f.write("interrupted")
        raise


def test_a_task_waiting_in_get_is_interrupted_at_once(tmp_path):
    # The interrupt came only when the child ended (the wait runs in C++,
    # where Python raises nothing): a cancelled parent waited out its child.
    child = until_file.remote(str(tmp_path / "child"), str(tmp_path / "release"))
    started, interrupted = str(tmp_path / "parent"), str(tmp_path / "interrupted")
    parent = waits_on.remote([child], started, interrupted)
    wait_until(_exists(started), what="the parent started")
    wait_until(_exists(str(tmp_path / "child")), what="the child started")
    troupe.cancel(parent)
    wait_until(_exists(interrupted), timeout=60, what="the parent interrupted while its child runs")
    with pytest.raises(TaskCancelledError):
        troupe.get(parent, timeout=60)
    assert not os.path.exists(str(tmp_path / "release"))
    open(str(tmp_path / "release"), "w").close()
    assert troupe.get(child, timeout=60) == "released"


@troupe.remote
def nests(depth, folder):
    """At depth 0, says it started and waits in Python until folder/release
    exists; above it, submits itself one level down and waits for that in
    troupe.get. Each level writes folder/ended-<depth> holding the name of
    what ended it (KeyboardInterrupt; a parent may see its cancelled
    child's TaskCancelledError first), folder/finished-<depth> when it
    returns."""
    import time

    try:
        if depth == 0:
            open(os.path.join(folder, "started"), "w").close()
            while not os.path.exists(os.path.join(folder, "release")):
                time.sleep(0.01)
            result = "released"
        else:
            result = troupe.get(nests.remote(depth - 1, folder), timeout=120)
    except BaseException as e:
        with open(os.path.join(folder, f"ended-{depth}"), "w") as f:
            f.write(type(e).__name__)
        raise
    open(os.path.join(folder, f"finished-{depth}"), "w").close()
    return result


def test_a_recursive_cancel_reaches_the_tasks_a_task_started_and_theirs(tmp_path):
    # recursive=True (Ray's default) was taken and ignored: the children of
    # a cancelled task ran on to their end.
    parent = nests.remote(2, str(tmp_path))
    wait_until(_exists(str(tmp_path / "started")), what="the grandchild started")
    troupe.cancel(parent)
    with pytest.raises(TaskCancelledError):
        troupe.get(parent, timeout=60)
    for depth in (2, 1, 0):
        wait_until(_exists(str(tmp_path / f"ended-{depth}")), timeout=60, what=f"the task at depth {depth} ended")
    assert (tmp_path / "ended-0").read_text() == "KeyboardInterrupt"
    assert not os.path.exists(str(tmp_path / "release"))
    assert not any(os.path.exists(str(tmp_path / f"finished-{d}")) for d in (0, 1, 2))


def test_without_recursive_the_tasks_a_cancelled_task_started_run_on(tmp_path):
    parent = nests.remote(1, str(tmp_path))
    wait_until(_exists(str(tmp_path / "started")), what="the child started")
    troupe.cancel(parent, recursive=False)
    wait_until(_exists(str(tmp_path / "ended-1")), timeout=60, what="the parent interrupted")
    assert (tmp_path / "ended-1").read_text() == "KeyboardInterrupt"
    open(str(tmp_path / "release"), "w").close()
    wait_until(_exists(str(tmp_path / "finished-0")), timeout=60, what="the child ran to its end")
    assert not os.path.exists(str(tmp_path / "ended-0"))


def test_a_task_that_has_not_started_never_runs(tmp_path):
    release = str(tmp_path / "release")
    # Both CPUs busy: the third task waits (queued here, or in an executor's
    # mailbox behind a running task).
    busy = [until_file.remote(str(tmp_path / f"started{i}"), release) for i in range(2)]
    for i in range(2):
        wait_until(_exists(str(tmp_path / f"started{i}")), what=f"task {i} started")
    never = str(tmp_path / "never")
    queued = touch.remote(never)
    # And one that waits for an argument that is not there yet.
    waits_for_arg = touch.remote(str(tmp_path / "never2"), busy[0])
    troupe.cancel(queued)
    troupe.cancel(waits_for_arg)
    with pytest.raises(TaskCancelledError, match="touch' was cancelled"):
        troupe.get(queued, timeout=60)
    with pytest.raises(TaskCancelledError):
        troupe.get(waits_for_arg, timeout=60)
    open(release, "w").close()
    assert troupe.get(busy, timeout=60) == ["released", "released"]
    # Work after them runs (on the same executors) and the cancelled ones
    # did not: they had run first if they ever were to.
    assert troupe.get(touch.remote(str(tmp_path / "after"), 7), timeout=60) == 7
    assert not os.path.exists(never) and not os.path.exists(str(tmp_path / "never2"))


def test_an_actor_handle_in_a_task_cancelled_while_queued_does_not_keep_its_actor(tmp_path):
    # The handle carries the actor's lifetime object, pinned when the task
    # was encoded: a task that never went left the pin (and the actor, and
    # what it holds) until this driver exited.
    release = str(tmp_path / "release")
    busy = until_file.options(num_cpus=2).remote(str(tmp_path / "started"), release)
    try:
        wait_until(_exists(str(tmp_path / "started")), what="the task holding both CPUs to start")
        gate = Gate.options(num_cpus=0).remote()
        assert troupe.get(gate.seven.remote(), timeout=60) == 7
        actor = gate._actor
        # Needs a CPU, with none free, and an executor of its own (other
        # resources than the running task's): it waits here, never sent.
        queued = touch.options(num_cpus=1).remote(str(tmp_path / "never"), gate)
        troupe.cancel(queued)
        with pytest.raises(TaskCancelledError):
            troupe.get(queued, timeout=60)
        del gate, queued
        gc.collect()
        wait_until(lambda: actor.info()["state"] == "DEAD", timeout=60, what="the actor whose handles all went")
        assert "out of scope" in actor.info()["death_cause"]
    finally:
        open(release, "w").close()
    assert troupe.get(busy, timeout=60) == "released"
    assert not os.path.exists(str(tmp_path / "never"))


def test_a_running_task_is_interrupted_and_its_worker_serves_on(tmp_path):
    @troupe.remote
    def interruptible(started, interrupted):
        import time

        with open(started, "w") as f:
            f.write(str(os.getpid()))
        try:
            while True:
                time.sleep(0.01)
        except KeyboardInterrupt:
            open(interrupted, "w").close()
            raise

    started, interrupted = str(tmp_path / "started"), str(tmp_path / "interrupted")
    ref = interruptible.remote(started, interrupted)
    wait_until(_exists(started), what="the task started")
    troupe.cancel(ref)
    with pytest.raises(TaskCancelledError):
        troupe.get(ref, timeout=60)
    # The task itself saw KeyboardInterrupt (not only its ref failed), and
    # its worker lives on and runs the next task.
    wait_until(_exists(interrupted), what="the task saw KeyboardInterrupt")
    pid = int(open(started).read())
    assert _alive(pid)
    assert troupe.get(touch.remote(str(tmp_path / "next"), "next"), timeout=60) == "next"
    # Cancelling again, or a finished task, changes nothing.
    troupe.cancel(ref)
    done = touch.remote(str(tmp_path / "done"), 5)
    assert troupe.get(done, timeout=60) == 5
    troupe.cancel(done)
    assert troupe.get(done, timeout=60) == 5


def test_force_kills_the_worker_of_a_task_blocked_in_a_call(tmp_path):
    @troupe.remote
    def sleeps(started):
        import time

        with open(started, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)  # no Python instruction to interrupt for an hour

    started = str(tmp_path / "started")
    ref = sleeps.remote(started)
    wait_until(_exists(started), what="the task started")
    pid = int(open(started).read())
    troupe.cancel(ref, force=True)
    with pytest.raises(TaskCancelledError, match="its worker was killed"):
        troupe.get(ref, timeout=60)
    wait_until(lambda: not _alive(pid), what=f"executor pid {pid} killed")
    # Its CPU is free again: two tasks at once still fit.
    release = str(tmp_path / "release")
    both = [until_file.remote(str(tmp_path / f"s{i}"), release) for i in range(2)]
    for i in range(2):
        wait_until(_exists(str(tmp_path / f"s{i}")), what=f"task {i} started")
    open(release, "w").close()
    assert troupe.get(both, timeout=60) == ["released", "released"]


def test_cancel_refuses_what_is_not_a_task_or_call_of_this_process():
    with pytest.raises(ConfigError, match="ref of a task or actor method call made by this process"):
        troupe.cancel(troupe.put(1))
    with pytest.raises(TypeError, match="ObjectRef"):
        troupe.cancel("not a ref")
    # num_returns' refs cancel their one task.
    pair = troupe.remote(num_returns=2)(lambda: (1, 2))
    a, b = pair.remote()
    troupe.get(a, timeout=60)
    troupe.cancel(b)
    assert troupe.get([a, b], timeout=60) == [1, 2]


@troupe.remote
class Gate:
    def hold(self, started, saw):
        """Runs until troupe.cancel reaches it (at most two minutes)."""
        import time

        with open(started, "w") as f:
            f.write(str(os.getpid()))
        context = troupe.get_runtime_context()
        deadline = time.monotonic() + 120
        while not context.is_canceled():
            if time.monotonic() > deadline:
                return "never cancelled"
            time.sleep(0.01)
        open(saw, "w").close()
        return "saw the cancel"

    def touch(self, path, value=None):
        with open(path, "w") as f:
            f.write("ran")
        return value

    def seven(self):
        return 7

    def waits_for_a_task(self, folder):
        """Runs a task and waits for it: a plain method runs on when
        cancelled, what it started is cancelled (recursive)."""
        try:
            return troupe.get(nests.remote(0, folder), timeout=120)
        except TaskCancelledError:
            return "its task was cancelled"


def test_an_actor_call_not_started_never_runs_and_a_running_one_sees_is_canceled(tmp_path):
    gate = Gate.remote()
    started, saw, never = (str(tmp_path / n) for n in ("started", "saw", "never"))
    running = gate.hold.remote(started, saw)
    wait_until(_exists(started), what="the method started")
    queued = gate.touch.remote(never)
    behind = gate.seven.remote()
    troupe.cancel(queued)
    with pytest.raises(TaskCancelledError, match="Gate.touch was cancelled"):
        troupe.get(queued, timeout=60)
    # A call cannot be forced (Ray raises ValueError too): the actor's
    # state would go with its worker.
    with pytest.raises(ValueError, match="force=True is for tasks"):
        troupe.cancel(running, force=True)
    troupe.cancel(running)
    with pytest.raises(TaskCancelledError):
        troupe.get(running, timeout=60)
    # The running method saw the cancel and returned; the actor skipped the
    # cancelled call and ran the one behind it.
    assert troupe.get(behind, timeout=60) == 7
    assert os.path.exists(saw) and not os.path.exists(never)
    troupe.cancel(behind)
    assert troupe.get(behind, timeout=60) == 7

    # One waiting for its argument is never sent.
    release, never2 = str(tmp_path / "release"), str(tmp_path / "never2")
    argument = until_file.remote(str(tmp_path / "arg-started"), release)
    dependent = gate.touch.remote(never2, argument)
    troupe.cancel(dependent)
    with pytest.raises(TaskCancelledError):
        troupe.get(dependent, timeout=60)
    open(release, "w").close()
    assert troupe.get(argument, timeout=60) == "released"
    assert troupe.get(gate.seven.remote(), timeout=60) == 7
    assert not os.path.exists(never2)

    # A driver runs no task: there is nothing to ask about.
    with pytest.raises(RuntimeError, match="runs none"):
        troupe.get_runtime_context().is_canceled()


def test_a_running_async_methods_coroutine_is_cancelled(tmp_path):
    @troupe.remote
    class Waiter:
        async def wait(self, started, cancelled):
            import asyncio

            open(started, "w").close()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                open(cancelled, "w").close()
                raise

        async def ping(self):
            return "pong"

    waiter = Waiter.remote()
    started, cancelled = str(tmp_path / "started"), str(tmp_path / "cancelled")
    ref = waiter.wait.remote(started, cancelled)
    wait_until(_exists(started), what="the coroutine started")
    troupe.cancel(ref)
    with pytest.raises(TaskCancelledError):
        troupe.get(ref, timeout=60)
    wait_until(_exists(cancelled), what="the coroutine saw CancelledError")
    assert troupe.get(waiter.ping.remote(), timeout=60) == "pong"


def test_a_recursive_cancel_of_a_method_call_reaches_the_tasks_it_started(tmp_path):
    gate = Gate.remote()
    call = gate.waits_for_a_task.remote(str(tmp_path))
    wait_until(_exists(str(tmp_path / "started")), what="the method's task started")
    troupe.cancel(call)
    with pytest.raises(TaskCancelledError):
        troupe.get(call, timeout=60)
    wait_until(_exists(str(tmp_path / "ended-0")), timeout=60, what="the method's task interrupted")
    assert (tmp_path / "ended-0").read_text() == "KeyboardInterrupt"
    assert troupe.get(gate.seven.remote(), timeout=60) == 7
