"""runtime_env, as Ray's: env_vars given to init() (the job's), to a task
or an actor (merged over the job's), reach the worker's os.environ and are
inherited by the tasks it starts; any other runtime_env key, and bad
names or values, are refused by name."""
import os

import pytest

import troupe
from troupe.exceptions import ConfigError

NAMES = ["RENV_JOB", "RENV_OWN", "RENV_EMPTY", "RENV_CHILD"]


@troupe.remote
def read():
    return {name: os.environ.get(name) for name in NAMES}


@troupe.remote
def read_in_child(child_env):
    """What a task this task starts sees, with `child_env` its own."""
    options = {"runtime_env": {"env_vars": child_env}} if child_env else {}
    return troupe.get(read.options(**options).remote(), timeout=60)


@troupe.remote
class Reader:
    def read(self):
        return {name: os.environ.get(name) for name in NAMES}


@pytest.fixture
def job():
    troupe.init(num_cpus=2, runtime_env={"env_vars": {"RENV_JOB": "job"}})
    yield
    troupe.shutdown()


def expect(**values):
    return {name: values.get(name) for name in NAMES}


def test_env_vars_reach_tasks_actors_and_their_children(job):
    assert troupe.get(read.remote(), timeout=60) == expect(RENV_JOB="job")
    own = {"env_vars": {"RENV_OWN": "own", "RENV_EMPTY": "", "RENV_JOB": "overridden"}}
    assert troupe.get(read.options(runtime_env=own).remote(), timeout=60) == expect(
        RENV_JOB="overridden", RENV_OWN="own", RENV_EMPTY="")
    # The plain task again: its executor is not the one with RENV_OWN.
    assert troupe.get(read.remote(), timeout=60) == expect(RENV_JOB="job")
    reader = Reader.options(runtime_env={"env_vars": {"RENV_OWN": "actor"}}).remote()
    assert troupe.get(reader.read.remote(), timeout=60) == expect(RENV_JOB="job", RENV_OWN="actor")
    # A task's children inherit its env_vars, their own merged on top.
    parent = read_in_child.options(runtime_env={"env_vars": {"RENV_OWN": "parent"}})
    assert troupe.get(parent.remote(None), timeout=60) == expect(RENV_JOB="job", RENV_OWN="parent")
    assert troupe.get(parent.remote({"RENV_CHILD": "child"}), timeout=60) == expect(
        RENV_JOB="job", RENV_OWN="parent", RENV_CHILD="child")


def test_bad_runtime_envs_are_named(job):
    bad = [
        ({"pip": ["requests"]}, "runtime_env key 'pip' is not supported"),
        ({"working_dir": "."}, "runtime_env key 'working_dir' is not supported"),
        ({"env_vars": {"N": 1}}, r"env_vars\['N'\] must be a str"),
        ({"env_vars": {"A=B": "1"}}, "'A=B' is not an environment variable name"),
        ({"env_vars": {"TROUPE_TOKEN": "x"}}, "TROUPE_TOKEN is troupe's own variable"),
        ({"env_vars": ["A"]}, "env_vars must be a dict"),
        ("env_vars", "runtime_env must be a dict"),
    ]
    for runtime_env, message in bad:
        with pytest.raises(ConfigError, match=message):
            read.options(runtime_env=runtime_env).remote()
        with pytest.raises(ConfigError, match=message):
            Reader.options(runtime_env=runtime_env).remote()
    # Nothing was started for them: the job still runs.
    assert troupe.get(read.remote(), timeout=60) == expect(RENV_JOB="job")


def test_init_refuses_a_bad_runtime_env():
    with pytest.raises(ConfigError, match="troupe.init: runtime_env key 'conda' is not supported"):
        troupe.init(num_cpus=1, runtime_env={"conda": "env"})
    assert not troupe.is_initialized()
