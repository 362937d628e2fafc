"""Ray's init() options that troupe honours: object_store_memory (the
driver's object store limit, and an embedded cluster's workers') and
logging_level; bad values are named. A `troupe start` cluster's workers
take TROUPE_OBJECT_STORE_BYTES from its environment."""
import logging
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import troupe
from conftest import cli, in_session, session_env, wait_until
from troupe.exceptions import ConfigError, ObjectStoreFullError


@troupe.remote
def put_in_a_worker(n):
    """What a worker's store takes: the size put, or the error's text."""
    try:
        troupe.put(np.zeros(n, dtype=np.uint8))
        return "kept"
    except ObjectStoreFullError as e:
        return str(e)


@troupe.remote
def zeros_after(gate, n):
    """n zero bytes once the file `gate` exists (the test opens it)."""
    deadline = time.monotonic() + 60
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate} never appeared")
        time.sleep(0.01)
    return np.zeros(n, dtype=np.uint8)


def _fits(n):
    try:
        troupe.put(np.zeros(n, dtype=np.uint8))
        return True
    except ObjectStoreFullError:
        return False


@troupe.remote
def sizes_or_errors(refs):
    """Each ref's size in bytes, or the ObjectStoreFullError it raised."""
    out = []
    for r in refs:
        try:
            out.append(troupe.get(r, timeout=60).nbytes)
        except ObjectStoreFullError as e:
            out.append(str(e))
    return out


@pytest.fixture
def restore_env():
    saved = {k: os.environ.get(k) for k in ("TROUPE_OBJECT_STORE_BYTES", "TROUPE_LOG_LEVEL")}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_object_store_memory_limits_what_a_process_keeps(restore_env):
    troupe.init(num_cpus=1, object_store_memory=1 << 20, logging_level=logging.ERROR)
    try:
        assert os.environ["TROUPE_LOG_LEVEL"] == "error"
        with pytest.raises(ObjectStoreFullError, match="object store full"):  # Ray's class
            troupe.put(np.zeros(1 << 18))  # 2 MiB
        assert troupe.get(troupe.put(np.zeros(1 << 10)), timeout=60).shape == (1 << 10,)
        # The embedded cluster's workers have the same limit (they had a
        # quarter of the machine's memory whatever was asked).
        assert "limit 1048576 bytes" in troupe.get(put_in_a_worker.remote(2 << 20), timeout=60)
        assert troupe.get(put_in_a_worker.remote(1 << 10), timeout=60) == "kept"
    finally:
        troupe.shutdown()


def test_results_sent_on_before_they_arrive_stay_under_the_limit(tmp_path, restore_env):
    # Refs to calls not yet answered, put inside a list: the driver owns
    # them as pending objects, and their values, when they come, count
    # against its limit as a put would (they once went past it unchecked).
    troupe.init(num_cpus=1, object_store_memory=1 << 20, logging_level=logging.ERROR)
    try:
        gate = tmp_path / "open"
        refs = [zeros_after.remote(str(gate), 600 << 10) for _ in range(3)]
        held = troupe.put(refs)  # before any answer: the tasks wait for the gate
        gate.touch()
        got = troupe.get(sizes_or_errors.remote(held), timeout=120)
        assert sorted(g for g in got if isinstance(g, int)) == [600 << 10], got
        errors = [g for g in got if isinstance(g, str)]
        assert len(errors) == 2, got
        for e in errors:
            # The size is the pickled array's, a little over its 600 KiB.
            assert re.search(r"a call's result, .* of 6145\d\d bytes does not fit: .* limit 1048576 bytes", e), e
        # The caller's own answers are whole: nothing it asked for is lost.
        assert [a.nbytes for a in troupe.get(refs, timeout=60)] == [600 << 10] * 3
    finally:
        troupe.shutdown()


def test_a_result_in_hand_is_sent_on_inside_a_list_whatever_the_limit(tmp_path, restore_env):
    # Results the driver already holds, passed on inside a list: storing
    # one shares the answer's memory. The second raised ObjectStoreFullError
    # at .remote(), the first still counted while its ref lived.
    troupe.init(num_cpus=1, object_store_memory=1 << 20, logging_level=logging.ERROR)
    try:
        gate = tmp_path / "open"
        gate.touch()
        a, b = zeros_after.remote(str(gate), 600 << 10), zeros_after.remote(str(gate), 600 << 10)
        troupe.get([a, b], timeout=60)
        assert troupe.get(sizes_or_errors.remote([a]), timeout=60) == [600 << 10]
        assert troupe.get(sizes_or_errors.remote([b]), timeout=60) == [600 << 10]
        # A put of the driver's own still meets the limit, the results'
        # stored copies counted in what is held (300 KiB fits an empty store).
        with pytest.raises(ObjectStoreFullError, match="object store full"):
            troupe.put(np.zeros(300 << 10, dtype=np.uint8))
        del a, b
        wait_until(lambda: _fits(300 << 10), what="room once the results' refs are gone")
    finally:
        troupe.shutdown()


def test_a_started_clusters_workers_take_the_limit_from_its_environment(tmp_path, restore_env):
    session, env = session_env(tmp_path)
    env["TROUPE_OBJECT_STORE_BYTES"] = str(1 << 20)
    subprocess.run([cli(), "start", "--head", "--port", "0", "--resources", "CPU=1"], env=env, check=True,
                   timeout=120)
    try:
        with in_session(session):
            # The driver's own limit may be given with an address too.
            troupe.init(address="auto", object_store_memory=8 << 20)
            try:
                assert "limit 1048576 bytes" in troupe.get(put_in_a_worker.remote(2 << 20), timeout=60)
                troupe.put(np.zeros(4 << 20, dtype=np.uint8))  # the driver's is 8 MiB
            finally:
                troupe.shutdown()
    finally:
        subprocess.run([cli(), "stop"], env=env, timeout=120)


def test_remote_before_init_initializes_as_rays(tmp_path):
    # It was "troupe is not initialized: call troupe.init() first".
    driver = ("import troupe\n@troupe.remote\ndef f(x):\n    return x + 1\n"
              "print(troupe.get(f.remote(1), timeout=60), troupe.is_initialized())\n")
    session, env = session_env(tmp_path)
    r = subprocess.run([sys.executable, "-c", driver], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["2", "True"], r.stdout + r.stderr
    assert "troupe: .remote() before troupe.init(): calling troupe.init()" in r.stderr, r.stderr


def test_bad_init_options_are_named(restore_env):
    for bad in (-1, 0, 1.5, True, "1G"):
        with pytest.raises(ConfigError, match="object_store_memory"):
            troupe.init(object_store_memory=bad)
    with pytest.raises(ConfigError, match="logging_level"):
        troupe.init(logging_level="loud")
    with pytest.raises(ConfigError, match="num_cpus, num_gpus and resources describe an embedded cluster"):
        troupe.init("127.0.0.1:1", num_cpus=1)
    # A bad limit in the environment is said by init (it was said only at
    # the first put).
    os.environ["TROUPE_OBJECT_STORE_BYTES"] = "abc"
    with pytest.raises(ConfigError, match="TROUPE_OBJECT_STORE_BYTES"):
        troupe.init(num_cpus=1)
    del os.environ["TROUPE_OBJECT_STORE_BYTES"]
    assert not troupe.is_initialized()


def test_init_options_end_with_their_session(restore_env):
    """object_store_memory and logging_level were left in the environment:
    after shutdown() a plain init() kept the old limit (a put over it
    failed), and a failed init set them for every later one."""
    os.environ.pop("TROUPE_OBJECT_STORE_BYTES", None)
    os.environ["TROUPE_LOG_LEVEL"] = "error"
    troupe.init(num_cpus=1, object_store_memory=1 << 20, logging_level=logging.WARNING)
    try:
        assert os.environ["TROUPE_OBJECT_STORE_BYTES"] == str(1 << 20)
        assert os.environ["TROUPE_LOG_LEVEL"] == "warning"
    finally:
        troupe.shutdown()
    assert "TROUPE_OBJECT_STORE_BYTES" not in os.environ
    assert os.environ["TROUPE_LOG_LEVEL"] == "error"
    troupe.init(num_cpus=1)
    try:
        troupe.put(np.zeros(2 << 20, dtype=np.uint8))  # over the last session's limit
    finally:
        troupe.shutdown()
    with pytest.raises(troupe.exceptions.TroupeError):
        troupe.init(address="127.0.0.1:1", object_store_memory=1234567, _token="x")
    assert "TROUPE_OBJECT_STORE_BYTES" not in os.environ
    assert os.environ["TROUPE_LOG_LEVEL"] == "error"


def test_rays_other_init_options_are_taken_or_refused_by_name(restore_env):
    # Ray code passes these to init(); they were TypeErrors ("unexpected
    # keyword argument").
    with troupe.init(num_cpus=1, include_dashboard=False, configure_logging=False, logging_format="%(message)s",
                     _system_config={}) as ctx:
        assert ctx["webui_url"] is None
    for options, message in (({"include_dashboard": True}, "an embedded cluster serves no dashboard"),
                             ({"dashboard_port": 8265}, "an embedded cluster serves no dashboard"),
                             ({"dashboard_host": "0.0.0.0"}, "an embedded cluster serves no dashboard"),
                             ({"dashboard_port": 70000}, "dashboard_port must be a port number"),
                             ({"include_dashboard": "yes"}, "include_dashboard must be True, False or None"),
                             ({"local_mode": True}, "local_mode is not supported"),
                             ({"_system_config": {"object_spilling_threshold": 0.9}}, "_system_config")):
        with pytest.raises(ConfigError, match=message):
            troupe.init(num_cpus=1, **options)
        assert not troupe.is_initialized()


@troupe.remote(resources={"no_node_has_this": 1})
class Unplaceable:
    def ping(self):
        return "pong"


def test_a_new_sessions_unplaceable_actor_is_warned_about_again(monkeypatch, capsys):
    """The warning's "once per actor" outlived shutdown(): a new session's
    actor with the same id (each embedded cluster counts from 1) was never
    warned about."""
    monkeypatch.setenv("TROUPE_UNPLACEABLE_WARN_MS", "100")
    ids = []
    for _ in range(2):
        troupe.init(num_cpus=1)
        try:
            pending = Unplaceable.remote()
            with pytest.raises(troupe.exceptions.GetTimeoutError):
                troupe.get(pending.ping.remote(), timeout=1)
            ids.append(pending._actor_id.hex())
        finally:
            troupe.shutdown()
    said = capsys.readouterr().err
    assert ids[0] == ids[1], ids  # what made the second one look warned already
    assert said.count("troupe: (warning) a get waits for Unplaceable.ping") == 2, said

