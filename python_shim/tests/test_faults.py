"""Workers SIGKILLed under max_restarts / max_task_retries / max_retries:
the C++ runtime restarts and retries, Python sees the results."""
import os
import signal

import pytest

import troupe
from troupe.exceptions import ActorDiedError, ConfigError, WorkerCrashedError
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


class Flaky(Exception):
    pass


@troupe.remote
class Tally:
    def __init__(self):
        self.n = 0

    def next(self):
        self.n += 1
        return self.n - 1

    def count(self):
        return self.n


@troupe.remote(max_restarts=1, max_task_retries=3)
class TroubleMaker:
    """Ray's retry_exceptions of actor methods: the method's own count, or
    the actor's max_task_retries (3), or a call's .options."""

    @troupe.method(max_task_retries=5, retry_exceptions=[Flaky])
    def raise_n_times(self, tally, n):
        c = troupe.get(tally.next.remote(), timeout=60)
        if c < n:
            raise Flaky(f"call {c}")
        return c

    @troupe.method(retry_exceptions=[Flaky])
    def raise_or_exit(self, tally, actions):
        c = troupe.get(tally.next.remote(), timeout=60)
        action = actions[c] if c < len(actions) else "return"
        if action == "raise":
            raise Flaky(f"call {c}")
        if action == "exit":
            os._exit(1)
        return c

    @troupe.method(retry_exceptions=True)
    async def async_raise_n_times(self, tally, n):
        c = await tally.next.remote()
        if c < n:
            raise ValueError(f"call {c}")
        return c

    def plain(self, tally, n):
        c = troupe.get(tally.next.remote(), timeout=60)
        if c < n:
            raise Flaky(f"call {c}")
        return c

    def mutating(self, items):
        items.append("x")
        if len(items) < 3:
            raise Flaky(f"len={len(items)}")
        return items

    def stream(self, tally, actions):
        # Each action is a value to yield, or Flaky to raise.
        while True:
            c = troupe.get(tally.next.remote(), timeout=60)
            if actions[c] is Flaky:
                raise Flaky(f"call {c}")
            yield actions[c]
            if c == len(actions) - 1:
                return


def test_actor_methods_are_run_again_on_the_exceptions_they_name():
    actor = TroubleMaker.remote()

    def run(call, *args):
        tally = Tally.remote()
        try:
            return troupe.get(call.remote(tally, *args), timeout=120), troupe.get(tally.count.remote(), timeout=60)
        except Flaky as e:
            return e, troupe.get(tally.count.remote(), timeout=60)

    # @troupe.method(max_task_retries=5): five retries, and no sixth.
    assert run(actor.raise_n_times, 5) == (5, 6)
    error, count = run(actor.raise_n_times, 6)
    assert isinstance(error, Flaky) and str(error).startswith("Flaky: call 5\n") and count == 6
    # A call's options win over the method's.
    assert run(actor.raise_n_times.options(max_task_retries=10), 10) == (10, 11)
    error, count = run(actor.raise_n_times.options(retry_exceptions=False), 5)
    assert str(error).startswith("Flaky: call 0\n") and count == 1
    error, count = run(actor.raise_n_times.options(retry_exceptions=[KeyError]), 5)
    assert str(error).startswith("Flaky: call 0\n") and count == 1
    # Without a count of its own, the method has the actor's (3).
    assert run(actor.raise_or_exit, ["raise"] * 3) == (3, 4)
    error, count = run(actor.raise_or_exit, ["raise"] * 4)
    assert str(error).startswith("Flaky: call 3\n") and count == 4
    # An async method, retry_exceptions=True (any Exception).
    assert run(actor.async_raise_n_times, 2) == (2, 3)
    # A method without retry_exceptions runs once, unless its call asks.
    error, count = run(actor.plain, 1)
    assert str(error).startswith("Flaky: call 0\n") and count == 1
    assert run(actor.plain.options(retry_exceptions=[Flaky], max_task_retries=1), 1) == (1, 2)
    # Each attempt gets the arguments as they arrived.
    error = None
    try:
        troupe.get(actor.mutating.options(retry_exceptions=True).remote([]), timeout=60)
    except Flaky as e:
        error = e
    assert str(error).startswith("Flaky: len=1\n")
    # A crash is retried too, apart from the exceptions: the method's worker
    # exits on call 1, the restarted actor runs it again.
    assert run(actor.raise_or_exit, ["raise", "exit", "raise"]) == (3, 4)
    # A streaming call starts again past the values already sent.
    tally = Tally.remote()
    stream = actor.stream.options(num_returns="streaming", retry_exceptions=[Flaky]).remote(
        tally, [1, Flaky, 1, Flaky, 1, 2, 3])
    assert [troupe.get(ref, timeout=60) for ref in stream] == [1, 2, 3]
    assert troupe.get(tally.count.remote(), timeout=60) == 7
    # Bad values are named.
    with pytest.raises(ConfigError, match="max_task_retries must be an int"):
        actor.plain.options(max_task_retries="2")
    with pytest.raises(ConfigError, match="retry_exceptions must be"):
        actor.plain.options(retry_exceptions="yes")
    with pytest.raises(ConfigError, match="troupe.method: max_task_retries"):
        troupe.method(max_task_retries=-2)


def test_a_handle_found_by_name_keeps_the_methods_retries():
    TroubleMaker.options(name="trouble").remote()
    found = troupe.get_actor("trouble")
    tally = Tally.remote()
    assert troupe.get(found.raise_n_times.remote(tally, 5), timeout=120) == 5
    assert found.raise_n_times._retries == 5
    troupe.kill(found)


def test_a_cancelled_call_is_not_run_again_on_its_exceptions(tmp_path):
    # It retried for ever (max_task_retries=-1) after troupe.cancel, and the
    # actor, which runs one call at a time, answered nothing else.
    @troupe.remote
    class Forever:
        def __init__(self):
            self.attempts = 0

        @troupe.method(retry_exceptions=[Flaky], max_task_retries=-1)
        def fail(self, path):
            self.attempts += 1
            with open(path, "w") as f:
                f.write(str(self.attempts))
            raise Flaky(str(self.attempts))

        def count(self):
            return self.attempts

    a = Forever.remote()
    path = tmp_path / "attempts"
    ref = a.fail.remote(str(path))
    wait_until(lambda: path.exists() and path.read_text() not in ("", "1", "2"), what="the retries to run")
    troupe.cancel(ref)
    with pytest.raises(troupe.exceptions.TaskCancelledError):
        troupe.get(ref, timeout=60)
    first = troupe.get(a.count.remote(), timeout=60)
    assert troupe.get(a.count.remote(), timeout=60) == first  # no attempt after the cancel


def test_retry_exceptions_retries_async_and_generator_tasks(tmp_path):
    # The retry ran around the function's call only: an async def task's
    # error came later, when its coroutine ran (one attempt, no retry), and a
    # generator task with a fixed num_returns failed every call ("returned a
    # generator, but it is no generator function").
    attempts = str(tmp_path / "attempts")

    @troupe.remote(max_retries=3, retry_exceptions=True)
    async def settles_on_the_third(path):
        with open(path, "a") as f:
            f.write("x\n")
        with open(path) as f:
            if len(f.readlines()) < 3:
                raise Flaky("not yet")
        return "third"

    assert troupe.get(settles_on_the_third.remote(attempts), timeout=120) == "third"
    with open(attempts) as f:
        assert len(f.readlines()) == 3

    @troupe.remote(num_returns=2, retry_exceptions=True)
    def two():
        yield 1
        yield 2

    assert troupe.get(list(two.remote()), timeout=120) == [1, 2]

    failed = str(tmp_path / "generator")

    @troupe.remote(num_returns=2, max_retries=2, retry_exceptions=[Flaky])
    def fails_while_yielding(path):
        yield "a"
        if not os.path.exists(path):
            open(path, "w").close()
            raise Flaky("between its values")
        yield "b"

    assert troupe.get(list(fails_while_yielding.remote(failed)), timeout=120) == ["a", "b"]
