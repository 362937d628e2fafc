"""Actor namespaces, as Ray's: troupe.init(namespace=...) sets the driver's;
a named actor lives in its creator's namespace unless .options(namespace=...)
says otherwise; get_actor looks in the caller's, or in the one given. Tasks
and actors run in their driver's namespace. Unlike Ray, a driver that names
none has the default namespace "", whose names are cluster-wide as before.
The head keeps a namespaced name as NAMESPACE/NAME (what `troupe status`
shows); '/' is therefore refused in names and namespaces."""
import json
import os
import subprocess
import sys

import pytest

import troupe
from troupe.exceptions import ActorDiedError, ConfigError
from conftest import cli


@pytest.fixture(scope="module", autouse=True)
def alpha():
    # The shared `cluster` fixture inits without a namespace: this module's
    # driver lives in "alpha".
    troupe.init(num_cpus=2, namespace="alpha")
    yield
    troupe.shutdown()


@troupe.remote
class Counter:
    def __init__(self, start=0):
        self.n = start

    def add(self, k):
        self.n += k
        return self.n

    def namespace(self):
        return troupe.get_runtime_context().namespace

    def make_named(self, name):
        # No namespace given: the actor's (its driver's) one. (An actor,
        # not a task, makes it: a task's executor may be released when
        # idle, and its actors with it.)
        self.made = Counter.options(name=name).remote(7)
        return troupe.get_runtime_context().namespace

    def bump_by_name(self, name):
        # No namespace given: the actor's (its driver's) one.
        return troupe.get(troupe.get_actor(name).add.remote(1), timeout=60)


@troupe.remote
def bump_by_name(name):
    return troupe.get(troupe.get_actor(name).add.remote(1), timeout=60)


@troupe.remote
def namespace_of_a_task():
    return troupe.get_runtime_context().namespace


def test_the_same_name_in_two_namespaces_is_two_actors():
    mine = Counter.options(name="twin").remote(0)
    theirs = Counter.options(name="twin", namespace="beta").remote(100)
    assert troupe.get(mine.add.remote(1), timeout=60) == 1
    assert troupe.get(theirs.add.remote(1), timeout=60) == 101
    # get_actor looks in the caller's namespace unless told another.
    assert troupe.get(troupe.get_actor("twin").add.remote(1), timeout=60) == 2
    assert troupe.get(troupe.get_actor("twin", namespace="alpha").add.remote(1), timeout=60) == 3
    assert troupe.get(troupe.get_actor("twin", namespace="beta").add.remote(1), timeout=60) == 102
    # A second actor of that name in either namespace is refused.
    with pytest.raises(ConfigError, match="already taken"):
        Counter.options(name="twin", namespace="beta").remote()
    # get_if_exists looks where the actor would be made.
    again = Counter.options(name="twin", namespace="beta", get_if_exists=True).remote()
    assert troupe.get(again.add.remote(1), timeout=60) == 103
    with pytest.raises(ValueError, match="no actor named 'twin' in namespace 'gamma'"):
        troupe.get_actor("twin", namespace="gamma")
    with pytest.raises(ValueError, match="no actor named 'nobody' in namespace 'alpha'"):
        troupe.get_actor("nobody")
    troupe.kill(theirs)
    with pytest.raises(ActorDiedError):
        troupe.get(theirs.add.remote(1), timeout=60)
    with pytest.raises(ValueError, match="in namespace 'beta'"):
        troupe.get_actor("twin", namespace="beta")
    assert troupe.get(troupe.get_actor("twin").add.remote(1), timeout=60) == 4


def test_tasks_and_actors_run_in_their_drivers_namespace():
    assert troupe.get_runtime_context().namespace == "alpha"
    Counter.options(name="shared").remote(0)
    Counter.options(name="shared", namespace="beta").remote(50)
    # A task's get_actor(name) without a namespace finds the driver's actor.
    assert troupe.get(bump_by_name.remote("shared"), timeout=60) == 1
    assert troupe.get(namespace_of_a_task.remote(), timeout=60) == "alpha"
    # So does an actor's, also one whose own name lives in another namespace.
    elsewhere = Counter.options(name="elsewhere", namespace="beta").remote()
    assert troupe.get(elsewhere.namespace.remote(), timeout=60) == "alpha"
    assert troupe.get(elsewhere.bump_by_name.remote("shared"), timeout=60) == 2
    # A named actor made by an actor lands in the driver's namespace.
    assert troupe.get(elsewhere.make_named.remote("made_by_an_actor"), timeout=60) == "alpha"
    made = troupe.get_actor("made_by_an_actor")
    assert troupe.get(made.add.remote(1), timeout=60) == 8
    with pytest.raises(ValueError):
        troupe.get_actor("made_by_an_actor", namespace="beta")
    assert troupe.get(troupe.get_actor("shared", namespace="beta").add.remote(0), timeout=60) == 50


def test_bad_namespaces_and_names_are_refused_by_value():
    for bad in ("", 3, "a/b"):
        with pytest.raises(ConfigError, match="namespace") as info:
            troupe.init(namespace=bad)
        assert repr(bad) in str(info.value)
        with pytest.raises(ConfigError, match="namespace") as info:
            Counter.options(name="x", namespace=bad)
        assert repr(bad) in str(info.value)
        with pytest.raises(ConfigError, match="namespace") as info:
            troupe.get_actor("x", namespace=bad)
        assert repr(bad) in str(info.value)
    # '/' joins a namespace and a name in the head's table: no name has one.
    with pytest.raises(ConfigError, match="actor name 'a/b' contains '/'"):
        Counter.options(name="a/b")
    with pytest.raises(ConfigError, match="actor name 'alpha/x' contains '/'"):
        troupe.get_actor("alpha/x")
    # An empty name is no name given (Ray refuses it too), not an unnamed actor.
    with pytest.raises(ConfigError, match="an actor name must not be empty"):
        Counter.options(name="")
    assert troupe.get_runtime_context().namespace == "alpha"


def test_the_head_and_other_drivers_see_namespace_slash_name(tmp_path):
    a = Counter.options(name="seen").remote(0)
    b = Counter.options(name="seen", namespace="beta").remote(0)
    troupe.get([a.add.remote(1), b.add.remote(1)], timeout=60)
    client = troupe._client()
    env = dict(os.environ, TROUPE_TOKEN=client.token, TROUPE_SESSION_DIR=str(tmp_path / "session"))
    env.pop("TROUPE_ADDRESS", None)
    status = subprocess.run([cli(), "status", "--json", "--address", client.address], env=env, capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    names = {x["name"] for x in json.loads(status.stdout)["actors"] if x.get("state") != "DEAD"}
    assert {"alpha/seen", "beta/seen"} <= names, names
    assert "seen" not in names
    # `troupe logs` takes the name as the head keeps it (an embedded
    # cluster's workers keep no log files of their own: only the name's
    # lookup is checked here).
    logs = subprocess.run([cli(), "logs", "--address", client.address, "alpha/seen"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert "no actor named" not in logs.stderr, logs.stderr
    logs = subprocess.run([cli(), "logs", "--address", client.address, "seen"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert logs.returncode == 2 and "no actor named 'seen'" in logs.stderr, logs.stderr

    # A driver that names no namespace has the default one: plain names
    # (cluster-wide, as before), and others' actors by namespace=.
    script = tmp_path / "plain_driver.py"
    script.write_text(PLAIN_DRIVER)
    done = subprocess.run([sys.executable, str(script), client.address], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "namespace": "", "plain_name": "plain", "missing": True, "alpha_seen": 2}


PLAIN_DRIVER = """
import json
import sys

import troupe

troupe.init(address=sys.argv[1])


@troupe.remote
class Counter:
    def __init__(self, start=0):
        self.n = start

    def add(self, k):
        self.n += k
        return self.n


plain = Counter.options(name="plain").remote()
troupe.get(plain.add.remote(1), timeout=60)
try:
    troupe.get_actor("seen")
    missing = False
except ValueError:
    missing = True
print(json.dumps({
    "namespace": troupe.get_runtime_context().namespace,
    "plain_name": troupe.get_actor("plain")._actor.info()["name"],
    "missing": missing,
    "alpha_seen": troupe.get(troupe.get_actor("seen", namespace="alpha").add.remote(1), timeout=60),
}))
troupe.shutdown()
"""


def test_list_named_actors_in_this_namespace_or_all():
    from troupe.util import list_named_actors

    here = Counter.options(name="listed_here").remote()
    there = Counter.options(name="listed_there", namespace="beta").remote()
    anonymous = Counter.remote()
    troupe.get([here.add.remote(1), there.add.remote(1), anonymous.add.remote(1)], timeout=60)
    assert "listed_here" in list_named_actors() and "listed_there" not in list_named_actors()
    everywhere = list_named_actors(all_namespaces=True)
    assert {"name": "listed_here", "namespace": "alpha"} in everywhere
    assert {"name": "listed_there", "namespace": "beta"} in everywhere
    troupe.kill(here)
    # A killed actor is no longer listed (once the head has it DEAD).
    from conftest import wait_until

    wait_until(lambda: "listed_here" not in list_named_actors(), 60, "the killed actor to leave the list")
    with pytest.raises(ConfigError, match="all_namespaces must be True or False"):
        list_named_actors(all_namespaces="yes")
    troupe.kill(there)


@troupe.remote
def node_ip():
    from troupe.util import get_node_ip_address

    return get_node_ip_address()


def test_get_node_ip_address_in_driver_task_and_actor():
    from troupe.util import get_node_ip_address

    @troupe.remote
    class Where:
        def ip(self):
            return get_node_ip_address()

    # A loopback cluster: every node is reached at 127.0.0.1, and so is the
    # head from this driver.
    assert get_node_ip_address() == "127.0.0.1"
    assert troupe.get(node_ip.remote(), timeout=60) == "127.0.0.1"
    where = Where.remote()
    assert troupe.get(where.ip.remote(), timeout=60) == "127.0.0.1"
    nodes = {n["NodeManagerAddress"] for n in troupe.nodes() if n["Alive"]}
    assert nodes == {"127.0.0.1"}


def test_actor_names_that_are_not_strings_are_refused():
    """b"x" was registered as "b'x'", 5 as "5", and 0 made an unnamed
    actor; Ray refuses them with a TypeError."""
    @troupe.remote
    class Named:
        def ping(self):
            return 1

    for bad in (b"bytes", 5, 0):
        with pytest.raises(TypeError, match="an actor name must be a str"):
            Named.options(name=bad).remote()
    with pytest.raises(ConfigError, match="get_actor takes an actor's name, not 5"):
        troupe.get_actor(5)
