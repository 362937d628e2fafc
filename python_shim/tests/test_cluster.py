"""troupe.init(address=...) against a cluster started with `troupe start
--head`; a C++ driver's actor and a Python actor on that one cluster; wrong
address or token; a detached actor outlives its driver."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import troupe
from troupe.exceptions import ConfigError, TroupeConnectionError, TroupeError
from conftest import cli, session_env, wait_until, when_blocked_in


@troupe.remote
class Echo:
    def echo(self, x):
        return x


def test_connect_by_address_and_auto_with_a_cpp_driver_beside(head):
    env, address = head
    troupe.init(address=address)
    e = Echo.remote()
    assert troupe.get(e.echo.remote("py"), timeout=60) == "py"
    assert troupe.cluster_resources()["CPU"] == 2.0
    hello = os.environ.get("TROUPE_HELLO_ACTORS")
    if hello:
        # A C++ driver spawns C++ actors on the same cluster meanwhile.
        run = subprocess.run([hello, "--address", address], env=env, capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, run.stdout + run.stderr
    assert troupe.get(e.echo.remote("still here"), timeout=60) == "still here"
    troupe.shutdown()
    troupe.init(address="auto")
    assert troupe.get(Echo.remote().echo.remote(1), timeout=60) == 1


def test_init_without_an_address_joins_the_sessions_running_cluster_as_rays(head):
    # It started an embedded cluster beside the running one; "local" still does.
    env, address = head
    # init() returns Ray's context: the address, and as a context manager
    # it shuts down at its end.
    driver = ("import troupe\nwith troupe.init() as ctx: print(troupe.get_runtime_context().gcs_address, "
              "ctx['address'])\nassert not troupe.is_initialized()\n"
              "troupe.init(address='local'); print(troupe.get_runtime_context().gcs_address)")
    r = subprocess.run([sys.executable, "-c", driver], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    joined, said, local = r.stdout.split()
    assert joined == address == said and local != address, r.stdout
    assert f"troupe.init: connecting to the cluster running at {address}" in r.stderr, r.stderr


def test_init_on_a_host_that_joined_a_cluster_connects_to_that_cluster(head, tmp_path):
    # A session whose node agent joined a cluster (`troupe start --address`)
    # runs no head: init() there started a private one-node cluster, while
    # `troupe status` in the same session used the joined one.
    env, address = head
    token = (os.path.join(env["TROUPE_SESSION_DIR"], "token"))
    joined = tmp_path / "joined"
    joined.mkdir(mode=0o700)
    node_env = dict(env, TROUPE_SESSION_DIR=str(joined))
    subprocess.run([cli(), "start", "--address", address, "--resources", "CPU=1"],
                   env=dict(node_env, TROUPE_TOKEN=open(token).read().strip()), check=True, timeout=120)
    try:
        driver = ("import troupe\ntroupe.init()\n"
                  "print(troupe.get_runtime_context().gcs_address, sum(n['Alive'] for n in troupe.nodes()))")
        r = subprocess.run([sys.executable, "-c", driver], env=node_env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [address, "2"], r.stdout
        assert f"troupe.init: connecting to the cluster running at {address}" in r.stderr, r.stderr
    finally:
        subprocess.run([cli(), "stop"], env=node_env, timeout=120)


def test_an_address_where_no_troupe_process_answers_is_a_connection_error():
    # A port that accepts and says nothing (a dashboard's, given by
    # mistake): it read as a GetTimeoutError, "connecting ... timed out".
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        with pytest.raises(TroupeConnectionError, match=f"cannot connect to 127.0.0.1:{port}: no troupe handshake"):
            troupe.init(address=f"127.0.0.1:{port}", _token="0" * 64)
    assert not troupe.is_initialized()


def test_wrong_token_and_address(head):
    env, address = head
    with pytest.raises(TroupeError):
        troupe.init(address=address, _token="0" * 64)
    assert not troupe.is_initialized()
    with pytest.raises(TroupeError):
        troupe.init(address="127.0.0.1:1")
    with pytest.raises(TroupeError):
        troupe.init(address="not an address")
    os.environ["TROUPE_TOKEN"] = "wrong"
    try:
        with pytest.raises(TroupeConnectionError):
            troupe.init(address=address)
    finally:
        os.environ.pop("TROUPE_TOKEN")


def test_empty_or_malformed_address_is_named(tmp_path, monkeypatch):
    """address="" is no request for an embedded cluster (that is None); a
    bad HOST:PORT is named as such before the token it would need is looked
    for (this session directory has none)."""
    session, _ = session_env(tmp_path)
    monkeypatch.setenv("TROUPE_SESSION_DIR", str(session))
    monkeypatch.delenv("TROUPE_TOKEN", raising=False)
    monkeypatch.delenv("TROUPE_ADDRESS", raising=False)
    for empty in ("", " "):
        with pytest.raises(ConfigError, match=f"address '{empty}' is empty"):
            troupe.init(address=empty)
        assert not troupe.is_initialized()
    for bad, why in (("127.0.0.1:99999", "port out of range"), ("127.0.0.1:0", "port out of range"),
                     ("127.0.0.1:x", "bad port"), ("127.0.0.1", "is not HOST:PORT")):
        with pytest.raises(ConfigError, match=f"address '{bad}' .*{why}") as info:
            troupe.init(address=bad)
        assert "token" not in str(info.value)
        assert not troupe.is_initialized()


def test_heartbeat_tolerance_is_set_by_troupe_start(tmp_path):
    """`troupe start --head --heartbeat-misses 40`: a node agent stopped
    (SIGSTOP) for 1.5 s stays the same live node, where the default (5
    misses of 100 ms) would have declared it dead and fenced it."""
    import json
    import signal
    import time

    launcher = cli()
    _, env = session_env(tmp_path)

    def nodes():
        out = subprocess.run([launcher, "status", "--json"], env=env, capture_output=True, text=True, check=True,
                             timeout=60).stdout
        return json.loads(out)["nodes"]

    subprocess.run([launcher, "start", "--head", "--port", "0", "--resources", "CPU=1", "--heartbeat-misses", "40"],
                   env=env, check=True, timeout=120)
    pid = None
    try:
        before = nodes()
        assert [n["alive"] for n in before] == [True], before
        pid = before[0]["pid"]
        os.kill(pid, signal.SIGSTOP)
        time.sleep(1.5)  # the fault's length: 1.5 s of the 4 s allowed
        os.kill(pid, signal.SIGCONT)
        after = nodes()
        assert [(n["id"], n["alive"]) for n in after] == [(before[0]["id"], True)], after
    finally:
        if pid:
            os.kill(pid, signal.SIGCONT)
        subprocess.run([launcher, "stop"], env=env, timeout=120)


def test_handles_of_a_shut_down_session_reach_nothing_of_the_next():
    # Actor and placement group ids are per cluster: the first actor (group)
    # of the next embedded cluster has the id the first one of the last had.
    # troupe.kill or remove_placement_group of an old handle must say so,
    # not kill the new cluster's actor or free its group.
    from troupe.util import placement_group, placement_group_table, remove_placement_group
    from troupe.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    troupe.init(num_cpus=2)
    try:
        old = Echo.remote()
        assert troupe.get(old.echo.remote(1), timeout=60) == 1
        old_pg = placement_group([{"CPU": 1}])
        assert old_pg.wait(60)
        troupe.shutdown()
        troupe.init(num_cpus=2)
        new = Echo.remote()
        assert troupe.get(new.echo.remote(2), timeout=60) == 2
        pg = placement_group([{"CPU": 1}])
        assert pg.wait(60)
        # What makes the mix-up possible:
        assert (new._actor.id, pg.id) == (old._actor.id, old_pg.id)
        stale = "belongs to a troupe session that was shut down"
        with pytest.raises(TroupeError, match=f"actor {old._actor.id} {stale}"):
            troupe.kill(old)
        with pytest.raises(TroupeError, match=f"placement group {old_pg.id} {stale}"):
            remove_placement_group(old_pg)
        with pytest.raises(TroupeError, match=stale):
            Echo.options(scheduling_strategy=PlacementGroupSchedulingStrategy(old_pg, 0)).remote()
        assert troupe.get(new.echo.remote(3), timeout=60) == 3
        assert placement_group_table(pg)["state"] == "CREATED"
        # A group that came back through a value is this session's.
        back = troupe.get(pg.ready(), timeout=60)
        assert back == pg and placement_group_table(back)["state"] == "CREATED"
        remove_placement_group(back)
    finally:
        troupe.shutdown()


@troupe.remote
def plus_one(x):
    return x + 1


def test_a_function_is_exported_to_every_new_session():
    # The function table is per cluster; a new session's client may get
    # the id() of a collected one, which once made the export look done.
    import gc

    for i in range(8):
        troupe.init(num_cpus=1)
        try:
            assert troupe.get(plus_one.remote(i), timeout=60) == i + 1
        finally:
            troupe.shutdown()
        gc.collect()


def test_shutdown_ends_a_get_on_a_running_task(tmp_path):
    # troupe.shutdown() (from another thread) while a get waits on a task
    # that is running: the get fails at once. The task's executor was
    # forgotten by the core before it shut down, so the call used to wait
    # for a reply that never came: the get hung for good without a timeout.
    started = tmp_path / "started"

    @troupe.remote
    def stuck(path):
        open(path, "w").close()
        return threading.Event().wait(300)

    troupe.init(num_cpus=2)
    try:
        ref = stuck.remote(str(started))
        wait_until(started.exists, what="the task's start")
        stopper = when_blocked_in(troupe.get, troupe.shutdown)
        begin = time.monotonic()
        with pytest.raises(TroupeError, match="did not finish: the runtime shut down while it ran") as info:
            troupe.get(ref, timeout=60)
        # Not a collective's error (it was CollectiveAbortedError).
        assert not isinstance(info.value, troupe.exceptions.CollectiveAbortedError), type(info.value)
        assert time.monotonic() - begin < 30
        # The get fails before the shutdown is over: the process must not
        # exit under it (a daemon thread inside C++ at finalization aborts).
        stopper.join(60)
        assert not stopper.is_alive()
    finally:
        troupe.shutdown()


def test_a_stale_actor_handle_is_refused_after_shutdown():
    # After troupe.shutdown() a handle's actor is gone with its cluster: a
    # call on it used to return an ObjectRef (of a call that could never
    # run, or, after a new init, of the new cluster's actor with that id)
    # and its repr still said ALIVE.
    troupe.init(num_cpus=2)
    try:
        old = Echo.remote()
        assert troupe.get(old.echo.remote(1), timeout=60) == 1
        assert "ALIVE" in repr(old)
        troupe.shutdown()
        stale = f"actor {old._actor.id} belongs to a troupe session that was shut down"
        assert "ALIVE" not in repr(old) and "session shut down" in repr(old), repr(old)
        with pytest.raises(TroupeError, match=f"echo.remote\\(\\): {stale}"):
            old.echo.remote(2)
        with pytest.raises(TroupeError, match=stale):
            troupe.kill(old)
        # In the next session the same id names another actor.
        troupe.init(num_cpus=2)
        new = Echo.remote()
        assert new._actor.id == old._actor.id
        with pytest.raises(TroupeError, match=stale):
            old.echo.remote(3)
        with pytest.raises(TroupeError, match=stale):
            troupe.put(old)
        assert troupe.get(new.echo.remote(4), timeout=60) == 4
        assert "session shut down" in repr(old) and "ALIVE" in repr(new)
        # This session's handle travels in values as before.
        assert troupe.get(troupe.get(troupe.put(new), timeout=60).echo.remote(5), timeout=60) == 5
    finally:
        troupe.shutdown()


class _WatchedLock:
    """troupe's shutdown lock, setting `arrived` when a caller is about to
    wait for it (a second shutdown(), or an init())."""

    def __init__(self, lock, arrived):
        self._lock = lock
        self._arrived = arrived

    def __enter__(self):
        self._arrived.set()
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)


def test_init_during_another_threads_shutdown_starts_once_the_old_cluster_is_stopped(monkeypatch):
    # troupe.init() on one thread while another is in troupe.shutdown(): the
    # new cluster used to start beside the one still stopping. The stop is
    # held here until init() has been called; the new client must come after.
    troupe.init(num_cpus=2)
    real = troupe._state.client
    entered, release, arrived = (threading.Event() for _ in range(3))
    order = []

    class HeldClient:
        def shutdown(self):
            entered.set()
            release.wait(120)
            real.shutdown()
            order.append("old stopped")

    client_class = troupe._core.Client

    def new_client(*args):
        order.append("new started")
        return client_class(*args)

    def start_again():
        try:
            troupe.init(num_cpus=2)
        finally:
            arrived.set()

    troupe._state.client = HeldClient()
    stopper = threading.Thread(target=troupe.shutdown, daemon=True)
    starter = threading.Thread(target=start_again, daemon=True)
    try:
        stopper.start()
        assert entered.wait(60), "shutdown() did not reach the client"
        monkeypatch.setattr(troupe, "_shutdown_lock", _WatchedLock(troupe._shutdown_lock, arrived))
        monkeypatch.setattr(troupe._core, "Client", new_client)
        starter.start()
        assert arrived.wait(60), "init() neither waited nor returned"
        release.set()
        stopper.join(120)
        starter.join(120)
        assert not stopper.is_alive() and not starter.is_alive()
        assert order == ["old stopped", "new started"], order
        assert troupe.is_initialized()
        assert troupe.cluster_resources().get("CPU") == 2
    finally:
        release.set()
        for thread in (stopper, starter):
            if thread.ident is not None:
                thread.join(120)
        monkeypatch.undo()
        real.shutdown()
        troupe.shutdown()


def test_a_second_shutdown_returns_once_the_cluster_is_stopped(monkeypatch):
    # Two threads call troupe.shutdown() at once. The second used to return
    # at once (it found nothing left to stop) while the first was still
    # stopping the cluster. The first one's stop is held here until the
    # second has called shutdown(); the second must return after the stop.
    troupe.init(num_cpus=2)
    real = troupe._state.client
    entered, release, stopped, arrived = (threading.Event() for _ in range(4))

    class HeldClient:
        def shutdown(self):
            entered.set()
            release.wait(120)
            real.shutdown()
            stopped.set()

    seen = {}

    def second():
        try:
            troupe.shutdown()
            seen["stopped"] = stopped.is_set()
        finally:
            arrived.set()

    troupe._state.client = HeldClient()
    first = threading.Thread(target=troupe.shutdown, daemon=True)
    late = threading.Thread(target=second, daemon=True)
    try:
        first.start()
        assert entered.wait(60), "the first shutdown() did not reach the client"
        monkeypatch.setattr(troupe, "_shutdown_lock", _WatchedLock(getattr(troupe, "_shutdown_lock", None), arrived),
                            raising=False)
        late.start()
        assert arrived.wait(60), "the second shutdown() neither waited nor returned"
        release.set()
        first.join(120)
        late.join(120)
        assert not first.is_alive() and not late.is_alive()
        assert seen == {"stopped": True}, "the second shutdown() returned before the cluster was stopped"
    finally:
        release.set()
        for thread in (first, late):
            if thread.ident is not None:
                thread.join(120)
        real.shutdown()
        troupe.shutdown()


DETACHED_DRIVER = """
import sys
import troupe

troupe.init(address=sys.argv[1])


@troupe.remote
class Keeper:
    def __init__(self):
        self.n = 0

    def add(self, k):
        self.n += k
        return self.n


keeper = Keeper.options(name="keeper", lifetime="detached").remote()
Keeper.options(name="owned").remote()
print(troupe.get(keeper.add.remote(1), timeout=60))
if len(sys.argv) > 2:  # a detached actor in a detached group of its own too
    from troupe.util import placement_group
    from troupe.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"CPU": 0.5}], name="kept-group", lifetime=sys.argv[2] or None)
    troupe.get(pg.ready(), timeout=60)
    inside = Keeper.options(name="in-group", lifetime="detached",
                            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote()
    print(troupe.get(inside.add.remote(5), timeout=60))
"""


def test_a_detached_actor_outlives_its_driver(head, tmp_path):
    env, address = head
    script = tmp_path / "driver.py"
    script.write_text(DETACHED_DRIVER)
    done = subprocess.run([sys.executable, str(script), address], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
    troupe.init(address=address)
    # The driver's own actor went with it; the detached one kept its state.
    wait_until(lambda: not _has_actor("owned"), what="the driver's actor to go")
    keeper = troupe.get_actor("keeper")
    assert troupe.get(keeper.add.remote(2), timeout=60) == 3
    troupe.kill(keeper)
    wait_until(lambda: not _has_actor("keeper"), what="the killed detached actor to go")


def test_a_detached_placement_group_outlives_its_driver(head, tmp_path):
    # lifetime="detached" was taken and ignored: the group was removed at
    # the driver's exit, killing the detached actor placed in it.
    env, address = head
    script = tmp_path / "driver.py"
    script.write_text(DETACHED_DRIVER)
    done = subprocess.run([sys.executable, str(script), address, "detached"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "5"]
    troupe.init(address=address)
    wait_until(lambda: not _has_actor("owned"), what="the driver's own actor to go")
    from troupe.util import get_placement_group, remove_placement_group

    pg = get_placement_group("kept-group")
    assert troupe.util.placement_group_table(pg)["state"] == "CREATED"
    inside = troupe.get_actor("in-group")
    assert troupe.get(inside.add.remote(1), timeout=60) == 6
    remove_placement_group(pg)  # it ends what is placed in it
    wait_until(lambda: not _has_actor("in-group"), what="the group's actor to go with it")
    troupe.kill(troupe.get_actor("keeper"))


def _has_actor(name):
    try:
        troupe.get_actor(name)
        return True
    except ValueError:
        return False


PACKAGE_DRIVER = """
import sys
import troupe

troupe.init(address=sys.argv[1], runtime_env={"working_dir": sys.argv[2]})


@troupe.remote
def answer():
    import gc_helper

    return gc_helper.ANSWER


@troupe.remote
class Keeper:
    def answer(self):
        import gc_helper

        return gc_helper.ANSWER


print(troupe.get(answer.remote(), timeout=60))
if sys.argv[3] == "detached":
    keeper = Keeper.options(name="pkg-keeper", lifetime="detached").remote()
    print(troupe.get(keeper.answer.remote(), timeout=60))
"""


def test_a_package_leaves_the_kv_store_with_its_last_holder(head, tmp_path):
    """A runtime_env package stays in the head's KV store while a process
    holds it: the driver that uploaded it, then a detached actor that runs
    with it; once the last is gone, so is the package (all its chunks)."""
    import hashlib

    from troupe import _packages

    env, address = head
    script = tmp_path / "driver.py"
    script.write_text(PACKAGE_DRIVER)

    def package_of(answer):
        project = tmp_path / f"project{answer}"
        project.mkdir()
        (project / "gc_helper.py").write_text(f"ANSWER = {answer}\n")
        return project, hashlib.sha256(_packages.pack(str(project), "working_dir")).hexdigest()

    def stored(package):
        client = troupe._client()
        return client.kv_get(_packages._KEY + package) is not None or \
            client.kv_get(f"{_packages._KEY}{package}.0") is not None

    def run(project, mode):
        done = subprocess.run([sys.executable, str(script), address, str(project), mode], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    plain, plain_id = package_of(1)
    kept, kept_id = package_of(2)
    assert run(plain, "plain") == ["1"]
    assert run(kept, "detached") == ["2", "2"]
    troupe.init(address=address)
    # The first driver was its package's only holder: gone with it (the
    # head erases what it held when its connection closes).
    wait_until(lambda: not stored(plain_id), what="the package of a driver that ended to go")
    # The detached actor holds the second one: there, and it still works
    # for the actor after its driver ended.
    assert stored(kept_id)
    keeper = troupe.get_actor("pkg-keeper")
    assert troupe.get(keeper.answer.remote(), timeout=60) == 2
    troupe.kill(keeper)
    wait_until(lambda: not stored(kept_id), what="the package of a killed detached actor to go")


def test_a_task_running_when_the_cluster_stops_fails_instead_of_waiting(head, tmp_path):
    """`troupe stop` while a task runs: its worker goes, the driver would
    run it again (a retry), and the new executor the head granted as it
    went can never start. The get fails with the head's end, not at its
    timeout (before: GetTimeoutError after the full wait, or never
    without one)."""
    env, address = head
    marker = tmp_path / "started"

    @troupe.remote
    def slow(path):
        open(path, "w").close()
        time.sleep(600)
        return 1

    troupe.init(address=address, log_to_driver=False)
    ref = slow.remote(str(marker))
    wait_until(marker.exists, what="the task to start")
    stop = subprocess.run([cli(), "stop"], env=env, capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0, stop.stderr
    with pytest.raises(TroupeError) as e:
        troupe.get(ref, timeout=120)
    assert not isinstance(e.value, troupe.exceptions.GetTimeoutError), e.value
    # Said as the head's end, not as executors that "died 3 times in a row
    # before starting" (the task had started).
    assert "head is gone" in str(e.value) and "before starting" not in str(e.value), e.value


def test_what_is_asked_of_a_head_that_stalls_past_the_call_timeout_is_made_once(head):
    """The head stopped (SIGSTOP, no supervisor) for longer than a head
    call's 30 s: a task that needed a new executor failed with
    GetTimeoutError, and so did a new named actor, yet the head made both
    when it woke (the executor held its CPU until the driver exited and
    later tasks of its kind hung; the actor took its name). Each request
    is now asked again, as the same request, and made once."""
    env, address = head
    troupe.init(address=address, log_to_driver=False)

    @troupe.remote(num_cpus=0.5)
    def double(x):
        return 2 * x

    @troupe.remote(num_cpus=0.5)
    class Once:
        def ping(self):
            return "pong"

    with open(os.path.join(env["TROUPE_SESSION_DIR"], "head.pid")) as f:
        head_pid = int(f.read().split()[0])
    # Each .remote() waits for the head (as Ray's waits for its GCS): made
    # in threads of their own while this one holds the stall.
    made = {}
    submitters = [threading.Thread(target=lambda: made.update(task=double.remote(21))),  # a new kind of task
                  threading.Thread(target=lambda: made.update(actor=Once.options(name="once").remote()))]
    os.kill(head_pid, signal.SIGSTOP)
    try:
        for t in submitters:
            t.start()
        time.sleep(35)  # the fault under test: a stall past the head calls' 30 s
    finally:
        os.kill(head_pid, signal.SIGCONT)
    for t in submitters:
        t.join(timeout=120)
    assert troupe.get(made["task"], timeout=120) == 42
    assert troupe.get(made["actor"].ping.remote(), timeout=60) == "pong"
    status = subprocess.run([cli(), "status", "--json", "--limit", "0"], env=env, capture_output=True, text=True,
                            timeout=60, check=True)
    actors = json.loads(status.stdout)["actors"]
    assert [a["class"] for a in actors].count("TaskExecutor") == 1, actors
    assert [a["name"] for a in actors].count("once") == 1, actors
    # Later tasks of the kind run (the CPU the first executor holds is its own).
    assert troupe.get([double.remote(i) for i in range(4)], timeout=120) == [0, 2, 4, 6]
