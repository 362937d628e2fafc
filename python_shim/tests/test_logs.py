"""`troupe logs` reads a cluster's logs without ssh: the head's, a node
agent's, and an actor's own worker log (what the actor printed included),
relayed by the head from the node agent that has the file; -f follows what
is appended; a dead actor's log is its last worker's, and one whose
constructor threw shows the error it printed; unknown actors and nodes are
refused by name, with exit status 2."""
import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

import troupe
from conftest import cli, session_env, wait_until


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    session = tmp_path_factory.mktemp("session")
    env = dict(os.environ, TROUPE_SESSION_DIR=str(session), TROUPE_LOG_LEVEL="info")
    env.pop("TROUPE_TOKEN", None)
    env.pop("TROUPE_ADDRESS", None)
    # 2 s of silence before its node is dead, as conftest's cluster: on a
    # loaded 2-core machine the default 500 ms declared the agent dead
    # under a running test (its actor "died: no heartbeat for 500 ms").
    subprocess.run([cli(), "start", "--head", "--port", "0", "--resources", "CPU=2", "--dashboard-port", "-1",
                    "--heartbeat-misses", "20"], env=env, check=True, capture_output=True, timeout=120)
    old = os.environ.get("TROUPE_SESSION_DIR")
    os.environ["TROUPE_SESSION_DIR"] = str(session)
    troupe.init(address="auto")
    try:
        yield env
    finally:
        troupe.shutdown()
        subprocess.run([cli(), "stop"], env=env, capture_output=True, timeout=120)
        if old is None:
            os.environ.pop("TROUPE_SESSION_DIR", None)
        else:
            os.environ["TROUPE_SESSION_DIR"] = old


@troupe.remote
class Talker:
    def say(self, text):
        print(text, flush=True)
        return troupe.get_runtime_context().get_actor_id()


@troupe.remote
class Fragile:
    def __init__(self, fail):
        if fail:
            print("fragile: giving up in the constructor", flush=True)
            raise RuntimeError("constructor failed on purpose")

    def say(self, text):
        print(text, flush=True)
        return troupe.get_runtime_context().get_actor_id()


def logs(env, *args, timeout=60):
    return subprocess.run([cli(), "logs", *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_head_and_node_logs(cluster):
    head = logs(cluster, "head")
    assert head.returncode == 0 and "head listening on" in head.stdout, head.stderr
    node = logs(cluster, "node", "1")
    assert node.returncode == 0 and "node 1 serving" in node.stdout, node.stderr
    # A tail shorter than the last line shows that line's end (it showed
    # nothing).
    short = logs(cluster, "--tail", "5", "head")
    assert short.returncode == 0 and short.stdout.strip() and len(short.stdout) <= 5, (short.stdout, short.stderr)


def test_an_actors_own_log_has_what_it_printed(cluster):
    t = Talker.options(name="talker").remote()
    actor_id = troupe.get(t.say.remote("marker-one from the actor"), timeout=60)
    by_id = logs(cluster, str(actor_id))
    assert by_id.returncode == 0, by_id.stderr
    assert "marker-one from the actor" in by_id.stdout
    by_name = logs(cluster, "talker")
    assert "marker-one from the actor" in by_name.stdout, by_name.stderr
    # A name that reads as an id, or as the head, is an actor's with --name.
    for odd in ("7", "head"):
        o = Talker.options(name=odd).remote()
        troupe.get(o.say.remote(f"marker of the actor named {odd}"), timeout=60)
        r = logs(cluster, "--name", odd)
        assert r.returncode == 0 and f"marker of the actor named {odd}" in r.stdout, r.stderr
        troupe.kill(o)
    r = logs(cluster, "--name", "talker", "head")
    assert r.returncode == 2 and "not both" in r.stderr, r.stderr

    follow = subprocess.Popen([cli(), "logs", "-f", str(actor_id)], env=cluster, stdout=subprocess.PIPE, text=True)
    try:
        troupe.get(t.say.remote("marker-two, appended"), timeout=60)
        # A reader thread takes the follower's lines; the wait for the new
        # one is bounded, however little the follower prints.
        seen = []
        def read():
            for line in follow.stdout:
                seen.append(line)
        threading.Thread(target=read, daemon=True).start()
        wait_until(lambda: any("marker-two" in line for line in seen), timeout=60, what="the appended line")
        assert any("marker-two, appended" in line for line in seen), seen
    finally:
        follow.terminate()
        follow.wait(timeout=30)


def test_a_dead_actors_log_is_its_last_workers(cluster):
    # Killed on purpose: the log has what it printed before.
    t = Fragile.options(name="fragile-named").remote(False)
    actor_id = troupe.get(t.say.remote("marker-three before the kill"), timeout=60)
    troupe.kill(t)
    wait_until(lambda: "marker-three" in logs(cluster, str(actor_id)).stdout, timeout=60,
               what="the dead actor's log")
    # By its name too, which no live actor has any more.
    by_name = logs(cluster, "fragile-named")
    assert by_name.returncode == 0 and "marker-three before the kill" in by_name.stdout, by_name.stderr
    # Died in its constructor, never ready: the traceback is in the log.
    f = Fragile.remote(True)
    with pytest.raises(Exception):
        troupe.get(f.say.remote("never"), timeout=60)
    r = logs(cluster, str(f._actor.info()["id"]))
    assert r.returncode == 0, r.stderr
    assert "fragile: giving up in the constructor" in r.stdout, r.stdout


def test_unknown_targets_are_named(cluster):
    r = logs(cluster, "987654")
    assert r.returncode == 2 and "no actor with id 987654" in r.stderr, (r.returncode, r.stderr)
    r = logs(cluster, "node", "77")
    assert r.returncode == 2 and "node 77 is not alive" in r.stderr, (r.returncode, r.stderr)
    r = logs(cluster, "node", "x")
    assert r.returncode == 2 and "troupe logs: 'x' is not a node id" in r.stderr
    assert "troupe: troupe" not in r.stderr, r.stderr  # one prefix, not two
    r = logs(cluster, "node", "-1")  # was read as node 18446744073709551615
    assert r.returncode == 2 and "troupe logs: '-1' is not a node id" in r.stderr, r.stderr
    r = logs(cluster, "99999999999999999999")
    assert r.returncode == 2 and "is not an actor id" in r.stderr, r.stderr
    r = logs(cluster, "no-such-actor-name")
    assert r.returncode != 0 and "no-such-actor-name" in r.stderr


@troupe.remote
def shout(text):
    print(text)  # no flush: a worker's stdout goes out line by line
    return os.getpid()


def test_the_driver_shows_what_its_tasks_and_actors_print(cluster, capsys):
    # Ray's log_to_driver: on a `troupe start` cluster the workers write to
    # files of their own; the driver follows those of its own work.
    pid = troupe.get(shout.remote("marker-three from a task"), timeout=60)
    talker = Talker.remote()
    troupe.get(talker.say.remote("marker-four from an actor"), timeout=60)
    seen = []

    def shown():
        seen.append(capsys.readouterr().out)
        text = "".join(seen)
        return f"(task pid={pid}) marker-three from a task\n" in text and "marker-four from an actor\n" in text

    wait_until(shown, what="the workers' lines on the driver's console")
    text = "".join(seen)
    line = next(ln for ln in text.splitlines() if ln.endswith("marker-four from an actor"))
    assert line.startswith("(Talker pid="), line
    assert line.count("pid=") == 1, line  # marked by the driver, not again by the worker
    # Each line once, however often the files were looked at.
    assert text.count("marker-three from a task") == 1, text


def _print_rank(config):
    from troupe import train
    print(f"marker-rank {train.get_context().get_world_rank()}", flush=True)


def test_a_torch_trainers_ranks_are_marked_with_their_rank(cluster, capsys, tmp_path):
    # As an embedded cluster's workers mark their own lines: the driver
    # marks a rank's lines `(TrainWorker rank=N pid=P)`, not only its pid.
    from troupe.train import RunConfig, ScalingConfig
    from troupe.train.torch import TorchTrainer

    TorchTrainer(_print_rank, scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
                 run_config=RunConfig(name="ranks", storage_path=str(tmp_path))).fit()
    seen = []

    def shown():
        seen.append(capsys.readouterr().out)
        text = "".join(seen)
        return all(re.search(rf"^\(TrainWorker rank={r} pid=\d+\) marker-rank {r}$", text, re.M) for r in (0, 1))

    wait_until(shown, what="each rank's line marked with its rank")


def test_a_detached_actor_prints_to_the_driver_that_made_it(cluster, capsys):
    # It has no owner (it outlives this driver), but while this driver runs
    # its output is this driver's, as in Ray; it used to go nowhere.
    talker = Talker.options(name="detached-talker", lifetime="detached").remote()
    try:
        troupe.get(talker.say.remote("marker-four-b from a detached actor"), timeout=60)
        seen = []

        def shown():
            seen.append(capsys.readouterr().out)
            return "marker-four-b from a detached actor\n" in "".join(seen)

        wait_until(shown, what="the detached actor's line on the driver's console")
    finally:
        troupe.kill(talker)


@troupe.remote(max_restarts=1)
class Phoenix:
    def last_words(self, text):
        print(text)
        sys.stdout.flush()
        os._exit(1)

    def ping(self):
        return os.getpid()

    def say(self, text):
        print(text, flush=True)


def test_a_restarted_actors_last_words_reach_the_driver(cluster, capsys):
    # Its worker ends and another takes its place, between two looks or
    # not: what the first printed is read to its end first.
    phoenix = Phoenix.remote()
    first = troupe.get(phoenix.ping.remote(), timeout=60)
    with pytest.raises(Exception):
        troupe.get(phoenix.last_words.remote("marker-five, the last words"), timeout=60)
    wait_until(lambda: _alive_again(phoenix, first), what="the restarted actor")
    seen = []

    def shown():
        seen.append(capsys.readouterr().out)
        return f"(Phoenix pid={first}) marker-five, the last words\n" in "".join(seen)

    wait_until(shown, what="the first worker's last line on the driver's console")


def test_what_actors_that_never_lived_long_printed_reaches_the_driver(cluster, capsys):
    # Dead before any look saw them alive: a constructor that raised, a
    # task whose worker exited at once. Their files are read once, whole.
    f = Fragile.remote(True)
    with pytest.raises(Exception):
        troupe.get(f.say.remote("never"), timeout=60)

    @troupe.remote(max_retries=0)
    def print_and_exit():
        print("marker-seven, then gone")
        sys.stdout.flush()
        os._exit(7)

    with pytest.raises(Exception):
        troupe.get(print_and_exit.remote(), timeout=60)
    seen = []

    def shown():
        seen.append(capsys.readouterr().out)
        text = "".join(seen)
        return "fragile: giving up in the constructor\n" in text and "marker-seven, then gone\n" in text

    wait_until(shown, what="short-lived workers' lines on the driver's console")
    # Read once, not at every look.
    troupe.get(shout.remote("marker-eight, a later look"), timeout=60)
    wait_until(lambda: seen.append(capsys.readouterr().out) or "marker-eight" in "".join(seen), what="a later look")
    assert "".join(seen).count("marker-seven, then gone") == 1, seen


def test_following_an_actor_goes_on_across_its_restart(cluster):
    phoenix = Phoenix.options(name="phoenix-followed").remote()
    first = troupe.get(phoenix.ping.remote(), timeout=60)
    # Before any restart there is no previous worker, and it says so (it
    # said the live actor "has had no worker process yet").
    none = logs(cluster, "--previous", "phoenix-followed")
    assert none.returncode == 2 and "has no previous worker: it has not restarted" in none.stderr, none.stderr
    follow = subprocess.Popen([cli(), "logs", "-f", "phoenix-followed"], env=cluster, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        seen, said = [], []
        threading.Thread(target=lambda: seen.extend(follow.stdout), daemon=True).start()
        threading.Thread(target=lambda: said.extend(follow.stderr), daemon=True).start()
        # The follower is reading the first worker's file before it ends.
        troupe.get(phoenix.say.remote("marker-eight-b, the old worker alive"), timeout=60)
        try:
            wait_until(lambda: any("marker-eight-b" in line for line in seen), timeout=60,
                       what="the follower's first lines")
        except AssertionError as e:  # what the follower did instead, read when it failed
            raise AssertionError(f"{e}: it printed {seen!r}, said {said!r}, exit status {follow.poll()}") from None
        with pytest.raises(Exception):
            troupe.get(phoenix.last_words.remote("marker-nine, the old worker's last"), timeout=60)
        wait_until(lambda: _alive_again(phoenix, first), what="the restarted actor")
        try:
            wait_until(lambda: any("has a new worker" in line for line in said), timeout=60,
                       what="the follower's note")
        except AssertionError as e:
            raise AssertionError(f"{e}: it said {said!r}, exit status {follow.poll()}") from None
        wait_until(lambda: any("marker-nine" in line for line in seen), timeout=60, what="the old worker's last line")
    finally:
        follow.terminate()
        follow.wait(timeout=30)
    # The crashed worker's output after the restart: --previous.
    prev = logs(cluster, "--previous", "phoenix-followed")
    assert prev.returncode == 0 and "marker-nine, the old worker's last" in prev.stdout, (prev.stdout, prev.stderr)
    # Dead for good (its one restart used): its log is the last worker's,
    # --previous the one before (it read the last worker's again).
    with pytest.raises(Exception):
        troupe.get(phoenix.last_words.remote("marker-ten, the second worker's last"), timeout=60)
    wait_until(lambda: "marker-ten" in logs(cluster, "phoenix-followed").stdout, what="the dead actor's log")
    prev = logs(cluster, "--previous", "phoenix-followed")
    assert prev.returncode == 0, prev.stderr
    assert "marker-nine" in prev.stdout and "marker-ten" not in prev.stdout, prev.stdout
    bad = logs(cluster, "--previous", "head")
    assert bad.returncode == 2 and "--previous is for an actor's log" in bad.stderr, bad.stderr
    node = logs(cluster, "node")
    assert node.returncode == 2 and "troupe logs node N" in node.stderr, node.stderr


@troupe.remote(max_restarts=0)
class Mortal:
    def say(self, text):
        print(text, flush=True)

    def last_words(self, text):
        print(text, flush=True)
        os._exit(1)


def test_following_an_actor_that_dies_for_good_ends_saying_so(cluster):
    # It followed for ever, without a word, once the actor was dead.
    mortal = Mortal.options(name="mortal-followed").remote()
    troupe.get(mortal.say.remote("marker-ten, alive"), timeout=60)
    follow = subprocess.Popen([cli(), "logs", "-f", "mortal-followed"], env=cluster, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        with pytest.raises(Exception):
            troupe.get(mortal.last_words.remote("marker-eleven, the last words"), timeout=60)
        out, err = follow.communicate(timeout=120)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    assert follow.returncode == 0, (out, err)
    assert "marker-eleven, the last words" in out, (out, err)
    assert "is dead" in err and "no more output" in err, err


def test_a_name_in_a_namespace_is_found_without_it(tmp_path):
    # troupe logs NAME found no actor named in a namespace ("ns/NAME").
    session, env = session_env(tmp_path)
    subprocess.run([cli(), "start", "--head", "--port", "0", "--resources", "CPU=2"], env=env, check=True,
                   timeout=120)
    try:
        driver = tmp_path / "driver.py"
        driver.write_text(
            "import troupe, sys\n"
            "troupe.init(address='auto', namespace='probe')\n"
            "@troupe.remote\n"
            "class Talker:\n"
            "    def say(self, text):\n"
            "        print(text, flush=True)\n"
            "t = Talker.options(name='talker-ns', lifetime='detached').remote()\n"
            "troupe.get(t.say.remote('marker-twelve in a namespace'), timeout=60)\n")
        subprocess.run([sys.executable, str(driver)], env=env, check=True, timeout=120)
        for target in ("talker-ns", "probe/talker-ns"):
            wait_until(lambda: "marker-twelve" in logs(env, target).stdout, timeout=60, what=f"troupe logs {target}")
        # A dead holder of the name in another namespace leaves it found:
        # the live one is meant.
        other = (driver.read_text().replace("namespace='probe'", "namespace='other'")
                 .replace("marker-twelve in a namespace", "marker-thirteen, the dead one") + "troupe.kill(t)\n")
        (tmp_path / "other.py").write_text(other)
        subprocess.run([sys.executable, str(tmp_path / "other.py")], env=env, check=True, timeout=120)
        found = logs(env, "talker-ns")
        assert found.returncode == 0 and "marker-twelve" in found.stdout, (found.stdout, found.stderr)
        assert "marker-thirteen" not in found.stdout, found.stdout
        missing = logs(env, "nobody-ns")
        assert missing.returncode == 2, missing
    finally:
        subprocess.run([cli(), "stop"], env=env, timeout=120)


def _alive_again(actor, first):
    try:
        return troupe.get(actor.ping.remote(), timeout=60) != first
    except Exception:  # noqa: BLE001 - a call that met the restart
        return False


_EMBEDDED_DRIVER = """
import os, sys, troupe
troupe.init(num_cpus=2)

@troupe.remote
def shout(text):
    print(text)
    print(text + " on stderr", file=sys.stderr)
    return os.getpid()

@troupe.remote
class Talker:
    def say(self, text):
        print(text, end="")
        print(" (the rest of the line)")
        return os.getpid()

    def trail(self):
        print("marker-eight left open", end="")
        return os.getpid()

print("task-pid", troupe.get(shout.remote("marker-six from a task"), timeout=60))
talker = Talker.remote()
print("actor-pid", troupe.get(talker.say.remote("marker-seven from an actor"), timeout=60))
troupe.get(talker.trail.remote(), timeout=60)
print("the driver's own line")
troupe.shutdown()
"""


def test_on_an_embedded_cluster_workers_mark_their_own_lines(tmp_path):
    # The workers share the driver's stdout and stderr there: each marks
    # its lines as the driver marks them on a `troupe start` cluster.
    r = subprocess.run([sys.executable, "-c", _EMBEDDED_DRIVER], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TROUPE_SESSION_DIR=str(tmp_path)))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.splitlines()
    task_pid = next(ln.split()[1] for ln in out if ln.startswith("task-pid "))
    actor_pid = next(ln.split()[1] for ln in out if ln.startswith("actor-pid "))
    assert f"(task pid={task_pid}) marker-six from a task" in out, r.stdout
    assert f"(task pid={task_pid}) marker-six from a task on stderr" in r.stderr.splitlines(), r.stderr
    assert f"(Talker pid={actor_pid}) marker-seven from an actor (the rest of the line)" in out, r.stdout
    # A line a call left open goes out ended when the call ends: before,
    # it waited in the worker and ran into the next line.
    assert out.index(f"(Talker pid={actor_pid}) marker-eight left open") < out.index("the driver's own line"), r.stdout


_FULL_DISK_DRIVER = """
import sys, troupe
troupe.init(num_cpus=1)

@troupe.remote
class Chatty:
    def step(self, i):
        for _ in range(1000):
            print("a line of progress a full disk cannot take", i)
        print("and one left open", end="")
        return i

chatty = Chatty.remote()
sys.stderr.write("results %s\\n" % troupe.get([chatty.step.remote(i) for i in range(3)], timeout=60))
troupe.shutdown()
"""


def test_a_worker_whose_output_cannot_be_written_still_does_its_work(tmp_path):
    # /dev/full fails every write as a full file system does (ENOSPC): each
    # call that printed failed with OSError, though its work was done.
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-c", _FULL_DISK_DRIVER], stdout=full, stderr=subprocess.PIPE, text=True,
                           timeout=120, env=dict(os.environ, TROUPE_SESSION_DIR=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    assert "results [0, 1, 2]" in r.stderr, r.stderr


_CHURN = """
import troupe
troupe.init(address="auto")

@troupe.remote(num_cpus=0)
class Brief:
    def ping(self):
        return 1

for _ in range(20):
    a = Brief.remote()
    troupe.get(a.ping.remote(), timeout=60)
    troupe.kill(a)
troupe.shutdown()
"""


def test_a_daemons_log_rotates_and_its_supervised_head_writes_the_new_one(tmp_path):
    # TROUPE_LOG_MAX_BYTES bounds head.log: past it the file becomes
    # head.log.1 and the head goes on in a new head.log; a head its
    # supervisor starts again after a crash writes there too, not into
    # the rotated file the supervisor still held.
    env = dict(os.environ, TROUPE_SESSION_DIR=str(tmp_path), TROUPE_LOG_LEVEL="info", TROUPE_LOG_MAX_BYTES="4096")
    env.pop("TROUPE_TOKEN", None)
    env.pop("TROUPE_ADDRESS", None)
    subprocess.run([cli(), "start", "--head", "--supervise", "--port", "0", "--resources", "CPU=1",
                    "--dashboard-port", "-1"], env=env, check=True, capture_output=True, timeout=120)
    head_log, older = tmp_path / "head.log", tmp_path / "head.log.1"
    try:
        def busy_until_rotated():
            # Every actor that comes and goes leaves lines in head.log.
            subprocess.run([sys.executable, "-c", _CHURN], env=env, capture_output=True, timeout=120)
            return older.exists()
        wait_until(busy_until_rotated, timeout=240, what="head.log rotated")
        # The head's lines (a churn round may rotate more than once, so not
        # necessarily its first one).
        assert "[head pid " in older.read_text(errors="replace")
        wait_until(lambda: "its earlier part is now" in head_log.read_text(errors="replace"), timeout=60,
                   what="the rotation's own line in the new head.log")
        r = logs(env, "head")
        assert r.returncode == 0 and "its earlier part is now" in r.stdout, r.stderr

        # From head.log.1: the head may rotate again meanwhile, and a new
        # head.log is empty until its first line, while the rename that
        # makes head.log.1 replaces it whole.
        head_pid = int(next(ln.split("pid ")[1].split("]")[0] for ln in older.read_text(errors="replace").splitlines()
                            if "[head pid " in ln))
        os.kill(head_pid, 9)
        wait_until(lambda: head_log.read_text(errors="replace").count("head listening on") >= 1, timeout=120,
                   what="the restarted head's first line in head.log")
    finally:
        subprocess.run([cli(), "stop"], env=env, capture_output=True, timeout=120)


def test_a_workers_log_rotates_too_and_a_follower_loses_no_line(tmp_path):
    """A worker's worker-PID.log grew without bound (a chatty trainer could
    fill the session's disk): it keeps under TROUPE_LOG_MAX_BYTES as the
    daemons' logs do, its earlier part in worker-PID.log.1. `troupe logs
    -f` reads the rest of a file that rotated under it from PATH.1 (it lost
    the lines written just before each rotation)."""
    env = dict(os.environ, TROUPE_SESSION_DIR=str(tmp_path), TROUPE_LOG_MAX_BYTES="4096")
    env.pop("TROUPE_TOKEN", None)
    env.pop("TROUPE_ADDRESS", None)
    subprocess.run([cli(), "start", "--head", "--port", "0", "--resources", "CPU=1", "--dashboard-port", "-1"],
                   env=env, check=True, capture_output=True, timeout=120)
    try:
        out = subprocess.run([sys.executable, "-c", _CHATTY, str(tmp_path), cli()], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        pid = int(out.stdout.split("pid ")[1].split()[0])
        log, older = tmp_path / f"worker-{pid}.log", tmp_path / f"worker-{pid}.log.1"
        assert older.exists(), out.stdout
        # Rotated once a second: at most a second's lines past the bound.
        assert log.stat().st_size < 4096 + 200 * 400, log.stat().st_size
        assert "chatty line" in older.read_text(errors="replace")
        assert "missing [] twice 0" in out.stdout, out.stdout
    finally:
        subprocess.run([cli(), "stop"], env=env, capture_output=True, timeout=120)


_CHATTY = """
import os, subprocess, sys, threading, time, troupe
session, cli = sys.argv[1], sys.argv[2]
troupe.init(address="auto", log_to_driver=False)

@troupe.remote(num_cpus=1)
class Chatty:
    def talk(self, start, n, pause=0.0):
        for k in range(start, start + n):
            print(f"chatty line {k} " + "x" * 180, flush=True)
            time.sleep(pause)
        return os.getpid()

def until(done, seconds):
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)

c = Chatty.options(name="chatty").remote()
pid = troupe.get(c.talk.remote(0, 1), timeout=120)
follow = subprocess.Popen([cli, "logs", "-f", "chatty"], stdout=subprocess.PIPE, text=True)
seen = []
threading.Thread(target=lambda: seen.extend(follow.stdout), daemon=True).start()
until(lambda: any("chatty line 0 " in line for line in seen), 60)
# Lines without a break for 3 s, 40 KB a second: the worker rotates its
# file each second (it checks once a second), each time with lines the
# follower has not read yet.
troupe.get(c.talk.remote(1, 600, 0.005), timeout=120)
n = 601
until(lambda: any(f"chatty line {n - 1} " in line for line in seen), 60)
follow.terminate()
follow.wait(30)
got = [int(line.split()[2]) for line in seen if line.startswith("chatty line ")]
print("pid", pid, "missing", sorted(set(range(n)) - set(got)), "twice", len(got) - len(set(got)))
troupe.shutdown()
"""


_EMBEDDED_CHORUS = """
import troupe
troupe.init(num_cpus=3)

@troupe.remote(num_cpus=1)
class Singer:
    def sing(self, who, n):
        for k in range(n):
            print(f"T{who} line {k} " + "x" * 200)
        return n

singers = [Singer.remote() for _ in range(3)]
print("sung", sum(troupe.get([s.sing.remote(i, 400) for i, s in enumerate(singers)], timeout=120)))
troupe.shutdown()
"""


def test_on_an_embedded_cluster_workers_printing_at_once_keep_their_lines_whole(tmp_path):
    # print() writes a line's text and its end apart: between the two,
    # another worker on the same console wrote its own line into the
    # middle of this one (and a blank line followed).
    r = subprocess.run([sys.executable, "-c", _EMBEDDED_CHORUS], capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, TROUPE_SESSION_DIR=str(tmp_path)))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    whole = re.compile(r"^\(Singer pid=\d+\) T[012] line \d+ x{200}$")
    lines = [ln for ln in r.stdout.splitlines() if " line " in ln or not ln.strip()]
    broken = [ln[:120] for ln in lines if not whole.match(ln)]
    assert not broken, f"{len(broken)} broken of {len(lines)}: {broken[:5]}"
    assert len(lines) == 1200, len(lines)
    assert "sung 1200" in r.stdout


def test_runtime_lines_below_the_drivers_level_stay_in_the_workers_file(monkeypatch):
    # A worker's file holds its node's level: "[info] reconnected to the
    # head" reached a console that init() had set to warnings.
    from troupe._driver_logs import _below_driver_level, _driver_level

    info = "[12:34:56.789] [worker pid 4242] [info] reconnected to the head after 0.10 s"
    warning = "[12:34:56.789] [worker pid 4242] [warning] lost the head"
    monkeypatch.setenv("TROUPE_LOG_LEVEL", "warning")
    want = _driver_level()
    assert _below_driver_level(info, want)
    assert not _below_driver_level(warning, want)
    assert not _below_driver_level("[info] what the program printed itself", want)
    assert not _below_driver_level("step 3 loss 0.25", want)
    # An actor's worker names its actor: its lines were all kept.
    assert _below_driver_level("[12:34:56.789] [worker a5533 pid 4242] [info] reconnected to the head", want)
    monkeypatch.setenv("TROUPE_LOG_LEVEL", "info")
    assert not _below_driver_level(info, _driver_level())
    monkeypatch.setenv("TROUPE_LOG_LEVEL", "loud")  # not a level: nothing is left out
    assert not _below_driver_level(info, _driver_level())


def test_a_dead_actors_log_is_read_on_its_host_after_its_agent_was_killed(tmp_path):
    # The actor's node agent was SIGKILLed: `troupe logs ACTOR` said "node N
    # is not alive", with the log file still on that host, where another
    # agent of the session runs (the head's here; one started again there
    # in a multi-host cluster).
    session = tmp_path / "session"
    session.mkdir(mode=0o700)
    env = dict(os.environ, TROUPE_SESSION_DIR=str(session))
    env.pop("TROUPE_TOKEN", None)
    env.pop("TROUPE_ADDRESS", None)
    start = [cli(), "start", "--port", "0", "--dashboard-port", "-1"]
    subprocess.run(start + ["--head", "--resources", "CPU=1", "--heartbeat-misses", "20"], env=env, check=True,
                   capture_output=True, timeout=120)
    agent = [cli(), "start", "--address", "auto", "--resources", "CPU=1,spare=1"]
    try:
        subprocess.run(agent, env=env, check=True, capture_output=True, timeout=120)
        driver = (
            "import troupe, sys\n"
            "troupe.init(address='auto')\n"
            "@troupe.remote(resources={'spare': 1})\n"
            "class Talker:\n"
            "    def say(self, text):\n"
            "        print(text, flush=True)\n"
            "        return troupe.get_runtime_context().get_actor_id(), troupe.get_runtime_context().get_node_id()\n"
            "t = Talker.options(name='talker', lifetime='detached').remote()\n"
            "print('ids', *troupe.get(t.say.remote('marker-four on the spare node'), timeout=60))\n")
        r = subprocess.run([sys.executable, "-c", driver], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        actor_id, node_id = next(line.split()[1:] for line in r.stdout.splitlines() if line.startswith("ids "))
        wait_until(lambda: "marker-four" in logs(env, actor_id).stdout, what="the actor's log")
        status = json.loads(subprocess.run([cli(), "status", "--json"], env=env, capture_output=True, text=True,
                                           timeout=60, check=True).stdout)
        pid = next(n["pid"] for n in status["nodes"] if str(n["id"]) == node_id)
        os.kill(pid, signal.SIGKILL)

        def state():
            status = subprocess.run([cli(), "status", "--json"], env=env, capture_output=True, text=True, timeout=60)
            return next(a["state"] for a in json.loads(status.stdout)["actors"] if str(a["id"]) == actor_id)

        wait_until(lambda: state() == "DEAD", what="the actor to die with its node")
        # The head's own agent runs on that host, in that session: it reads
        # the file.
        r = logs(env, actor_id)
        assert r.returncode == 0 and "marker-four on the spare node" in r.stdout, r.stderr
    finally:
        subprocess.run([cli(), "stop"], env=env, capture_output=True, timeout=120)


def test_following_a_node_that_dies_ends_saying_so(tmp_path):
    # Each read of a dead node's log failed ("node N is not alive") and was
    # tried again every 300 ms, for ever.
    session = tmp_path / "session"
    session.mkdir(mode=0o700)
    env = dict(os.environ, TROUPE_SESSION_DIR=str(session), TROUPE_LOG_LEVEL="info")
    env.pop("TROUPE_TOKEN", None)
    env.pop("TROUPE_ADDRESS", None)
    start = [cli(), "start", "--port", "0", "--dashboard-port", "-1"]
    subprocess.run(start + ["--head", "--resources", "CPU=1", "--heartbeat-misses", "20"], env=env, check=True,
                   capture_output=True, timeout=120)
    follow = None
    try:
        subprocess.run([cli(), "start", "--address", "auto", "--resources", "CPU=1,spare=1"], env=env, check=True,
                       capture_output=True, timeout=120)
        status = json.loads(subprocess.run([cli(), "status", "--json"], env=env, capture_output=True, text=True,
                                           timeout=60, check=True).stdout)
        node = max(status["nodes"], key=lambda n: n["id"])
        out_path, err_path = tmp_path / "follow.out", tmp_path / "follow.err"
        with open(out_path, "w") as out, open(err_path, "w") as err:
            follow = subprocess.Popen([cli(), "logs", "-f", "node", str(node["id"])], env=env, stdout=out,
                                      stderr=err)
        # Following: its first read went well (one that fails ends it).
        wait_until(lambda: "serving" in out_path.read_text(), what="the follower's first lines")
        os.kill(node["pid"], signal.SIGKILL)
        follow.wait(timeout=120)
        err = err_path.read_text()
        assert follow.returncode == 1, err
        assert f"node {node['id']} is dead: no more output" in err, err
    finally:
        if follow is not None and follow.poll() is None:
            follow.kill()
            follow.wait()
        subprocess.run([cli(), "stop"], env=env, capture_output=True, timeout=120)
