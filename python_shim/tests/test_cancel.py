"""troupe.cancel, as Ray's ray.cancel: a task not started never runs, a
running one is interrupted (KeyboardInterrupt) or, forced, its worker is
killed; its ref raises TaskCancelledError; other work goes on."""
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


def test_cancel_refuses_what_is_not_a_task_of_this_process():
    @troupe.remote
    class Echo:
        def echo(self, x):
            return x

    with pytest.raises(ConfigError, match="ref of a task submitted by this process"):
        troupe.cancel(troupe.put(1))
    e = Echo.remote()
    with pytest.raises(ConfigError, match="ref of a task submitted by this process"):
        troupe.cancel(e.echo.remote(1))
    with pytest.raises(TypeError, match="ObjectRef"):
        troupe.cancel("not a ref")
    # num_returns' refs cancel their one task.
    pair = troupe.remote(num_returns=2)(lambda: (1, 2))
    a, b = pair.remote()
    troupe.get(a, timeout=60)
    troupe.cancel(b)
    assert troupe.get([a, b], timeout=60) == [1, 2]
