"""Fixtures of the Python shim's tests: real clusters on loopback.

`cluster` is an embedded local cluster (troupe.init()) shared by a test
module; tests that start their own (`troupe start --head`) use the launcher
binary named by TROUPE_CLI (set by CTest)."""
import contextlib
import os
import subprocess

import pytest

import troupe


@pytest.fixture(scope="module")
def cluster():
    troupe.init(num_cpus=2)
    yield
    troupe.shutdown()


def pytest_configure(config):
    # troupe.init() with no address joins the session's running cluster, as
    # Ray's: the tests' own session, never a cluster the developer runs.
    if "TROUPE_SESSION_DIR" not in os.environ:
        import atexit
        import shutil
        import tempfile

        os.environ["TROUPE_SESSION_DIR"] = tempfile.mkdtemp(prefix="troupe-tests-")
        atexit.register(shutil.rmtree, os.environ["TROUPE_SESSION_DIR"], True)


def wait_until(predicate, timeout=60.0, what="condition"):
    """Polls `predicate` (bounded), for state the runtime reports later."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout} s")


def when_blocked_in(function, action):
    """Runs `action` on a thread of its own once the main thread is inside
    `function` (a troupe call blocked in its native wait: this thread runs,
    so the main one let go of the GIL). Returns the thread: join it before
    the test ends if `action` may outlast it."""
    import sys
    import threading
    import time

    main = threading.main_thread().ident

    def run():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(main)
            if frame is not None and frame.f_code is function.__code__:
                return action()
            threading.Event().wait(0.01)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def session_env(tmp_path):
    """A fresh session directory and the environment that names it (no
    TROUPE_ADDRESS or TROUPE_TOKEN from outside)."""
    session = tmp_path / "session"
    session.mkdir(mode=0o700)
    env = dict(os.environ, TROUPE_SESSION_DIR=str(session))
    env.pop("TROUPE_ADDRESS", None)
    env.pop("TROUPE_TOKEN", None)
    return session, env


@contextlib.contextmanager
def in_session(session):
    """This process's os.environ names `session` (no TROUPE_TOKEN or
    TROUPE_ADDRESS) while the block runs; restored after it."""
    names = ("TROUPE_SESSION_DIR", "TROUPE_TOKEN", "TROUPE_ADDRESS")
    old = {k: os.environ.get(k) for k in names}
    os.environ["TROUPE_SESSION_DIR"] = str(session)
    os.environ.pop("TROUPE_TOKEN", None)
    os.environ.pop("TROUPE_ADDRESS", None)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cli():
    path = os.environ.get("TROUPE_CLI")
    if not path:
        pytest.skip("TROUPE_CLI (the troupe launcher binary) is not set")
    return path


def pytest_collection_finish(session):
    # Every test_*.py file given must contribute tests: a run that collects
    # none of a file's tests (an import that failed quietly, a renamed
    # function) fails instead of passing empty.
    given = [a for a in session.config.args if a.endswith(".py")]
    for path in given:
        name = os.path.basename(path)
        if not any(os.path.basename(str(item.fspath)) == name for item in session.items):
            pytest.exit(f"{name}: no tests collected", returncode=5)


@pytest.fixture()
def head(tmp_path):
    """A cluster started with `troupe start --head` (CPU=2) in a session of
    the test's own, named by os.environ while the test runs: yields its
    environment and address; stopped after. No test on it is about noticing
    a dead node: its node is given 2 s (20 heartbeats), not the default
    0.5 s, so that a machine loaded past its cores does not fail them."""
    launcher = cli()
    session, env = session_env(tmp_path)
    subprocess.run([launcher, "start", "--head", "--port", "0", "--resources", "CPU=2", "--heartbeat-misses", "20"],
                   env=env, check=True, timeout=120)
    with in_session(session):
        try:
            yield env, (session / "address").read_text().strip()
        finally:
            troupe.shutdown()
            subprocess.run([launcher, "stop"], env=env, timeout=120)
