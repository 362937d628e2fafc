"""Ray's own introductory examples, ported to troupe by changing the import.

The bodies below are the examples of Ray's "Ray Core" getting-started and
key-concepts pages (tasks, actors, passing objects and chained refs, `wait`,
`put` of a large array, named actors, nested refs, actor handles passed to
tasks, remote errors), with `import ray` replaced by `import troupe as ray`.
The module under test is selectable so that the same file is shown to pass
against Ray itself: TROUPE_TEST_AGAINST=ray (run with an interpreter that
imports ray, e.g. bench/py_calls.py's venv build/ray-venv) or troupe (the
default).

Every test is bounded: an alarm fails it after TEST_TIMEOUT_S and, should the
main thread be stuck where a Python signal handler cannot run (inside a
blocking native call), faulthandler ends the whole run shortly after.
"""

import importlib
import os
import time

import numpy as np
import pytest
from timebox import bounded_fixture

AGAINST = os.environ.get("TROUPE_TEST_AGAINST", "troupe")
# The only change to the examples: `import ray` becomes `import troupe as ray`.
ray = importlib.import_module(AGAINST)

TEST_TIMEOUT_S = 120


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=4)
    yield
    ray.shutdown()


bounded = bounded_fixture(TEST_TIMEOUT_S)


# --- Tasks: "Running a Task" ------------------------------------------------


def test_tasks():
    # Define the square task.
    @ray.remote
    def square(x):
        return x * x

    # Launch four parallel square tasks.
    futures = [square.remote(i) for i in range(4)]

    # Retrieve results.
    assert ray.get(futures) == [0, 1, 4, 9]


def test_task_options_and_single_get():
    @ray.remote(num_cpus=1)
    def my_function():
        return 1

    obj_ref = my_function.remote()
    assert ray.get(obj_ref) == 1
    assert ray.get(my_function.options(num_cpus=2).remote()) == 1


# --- Actors: "Calling an Actor" ---------------------------------------------


def test_actors():
    # Define the Counter actor.
    @ray.remote
    class Counter:
        def __init__(self):
            self.i = 0

        def get(self):
            return self.i

        def incr(self, value):
            self.i += value

    # Create a Counter actor.
    c = Counter.remote()

    # Submit calls to the actor. These calls run asynchronously but in
    # submission order on the remote actor process.
    for _ in range(10):
        c.incr.remote(1)

    # Retrieve final actor state.
    assert ray.get(c.get.remote()) == 10


def test_actor_constructor_arguments_and_many_actors():
    @ray.remote
    class Counter:
        def __init__(self, start):
            self.value = start

        def increment(self):
            self.value += 1
            return self.value

    counters = [Counter.remote(10 * i) for i in range(3)]
    assert ray.get([c.increment.remote() for c in counters]) == [1, 11, 21]
    assert ray.get([c.increment.remote() for c in counters]) == [2, 12, 22]


# --- Passing objects: "Passing an Object" and chained refs -----------------


def test_chained_refs():
    @ray.remote
    def my_function():
        return 1

    @ray.remote
    def function_with_an_argument(value):
        return value + 1

    obj_ref1 = my_function.remote()
    assert ray.get(obj_ref1) == 1

    # You can pass an object ref as an argument to another Ray task.
    obj_ref2 = function_with_an_argument.remote(obj_ref1)
    assert ray.get(obj_ref2) == 2


def test_chain_of_tasks():
    @ray.remote
    def add_one(x):
        return x + 1

    ref = add_one.remote(0)
    for _ in range(9):
        ref = add_one.remote(ref)
    assert ray.get(ref) == 10


def test_put_of_a_64MiB_array():
    # Define a task that sums the values in a matrix.
    @ray.remote
    def sum_matrix(matrix):
        return np.sum(matrix)

    # Call the task with a literal argument value.
    assert ray.get(sum_matrix.remote(np.ones((100, 100)))) == 10000.0

    # Put a large array into the object store: 64 MiB of float64.
    matrix_ref = ray.put(np.ones((2048, 4096)))

    # Call the task with the object reference as an argument.
    assert ray.get(sum_matrix.remote(matrix_ref)) == 2048 * 4096

    # And get it back in the driver, intact.
    matrix = ray.get(matrix_ref)
    assert matrix.shape == (2048, 4096) and matrix.dtype == np.float64
    assert matrix.nbytes == 64 << 20 and float(matrix.sum()) == 2048 * 4096


def test_put_get_roundtrip():
    # Put an object in Ray's object store.
    y = 1
    object_ref = ray.put(y)
    assert ray.get(object_ref) == 1

    # Get the values of multiple object refs in parallel.
    assert ray.get([ray.put(i) for i in range(3)]) == [0, 1, 2]


def test_get_timeout():
    @ray.remote
    def long_running_function():
        time.sleep(8)

    obj_ref = long_running_function.remote()
    with pytest.raises(ray.exceptions.GetTimeoutError):
        ray.get(obj_ref, timeout=4)


def test_nested_refs_stay_refs():
    @ray.remote
    def echo_and_get(x_list):  # List[ObjectRef]
        """This function takes a list of object refs and gets their values."""
        assert all(isinstance(x, ray.ObjectRef) for x in x_list)
        return ray.get(x_list)

    # Put the values (1, 2, 3) into Ray's object store.
    a, b, c = ray.put(1), ray.put(2), ray.put(3)

    # Passing an object as a nested argument to `echo_and_get`. Ray does not
    # de-reference nested args, so `echo_and_get` sees the references.
    assert ray.get(echo_and_get.remote([a, b, c])) == [1, 2, 3]


# --- Waiting for partial results ---------------------------------------------


def test_wait():
    @ray.remote
    def f(seconds):
        time.sleep(seconds)
        return seconds

    object_refs = [f.remote(0), f.remote(10)]
    ready_refs, remaining_refs = ray.wait(object_refs, num_returns=1, timeout=None)
    assert ready_refs == [object_refs[0]] and remaining_refs == [object_refs[1]]
    assert ray.get(ready_refs) == [0]

    # With a timeout, wait returns what is ready by then.
    ready_refs, remaining_refs = ray.wait(remaining_refs, num_returns=1, timeout=0.5)
    assert ready_refs == [] and remaining_refs == [object_refs[1]]


def test_wait_as_results_arrive():
    @ray.remote
    def f(i):
        time.sleep(0.05 * (i % 3))
        return i

    refs = [f.remote(i) for i in range(8)]
    results = []
    unfinished = refs
    while unfinished:
        # Returns the first ObjectRef that is ready.
        finished, unfinished = ray.wait(unfinished, num_returns=1)
        results.extend(ray.get(finished))
    assert sorted(results) == list(range(8))


# --- Named actors --------------------------------------------------------------


def test_named_actors():
    @ray.remote
    class Counter:
        def __init__(self):
            self.value = 0

        def increment(self):
            self.value += 1
            return self.value

    # Create an actor with a name.
    counter = Counter.options(name="some_name").remote()
    assert ray.get(counter.increment.remote()) == 1

    # Retrieve the actor later somewhere. (The creating handle stays in
    # scope: a named actor that is not detached lives as long as it does.)
    same_counter = ray.get_actor("some_name")
    assert ray.get(same_counter.increment.remote()) == 2

    # Named actors are found from other processes as well.
    @ray.remote
    def increment_by_name(name):
        return ray.get(ray.get_actor(name).increment.remote())

    assert ray.get(increment_by_name.remote("some_name")) == 3

    with pytest.raises(ValueError):
        ray.get_actor("no_such_actor")
    ray.kill(counter)


def test_actor_handles_passed_to_tasks():
    @ray.remote
    class Counter:
        def __init__(self):
            self.value = 0

        def increment(self):
            self.value += 1

        def get_counter(self):
            return self.value

    @ray.remote
    def f(counter):
        for _ in range(10):
            counter.increment.remote()
        # Calls from one caller run in order: this one runs after the ten.
        return ray.get(counter.get_counter.remote())

    counter = Counter.remote()
    assert all(10 <= n <= 30 for n in ray.get([f.remote(counter) for _ in range(3)]))
    assert ray.get(counter.get_counter.remote()) == 30


# --- Errors ----------------------------------------------------------------------


def test_remote_exception_caught_by_its_class():
    @ray.remote
    def f():
        raise ValueError("bad value 42")

    with pytest.raises(ValueError) as info:
        ray.get(f.remote())
    assert "bad value 42" in str(info.value)
    assert isinstance(info.value, ray.exceptions.RayTaskError if AGAINST == "ray" else ray.exceptions.TaskError)


def test_killed_actor_raises_actor_died():
    @ray.remote
    class Actor:
        def ping(self):
            return "pong"

    a = Actor.remote()
    assert ray.get(a.ping.remote()) == "pong"
    ray.kill(a)
    # The kill is asynchronous: calls fail once it has taken effect.
    with pytest.raises(ray.exceptions.ActorDiedError):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ray.get(a.ping.remote(), timeout=60)
            time.sleep(0.05)


# --- Cluster information -----------------------------------------------------------


def test_cluster_resources():
    assert ray.is_initialized()
    assert ray.cluster_resources()["CPU"] == 4
    assert 0 <= ray.available_resources().get("CPU", 0) <= 4
    assert len(ray.nodes()) == 1
