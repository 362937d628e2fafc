"""Workers SIGKILLed under max_restarts / max_task_retries / max_retries:
the C++ runtime restarts and retries, Python sees the results."""
import os
import signal

import pytest

import troupe
from troupe.exceptions import ActorDiedError, WorkerCrashedError
from conftest import wait_until

pytestmark = pytest.mark.usefixtures("cluster")


@troupe.remote(max_restarts=2, max_task_retries=-1)
class Survivor:
    def __init__(self):
        self.calls = 0

    def pid(self):
        return os.getpid()

    def bump(self):
        self.calls += 1
        return self.calls

    def take(self, x):
        return x


def test_actor_restarts_after_sigkill():
    a = Survivor.remote()
    pid = troupe.get(a.pid.remote(), timeout=60)
    assert troupe.get(a.bump.remote(), timeout=60) == 1
    os.kill(pid, signal.SIGKILL)
    # The constructor ran again in a new process: state starts over.
    assert troupe.get(a.bump.remote(), timeout=60) == 1
    assert troupe.get(a.pid.remote(), timeout=60) != pid


def test_actor_without_restarts_dies():
    a = Survivor.options(max_restarts=0, max_task_retries=0).remote()
    pid = troupe.get(a.pid.remote(), timeout=60)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: a._actor.info()["state"] == "DEAD", what="actor DEAD")
    with pytest.raises(ActorDiedError):
        troupe.get(a.bump.remote(), timeout=60)


def test_a_call_waiting_for_its_arguments_fails_when_its_actor_dies():
    # The argument's task never ends on its own: only the actor's death
    # can settle the call (before, it stayed pending for good).
    @troupe.remote(max_retries=0)
    def never():
        import time
        time.sleep(600)

    a = Survivor.options(max_restarts=0, max_task_retries=0).remote()
    pid = troupe.get(a.pid.remote(), timeout=60)
    blocker = never.remote()
    try:
        call = a.take.remote(blocker)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ActorDiedError, match="waited for its arguments"):
            troupe.get(call, timeout=60)
    finally:
        troupe.cancel(blocker, force=True)


def test_task_retried_after_sigkill(tmp_path):
    marker = str(tmp_path / "killed-once")

    @troupe.remote(max_retries=1)
    def die_once(path):
        if not os.path.exists(path):
            open(path, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return "second try"

    assert troupe.get(die_once.remote(marker), timeout=120) == "second try"

    @troupe.remote(max_retries=0)
    def always_die():
        os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(WorkerCrashedError):
        troupe.get(always_die.remote(), timeout=120)

    # Without max_retries a task runs again up to three times, as Ray's.
    @troupe.remote
    def die_three_times(path):
        with open(path, "a") as f:
            f.write("x")
        if os.path.getsize(path) <= 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return os.path.getsize(path)

    assert troupe.get(die_three_times.remote(str(tmp_path / "three")), timeout=180) == 4
