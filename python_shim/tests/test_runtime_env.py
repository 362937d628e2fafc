"""runtime_env, as Ray's: env_vars given to init() (the job's), to a task
or an actor (merged over the job's), reach the worker's os.environ and are
inherited by the tasks it starts; working_dir and py_modules travel through
the cluster's KV store to the workers, which import from them (and run in
the working_dir); pip packages are installed on the node for the tasks
that name them; any other runtime_env key, and bad names or values, are
refused by name."""
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

import troupe
from troupe.runtime_env import RuntimeEnv
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


@troupe.remote
class GpuView:
    def visible(self):
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    def ids(self):
        return (os.environ.get("CUDA_VISIBLE_DEVICES"), troupe.get_gpu_ids(),
                troupe.get_runtime_context().get_accelerator_ids())


def test_an_actor_without_gpus_sees_none_whether_pooled_or_cold(job):
    """CUDA_VISIBLE_DEVICES is set empty for an actor that asked for no GPU
    (it hides every device), in a warm pooled worker and in a cold one
    alike (a variable the loader reads, LD_BIND_NOW, makes it cold): a cold
    worker's Python removed the empty value, and CUDA then showed it every
    GPU of the host."""
    pooled = GpuView.remote()
    cold = GpuView.options(runtime_env={"env_vars": {"LD_BIND_NOW": "1"}}).remote()
    assert troupe.get(pooled.visible.remote(), timeout=60) == ""
    assert troupe.get(cold.visible.remote(), timeout=60) == ""


def test_gpu_ids_name_the_node_agents_own_devices(monkeypatch):
    """A node agent started with CUDA_VISIBLE_DEVICES=5,7 offers those two:
    an actor of one GPU is given one of them, and get_gpu_ids names the
    device its CUDA_VISIBLE_DEVICES holds (as Ray's), not the node's number
    (0 or 1, the host's first GPUs)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    troupe.init(num_cpus=2, num_gpus=2)
    try:
        views = [GpuView.options(num_gpus=1).remote() for _ in range(2)]
        seen = troupe.get([v.ids.remote() for v in views], timeout=60)
    finally:
        troupe.shutdown()
    assert sorted(visible for visible, _, _ in seen) == ["5", "7"], seen
    for visible, ids, accelerators in seen:
        assert ids == [int(visible)] and accelerators == {"GPU": [visible]}, seen


def test_rays_runtime_env_class_is_taken_where_a_dict_is(job):
    # Code written for Ray builds its env with ray.runtime_env.RuntimeEnv.
    from troupe.runtime_env import RuntimeEnv

    env = RuntimeEnv(env_vars={"RENV_OWN": "class"})
    assert env == {"env_vars": {"RENV_OWN": "class"}} and env.env_vars() == {"RENV_OWN": "class"}
    assert env.to_dict() == {"env_vars": {"RENV_OWN": "class"}} and not env.has_working_dir()
    assert troupe.get(read.options(runtime_env=env).remote(), timeout=60) == expect(RENV_JOB="job", RENV_OWN="class")
    # It pickles as itself (it travels to tasks that start tasks).
    again = pickle.loads(pickle.dumps(env))
    assert type(again) is RuntimeEnv and again == env
    assert RuntimeEnv.from_dict(env.to_dict()) == env and type(RuntimeEnv.from_dict({})) is RuntimeEnv
    with pytest.raises(TypeError, match="takes a dict"):
        RuntimeEnv.from_dict([("env_vars", {})])
    with pytest.raises(ConfigError, match="runtime_env key 'conda' is not supported"):
        read.options(runtime_env=RuntimeEnv(conda="myenv")).remote()


def test_bad_runtime_envs_are_named(job):
    bad = [
        ({"conda": "env"}, "runtime_env key 'conda' is not supported"),
        ({"pip": "/nonexistent/requirements.txt"}, "is read as a requirements file, and it cannot be read"),
        ({"pip": [1]}, "each requirement must be a non-empty str, got 1"),
        ({"pip": ["a\nb"]}, "spans lines"),
        ({"pip": {"packages": ["x"], "index": "y"}}, "runtime_env pip key 'index' is not known"),
        ({"pip": {"packages": ["x"], "pip_version": "==22.0"}}, "pip_version '==22.0' is not supported"),
        ({"pip": {"packages": ["x"], "pip_check": "yes"}}, "pip_check must be True or False"),
        ({"pip": {"packages": ["x"], "pip_install_options": "--no-index"}}, "pip_install_options must be a list"),
        ({"pip": {"pip_check": False}}, "needs 'packages'"),
        ({"pip": 5}, "pip must be a list of requirements"),
        ({"working_dir": "/nonexistent/renv"}, "working_dir '/nonexistent/renv' is not a directory"),
        ({"working_dir": "s3://bucket/code.zip"}, "working_dir 's3://bucket/code.zip' is a URI"),
        ({"py_modules": "mod"}, "py_modules must be a list of paths or modules, got a str"),
        ({"py_modules": ["/nonexistent/mod"]}, "'/nonexistent/mod' is not a directory or a .py file"),
        ({"excludes": "*.bin"}, "excludes must be a list of patterns"),
        ({"excludes": ["*.bin"]}, "excludes applies to the working_dir and py_modules of the same runtime_env"),
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


@troupe.remote
def environ_of(names):
    """`names` as the task sees them: in os.environ, in the worker's
    environment as it was exec'd, and in a process the task starts (env,
    found on its PATH); and the task's sys.path."""
    def parse(text):
        pairs = dict(e.split(b"=", 1) for e in text.split(b"\0") if b"=" in e)
        return {n: pairs[n.encode()].decode() if n.encode() in pairs else None for n in names}

    with open("/proc/self/environ", "rb") as f:
        at_exec = parse(f.read())
    started = parse(subprocess.run(["env", "-0"], capture_output=True, timeout=60, check=True).stdout)
    return {n: os.environ.get(n) for n in names}, at_exec, started, sys.path


@troupe.remote
def environ_in_child(names, child_env):
    """What a task this task starts sees of `names` (os.environ), with
    `child_env` its own env_vars."""
    options = {"runtime_env": {"env_vars": child_env}} if child_env else {}
    return troupe.get(environ_of.options(**options).remote(names), timeout=60)[0]


@troupe.remote
class EnvironReader:
    def read(self, names):
        return {n: os.environ.get(n) for n in names}


def test_env_vars_too_big_for_one_environment_string_together_reach_the_worker(job):
    """Eight values of 20 KB: each its own environment string, under the
    kernel's 128 KiB for one, and none copied into another (all of them in
    one would pass it, and the worker's exec fail). OMP_NUM_THREADS makes
    the node agent exec a worker for them (a pooled one is handed its
    environment once it runs)."""
    big = {f"RENV_BIG{i}": chr(ord("a") + i) * 20000 for i in range(8)}
    env = {"env_vars": {**big, "OMP_NUM_THREADS": "1"}}
    names = [*big, "RENV_JOB"]
    seen, at_exec, started, _ = troupe.get(environ_of.options(runtime_env=env).remote(names), timeout=60)
    expected = {**big, "RENV_JOB": "job"}
    assert seen == expected and at_exec == expected and started == expected
    reader = EnvironReader.options(runtime_env=env).remote()
    assert troupe.get(reader.read.remote(names), timeout=60) == expected
    # The tasks a task starts inherit them.
    assert troupe.get(environ_in_child.options(runtime_env=env).remote(names, None), timeout=60) == expected


def test_env_vars_that_cannot_fit_a_workers_environment_are_refused_naming_them():
    try:
        with pytest.raises(ConfigError, match=r"troupe.init: runtime_env env_vars\['RENV_HUGE'\] takes 140011 "
                                              r"bytes .*at most 131072 \(128 KiB\) for one"):
            troupe.init(num_cpus=1, runtime_env={"env_vars": {"RENV_HUGE": "x" * 140000}})
    finally:
        troupe.shutdown()  # one let through is not left to the next tests
    large = {f"RENV_LARGE{i}": "x" * 100000 for i in range(6)}  # 586 KiB
    troupe.init(num_cpus=1, runtime_env={"env_vars": large})
    try:
        bad = [
            ({"RENV_HUGE": "x" * 140000}, r"env_vars\['RENV_HUGE'\] takes 140011 bytes"),
            # A reference travels under a longer name, which counts.
            ({"RENV_REF": "$" + "x" * 131050},
             r"env_vars\['RENV_REF'\] takes 131081 bytes as an environment string \(TROUPE_ENV_TEMPLATE_RENV_REF="),
            ({f"RENV_MORE{i}": "x" * 100000 for i in range(6)},
             r"\(with the env_vars it inherits\): runtime_env env_vars take 1\.1 MiB in all, over the 1\.0 MiB "
             r"a worker's environment may hold of them .* the largest: RENV_LARGE0 \(98 KiB\), RENV_LARGE1"),
            ({f"V{i}": "" for i in range(30000)}, r"the names of its 30000 variables take 194 KiB together"),
        ]
        for env_vars, message in bad:
            with pytest.raises(ConfigError, match=message):
                environ_of.options(runtime_env={"env_vars": env_vars}).remote(["RENV_LARGE0"])
            with pytest.raises(ConfigError, match=message):
                EnvironReader.options(runtime_env={"env_vars": env_vars}).remote()
        # Nothing was started for them: the job's still reach its tasks.
        seen = troupe.get(environ_of.remote(["RENV_LARGE5"]), timeout=60)[0]
        assert seen == {"RENV_LARGE5": large["RENV_LARGE5"]}
    finally:
        troupe.shutdown()


def test_env_var_references_expand_against_the_workers_environment(job):
    """As Ray's: ${NAME} and $NAME take NAME's value in the environment
    the worker has (the node's, this runtime_env's other variables in it),
    in name order; an unset ${NAME} in capitals becomes empty, any other
    unset reference stays as written. The tasks a task starts inherit the
    reference, not its value, and expand it again."""
    node_path = os.environ["PATH"]
    env_vars = {
        "PATH": "/opt/renv/bin:${PATH}",
        "RENV_OWN": "${RENV_JOB}-$RENV_A-${RENV_B}",
        "RENV_A": "a",
        "RENV_B": "${RENV_A}b",
        "RENV_UNSET": "${RENV_NOT_SET}|$RENV_NOT_SET|${renv_not_set}|$$|${}|$",
    }
    expected = {"PATH": "/opt/renv/bin:" + node_path, "RENV_OWN": "job-a-ab", "RENV_A": "a", "RENV_B": "ab",
                "RENV_UNSET": "|$RENV_NOT_SET|${renv_not_set}|$$|${}|$", "RENV_JOB": "job"}
    names = list(expected)
    seen, _, started, _ = troupe.get(environ_of.options(runtime_env={"env_vars": env_vars}).remote(names),
                                     timeout=60)
    assert seen == expected and started == expected
    reader = EnvironReader.options(runtime_env={"env_vars": env_vars}).remote()
    assert troupe.get(reader.read.remote(names), timeout=60) == expected
    parent = environ_in_child.options(runtime_env={"env_vars": env_vars})
    assert troupe.get(parent.remote(names, None), timeout=60) == expected
    assert troupe.get(parent.remote(names, {"RENV_A": "child"}), timeout=60) == {
        **expected, "RENV_A": "child", "RENV_B": "childb", "RENV_OWN": "job-child-childb"}


def test_env_var_references_read_at_exec_are_there_at_exec(job):
    """LD_LIBRARY_PATH and PYTHONPATH are read as a process starts (by the
    loader, by the interpreter): expanded, they are in the worker's
    environment from its exec, and the interpreter's sys.path has the
    PYTHONPATH entry."""
    env_vars = {"LD_LIBRARY_PATH": "/opt/renv/lib:${LD_LIBRARY_PATH}", "PYTHONPATH": "/opt/renv/py:${PYTHONPATH}"}
    names = list(env_vars)
    seen, at_exec, started, path = troupe.get(environ_of.options(runtime_env={"env_vars": env_vars}).remote(names),
                                              timeout=60)
    assert seen["LD_LIBRARY_PATH"] == "/opt/renv/lib:" + os.environ.get("LD_LIBRARY_PATH", "")
    # The worker's own PYTHONPATH has troupe's package in it (its launcher's).
    assert seen["PYTHONPATH"].startswith("/opt/renv/py:") and "$" not in seen["PYTHONPATH"]
    assert at_exec == seen and started == seen
    assert "/opt/renv/py" in path


def test_a_pythonpath_that_does_not_reference_itself_keeps_troupe_importable(job):
    """A PYTHONPATH of the user's that references other variables but not
    itself (expanded, then the worker execs itself with it) replaces what
    the worker's launcher put there: troupe's package directory goes on
    it first, else the exec'd worker cannot import troupe.worker."""
    env_vars = {"RENV_DIR": "/opt/renv/dir", "PYTHONPATH": "${RENV_DIR}/py"}
    seen, at_exec, _, path = troupe.get(environ_of.options(runtime_env={"env_vars": env_vars}).remote(["PYTHONPATH"]),
                                        timeout=60)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(troupe.__file__)))
    assert seen["PYTHONPATH"].split(os.pathsep) == [package_parent, "/opt/renv/dir/py"], seen
    assert at_exec == seen
    assert "/opt/renv/dir/py" in path


def _tree(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _packed(path, kind="working_dir", excludes=()):
    from troupe import _packages

    with zipfile.ZipFile(io.BytesIO(_packages.pack(str(path), kind, excludes))) as z:
        return sorted(z.namelist())


def test_excludes_are_read_as_ignore_file_lines_as_ray_reads_them(tmp_path):
    # Matched with fnmatch on every part of the path, "/data" (anchored to
    # the top, as Ray's docs advise) left out pkg/data as well, "**/x"
    # missed x at the top, and "src/*.py" reached into src's subfolders.
    project = _tree(tmp_path / "p", {"data/a": "", "pkg/data/b": "", "node_modules/m.js": "", "x.ckpt": "",
                                     "src/a.py": "", "src/sub/b.py": "", "build": "", "out/build/c": "",
                                     "logs/keep.log": "", "logs/drop.log": ""})
    assert _packed(project, excludes=["/data"]) == sorted(
        ["pkg/data/b", "node_modules/m.js", "x.ckpt", "src/a.py", "src/sub/b.py", "build", "out/build/c",
         "logs/keep.log", "logs/drop.log"])
    kept = _packed(project, excludes=["**/node_modules", "**/*.ckpt", "src/*.py", "build/", "*.log", "!keep.log"])
    assert kept == sorted(["data/a", "pkg/data/b", "src/sub/b.py", "build", "logs/keep.log"]), kept


# A project whose .gitignore files use gitignore's syntax: what git itself
# leaves untracked of it (git ls-files --others --exclude-standard) is
# KEPT, and .rayignore leaves out weights.bin besides.
_IGNORING = {
    ".gitignore": "\n".join([
        "# a comment, then a blank line", "",
        "*.log", "!keep.log",  # any depth; negated
        "build/",  # directories alone
        "/out",  # at the top alone
        "docs/**/draft.md",  # none or any directories between
        "secret?.txt", "*.py[co]",
        "\\#notes",  # a leading # quoted
        "trailing.txt   ",  # trailing spaces dropped
        "cache/*", "!cache/wanted",
        "logs", "!logs/important.txt",  # nothing under a directory left out comes back
        "[z-a]",  # a reversed range: git's matches nothing (and packing goes on)
    ]) + "\n",
    "sub/.gitignore": "*.txt\n!important.txt\n/local.md\n",  # relative to sub/
    ".rayignore": "*.bin\n",
    "app.py": "", "app.pyc": "", "app.pyo": "", "app.pyd": "", "weights.bin": "",
    "run.log": "", "keep.log": "", "sub/deep/run.log": "", "sub/keep.log": "",
    "build/a.o": "", "sub/build/b.o": "", "lib/build": "",
    "out/x": "", "sub/out/y": "",
    "docs/draft.md": "", "docs/a/b/draft.md": "", "docs/final.md": "", "other/docs/draft.md": "",
    "secret1.txt": "", "secret12.txt": "", "#notes": "", "notes": "", "trailing.txt": "",
    "cache/junk": "", "cache/wanted": "", "logs/important.txt": "",
    "sub/notes.txt": "", "sub/important.txt": "", "sub/local.md": "", "sub/deep/local.md": "", "sub/deep/x.txt": "",
}
_KEPT = [".gitignore", ".rayignore", "app.py", "app.pyd", "cache/wanted", "docs/final.md", "keep.log", "lib/build",
         "notes", "other/docs/draft.md", "secret12.txt", "sub/.gitignore", "sub/deep/local.md", "sub/important.txt",
         "sub/keep.log", "sub/out/y"]


def test_packing_leaves_out_what_gitignore_and_rayignore_files_say(tmp_path, monkeypatch):
    """As Ray's: the .gitignore and .rayignore of each directory packed,
    their patterns relative to it; not those above the packed directory
    (a py_module's). TROUPE_RUNTIME_ENV_IGNORE_GITIGNORE=1 (or Ray's
    RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1) leaves the .gitignore files out of
    it, not the .rayignore ones."""
    for name in ("TROUPE_RUNTIME_ENV_IGNORE_GITIGNORE", "RAY_RUNTIME_ENV_IGNORE_GITIGNORE"):
        monkeypatch.delenv(name, raising=False)
    root = _tree(tmp_path / "project", _IGNORING)
    assert _packed(root) == _KEPT
    assert _packed(root / "sub", "py_modules") == [
        "sub/.gitignore", "sub/build/b.o", "sub/deep/local.md", "sub/deep/run.log", "sub/important.txt",
        "sub/keep.log", "sub/out/y"]
    everything = sorted(name for name in _IGNORING if name != "weights.bin")
    for name in ("TROUPE_RUNTIME_ENV_IGNORE_GITIGNORE", "RAY_RUNTIME_ENV_IGNORE_GITIGNORE"):
        with monkeypatch.context() as m:
            m.setenv(name, "1")
            assert _packed(root) == everything


def _project(root):
    """A small project as a user would point working_dir at: a module, a
    data file read by relative path, a file to exclude, a cache."""
    root.mkdir()
    (root / "renv_helper.py").write_text("def answer():\n    return 42\n")
    (root / "renv_tasks.py").write_text(
        "import renv_helper\n\n\ndef answer_plus(x):\n    return renv_helper.answer() + x\n")
    (root / "data.txt").write_text("from the working_dir")
    (root / "weights.bin").write_bytes(b"\0" * 1024)
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "junk.pyc").write_bytes(b"junk")
    (root / ".gitignore").write_text("*.log\n")
    (root / "run.log").write_text("left out by the .gitignore")
    return root


@troupe.remote
def look_around():
    import renv_helper

    with open("data.txt") as f:
        data = f.read()
    return {"answer": renv_helper.answer(), "data": data, "cwd": os.getcwd(),
            "bin": os.path.exists("weights.bin"), "cache": os.path.exists("__pycache__"),
            "log": os.path.exists("run.log")}


@troupe.remote
def look_in_child():
    """What a task this task starts sees (it inherits the working_dir)."""
    return troupe.get(look_around.remote(), timeout=60)


@troupe.remote
class Looker:
    def look(self):
        import renv_helper

        return renv_helper.answer()


@troupe.remote
def import_modules():
    import renv_pkg
    import renv_single

    return renv_pkg.NAME, renv_single.NAME


def test_working_dir_reaches_tasks_actors_and_their_children(tmp_path):
    project = _project(tmp_path / "project")
    troupe.init(num_cpus=2)
    try:
        env = {"working_dir": str(project), "excludes": ["*.bin"]}
        seen = troupe.get(look_around.options(runtime_env=env).remote(), timeout=60)
        assert seen["answer"] == 42 and seen["data"] == "from the working_dir"
        # A copy of the project, unpacked on this machine: not the project.
        assert seen["cwd"] != str(project) and "runtime_env" in seen["cwd"]
        assert not seen["bin"] and not seen["cache"] and not seen["log"]
        assert troupe.get(look_in_child.options(runtime_env=env).remote(), timeout=60)["answer"] == 42
        looker = Looker.options(runtime_env=env).remote()
        assert troupe.get(looker.look.remote(), timeout=60) == 42
        # A task without it runs elsewhere and cannot import the helper.
        with pytest.raises(troupe.exceptions.TaskError, match="renv_helper"):
            troupe.get(look_around.remote(), timeout=60)
    finally:
        troupe.shutdown()


def test_a_function_of_a_working_dir_module_is_found_by_reference(tmp_path):
    """The driver imports the task's module from the project; cloudpickle
    sends the function by module and name, and the worker imports it from
    its copy of the working_dir (the job's, given to init)."""
    project = _project(tmp_path / "project")
    sys.path.insert(0, str(project))
    try:
        import renv_tasks

        troupe.init(num_cpus=2, runtime_env={"working_dir": str(project)})
        task = troupe.remote(renv_tasks.answer_plus)
        assert troupe.get(task.remote(1), timeout=60) == 43
    finally:
        troupe.shutdown()
        sys.path.remove(str(project))
        sys.modules.pop("renv_tasks", None)
        sys.modules.pop("renv_helper", None)


def test_a_new_session_gets_the_working_dir_as_it_is_then(tmp_path):
    """Packed once per process for a cluster: the next troupe.init (a new
    cluster) stores the package again, with the edits made since."""
    project = _project(tmp_path / "project")
    for answer in (42, 7):
        (project / "renv_helper.py").write_text(f"def answer():\n    return {answer}\n")
        troupe.init(num_cpus=1)
        try:
            env = {"working_dir": str(project)}
            assert troupe.get(look_around.options(runtime_env=env).remote(), timeout=60)["answer"] == answer
        finally:
            troupe.shutdown()


def test_an_unpack_left_half_done_is_swept_by_the_next(tmp_path):
    """A worker killed while it unpacked leaves its staging directory; the
    next unpack on the machine removes one over an hour old, and keeps a
    fresh one (another worker's, under way)."""
    from troupe import _packages

    root = _packages._cache_root()
    stale, fresh = os.path.join(root, ".stale-sweep-test"), os.path.join(root, ".fresh-sweep-test")
    for d in (stale, fresh):
        os.makedirs(os.path.join(d, "half"), exist_ok=True)
    os.utime(stale, (0, 0))
    (tmp_path / "renv_sweep.py").write_text(f"TAG = {str(tmp_path)!r}\n")  # a package no earlier run unpacked
    troupe.init(num_cpus=1)
    try:
        env = {"py_modules": [str(tmp_path / "renv_sweep.py")]}
        assert troupe.get(import_sweep.options(runtime_env=env).remote(), timeout=60) == str(tmp_path)
        assert os.path.isdir(fresh)
    finally:
        troupe.shutdown()
        shutil.rmtree(fresh, ignore_errors=True)
    assert not os.path.exists(stale)


@troupe.remote
def import_sweep():
    import renv_sweep

    return renv_sweep.TAG


def test_py_modules_a_package_and_a_single_file(tmp_path):
    (tmp_path / "renv_pkg").mkdir()
    (tmp_path / "renv_pkg" / "__init__.py").write_text("NAME = 'package'\n")
    (tmp_path / "renv_single.py").write_text("NAME = 'single'\n")
    troupe.init(num_cpus=2)
    try:
        env = {"py_modules": [str(tmp_path / "renv_pkg"), str(tmp_path / "renv_single.py")]}
        assert troupe.get(import_modules.options(runtime_env=env).remote(), timeout=60) == ("package", "single")
    finally:
        troupe.shutdown()


def test_a_package_over_the_limit_is_refused_naming_its_size(tmp_path, monkeypatch):
    from troupe import _packages

    project = _project(tmp_path / "project")
    (project / "big.dat").write_bytes(os.urandom(64 << 10))
    monkeypatch.setattr(_packages, "MAX_PACKAGE_BYTES", 32 << 10)
    with pytest.raises(ConfigError, match=r"working_dir .*project' packs to \d+ KiB, over the 32 KiB"):
        troupe.init(num_cpus=1, runtime_env={"working_dir": str(project)})
    assert not troupe.is_initialized()


@troupe.remote
class Holder:
    """An actor that runs with a package, and so holds it."""

    def where(self):
        import renv_evict_a

        return renv_evict_a.__file__


@troupe.remote
def module_file(name):
    import importlib

    return importlib.import_module(name).__file__


def _free(lock_path):
    """Whether no process holds the package whose lock file this is."""
    import fcntl

    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_unpacked_packages_past_the_cache_size_are_evicted_unless_in_use(tmp_path, monkeypatch):
    """With a cache of about a byte, every unpack removes each unpacked
    package no process holds: not the one a live actor runs with, which
    goes once the actor is gone. The cluster's processes have a TMPDIR of
    their own, so the cache they evict from is this test's alone, not the
    user's."""
    from conftest import wait_until

    monkeypatch.setenv("TROUPE_RUNTIME_ENV_CACHE_GB", "1e-9")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    for tag in "abc":
        (tmp_path / f"renv_evict_{tag}.py").write_text(f"TAG = {str(tmp_path)!r}\n")

    def env(tag):
        return {"py_modules": [str(tmp_path / f"renv_evict_{tag}.py")]}

    troupe.init(num_cpus=3)
    try:
        holder = Holder.options(runtime_env=env("a")).remote()
        a_dir = os.path.dirname(troupe.get(holder.where.remote(), timeout=60))
        b_file = troupe.get(module_file.options(runtime_env=env("b")).remote("renv_evict_b"), timeout=60)
        # B's unpack left A alone: the actor holds it.
        assert os.path.isdir(a_dir) and os.path.exists(b_file)
        troupe.kill(holder)
        # Its process ends, and with it its hold on A.
        wait_until(lambda: _free(a_dir + ".lock"), 60, "the killed actor's hold on its package to go")
        c_file = troupe.get(module_file.options(runtime_env=env("c")).remote("renv_evict_c"), timeout=60)
        assert os.path.exists(c_file)
        assert not os.path.exists(a_dir)
        assert a_dir.startswith(str(tmp_path / "tmp"))
    finally:
        troupe.shutdown()


def test_a_bad_cache_size_is_named(monkeypatch):
    from troupe import _packages

    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv("TROUPE_RUNTIME_ENV_CACHE_GB", bad)
        with pytest.raises(ConfigError, match=f"TROUPE_RUNTIME_ENV_CACHE_GB='{bad}'"):
            _packages._cache_bytes()
    monkeypatch.setenv("TROUPE_RUNTIME_ENV_CACHE_GB", "0.5")
    assert _packages._cache_bytes() == 2**29


def _wheel(folder, name, value, requires=()):
    """A wheel of package `name` (VALUE = value) that pip installs without a
    network or a build step."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-0.1.dist-info"
    files = {
        f"{name}/__init__.py": f"VALUE = {value!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    path = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, text in files.items():
            z.writestr(member, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
            record.append(f"{member},sha256={digest},{len(text.encode())}")
        z.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")
    return str(path)


@troupe.remote
def pip_value(name):
    import importlib
    import subprocess

    module = importlib.import_module(name)
    # The processes it starts see the packages too.
    child = subprocess.run([sys.executable, "-c", f"import {name}; print({name}.VALUE)"], capture_output=True,
                           text=True, timeout=60)
    return module.VALUE, module.__file__, child.stdout.strip()


@troupe.remote
class PipUser:
    def value(self, name):
        import importlib

        return importlib.import_module(name).VALUE


def _isolated_cache(tmp_path, monkeypatch):
    """The cluster's processes get a TMPDIR of their own: the runtime_env
    cache they use is this test's."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    return os.path.join(str(tmp_path / "tmp"), f"troupe-{os.getuid()}", "runtime_env")


def test_pip_packages_go_into_a_venv_per_node_for_their_tasks_alone(tmp_path, monkeypatch):
    """A task's pip packages are installed on its node into a venv that
    sees the interpreter's own packages (a requirement they meet is not
    installed again), which the tasks that name them, and the processes
    those start, import from; the job's pip (a requirements file) reaches
    every task and actor that gives none of its own; a task without them
    cannot import them; a local wheel that changed is installed again."""
    cache = _isolated_cache(tmp_path, monkeypatch)
    (tmp_path / "own").mkdir()
    (tmp_path / "job").mkdir()
    own_wheel = _wheel(tmp_path / "own", "renv_pip_demo", 42, requires=["numpy"])
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"# the job's packages\n{_wheel(tmp_path / 'job', 'renv_pip_job', 7)}\n")
    job = {"pip": {"packages": str(requirements), "pip_install_options": ["--no-index"]}}
    troupe.init(num_cpus=2, runtime_env=job)
    try:
        own = {"pip": {"packages": [own_wheel], "pip_install_options": ["--no-index"]}}
        refs = [pip_value.options(runtime_env=own).remote("renv_pip_demo") for _ in range(2)]
        (value, first, child), (again, second, _) = troupe.get(refs, timeout=300)
        assert (value, again, child) == (42, 42, "42")
        assert first == second and first.startswith(cache)
        site_packages = os.path.dirname(os.path.dirname(first))
        assert not os.path.exists(os.path.join(site_packages, "numpy"))  # the interpreter's own
        value, job_file, _ = troupe.get(pip_value.remote("renv_pip_job"), timeout=300)
        assert value == 7 and job_file.startswith(cache)
        user = PipUser.remote()
        assert troupe.get(user.value.remote("renv_pip_job"), timeout=300) == 7
        with pytest.raises(Exception, match="renv_pip_demo"):
            troupe.get(pip_value.remote("renv_pip_demo"), timeout=300)
        # The wheel changes: its new contents are installed, beside the old.
        _wheel(tmp_path / "own", "renv_pip_demo", 43, requires=["numpy"])
        value, third, _ = troupe.get(pip_value.options(runtime_env=own).remote("renv_pip_demo"), timeout=300)
        assert value == 43 and third != first
        installs = [e for e in os.listdir(cache) if len(e) == 64]
        assert len(installs) == 3, installs  # the task's, twice; the job's
    finally:
        troupe.shutdown()


def test_a_pip_install_that_fails_says_what_pip_said_and_is_remembered(tmp_path, monkeypatch):
    cache = _isolated_cache(tmp_path, monkeypatch)
    troupe.init(num_cpus=1)
    try:
        env = {"pip": {"packages": ["renv-no-such-package==1.0"], "pip_install_options": ["--no-index"]}}
        with pytest.raises(Exception) as failed:
            troupe.get(pip_value.options(runtime_env=env).remote("renv_no_such_package"), timeout=300)
        text = str(failed.value)
        assert "renv-no-such-package==1.0" in text and "pip install" in text and "No matching distribution" in text
        # Ray's class for it (it was a plain ConfigError, which it still is).
        assert isinstance(failed.value, troupe.exceptions.RuntimeEnvSetupError), type(failed.value).__mro__
        assert isinstance(failed.value, troupe.exceptions.ConfigError)
        # Nothing half-installed stays behind.
        assert not [e for e in os.listdir(cache) if len(e) == 64 or e.startswith(".")]
        # The next task that needs it fails with that error, without pip.
        with pytest.raises(troupe.exceptions.RuntimeEnvSetupError, match="ago on this node"):
            troupe.get(pip_value.options(runtime_env=env).remote("renv_no_such_package"), timeout=300)
    finally:
        troupe.shutdown()


def test_eviction_reads_each_entrys_size_from_beside_it(tmp_path, monkeypatch):
    """An eviction reads one small file per cache entry (<hash>.size,
    written once the entry is whole) instead of walking every file of
    every package and venv; the size file goes with its entry."""
    from troupe import _packages

    monkeypatch.setenv("TROUPE_RUNTIME_ENV_CACHE_GB", str(1.5 / 1024))  # 1.5 MiB
    old, new = "a" * 64, "b" * 64
    for i, package in enumerate((old, new)):
        (tmp_path / package).mkdir()
        (tmp_path / package / "f").write_bytes(b"x" * 10)
        os.utime(tmp_path / package, (1000 + i, 1000 + i))  # `old` used least recently
    assert _packages._entry_bytes(str(tmp_path), new) == 10
    assert (tmp_path / f"{new}.size").read_text() == "10"
    # What the size files say is what counts: 2 MiB in all, over the cap.
    for package in (old, new):
        (tmp_path / f"{package}.size").write_text(str(1 << 20))
    assert _packages.evict(str(tmp_path), new) == [old]
    assert not (tmp_path / old).exists() and not (tmp_path / f"{old}.size").exists()
    assert (tmp_path / new).exists()
    # A venv is measured, not remembered, until its install is whole.
    venv = "c" * 64
    (tmp_path / venv).mkdir()
    (tmp_path / venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    _packages._entry_bytes(str(tmp_path), venv)
    assert not (tmp_path / f"{venv}.size").exists()


@troupe.remote
def own_runtime_env():
    return dict(troupe.get_runtime_context().runtime_env)


def test_the_runtime_context_gives_the_runtime_env_in_effect(tmp_path):
    """Ray's get_runtime_context().runtime_env: the job's in the driver, the
    task's own (its options over the job's, env_vars merged) in a worker."""
    project = _project(tmp_path / "project")
    troupe.init(num_cpus=2, runtime_env={"working_dir": str(project), "excludes": ["*.bin"],
                                         "env_vars": {"JOB": "1"}})
    try:
        driver = troupe.get_runtime_context().runtime_env
        assert isinstance(driver, RuntimeEnv)
        assert driver.env_vars() == {"JOB": "1"}
        assert re.fullmatch(r"troupe_pkg://[0-9a-f]{64}", driver.working_dir()), driver
        task = troupe.get(own_runtime_env.options(runtime_env={"env_vars": {"TASK": "2"}}).remote(), timeout=60)
        assert task["env_vars"] == {"JOB": "1", "TASK": "2"}, task
        assert task["working_dir"] == driver.working_dir(), task
        # Handed back, as Ray code does (f.options(runtime_env=get_runtime_context().runtime_env)).
        again = troupe.get(own_runtime_env.options(runtime_env=driver).remote(), timeout=60)
        assert again["working_dir"] == driver.working_dir() and again["env_vars"] == {"JOB": "1"}, again
    finally:
        troupe.shutdown()
    troupe.init(num_cpus=1)
    try:
        assert troupe.get_runtime_context().runtime_env == {}
    finally:
        troupe.shutdown()



_CHILD_ROLE = [sys.executable, "-c", "import os; print(repr(os.environ.get('TROUPE_ROLE')), os.environ.get('TROUPE_SERVING_FD'))"]


@troupe.remote
class _ChildRole:
    def child(self):
        return subprocess.run(_CHILD_ROLE, capture_output=True, text=True, timeout=60).stdout.strip()


@troupe.remote
def _task_child_role():
    return subprocess.run(_CHILD_ROLE, capture_output=True, text=True, timeout=60).stdout.strip()


def test_what_an_actor_or_task_starts_is_not_told_it_is_a_worker(job):
    # A troupe program among them (the troupe CLI, a helper of the same
    # executable) took TROUPE_ROLE=worker for itself and said hello as a
    # second worker of the actor.
    actor = _ChildRole.remote()
    assert troupe.get(actor.child.remote(), timeout=120) == "None None"
    assert troupe.get(_task_child_role.remote(), timeout=120) == "None None"
    troupe.kill(actor)


def test_two_venvs_of_one_base_interpreter_get_pip_installs_of_their_own(tmp_path, monkeypatch):
    # A venv's python links to its base interpreter: keyed by that alone,
    # two venvs shared one install, whose .pth put the first venv's
    # packages ahead of the second's.
    from troupe import _pip

    spec = _pip.parse(["einops"], "test")
    ids = set()
    for name in ("a", "b"):
        prefix = tmp_path / name
        (prefix / "bin").mkdir(parents=True)
        os.symlink(sys.executable, prefix / "bin" / "python")
        monkeypatch.setattr(sys, "executable", str(prefix / "bin" / "python"))
        monkeypatch.setattr(sys, "prefix", str(prefix))
        ids.add(_pip.env_id(spec))
    assert len(ids) == 2


def test_a_relative_find_links_is_the_requirements_files(tmp_path, monkeypatch):
    # pip reads a relative --find-links against the requirements file's
    # folder; the rewritten file workers read lives elsewhere, and the
    # install found nothing ("No matching distribution").
    from troupe import _pip

    (tmp_path / "wheels").mkdir()
    (tmp_path / "req.txt").write_text("--no-index\n--find-links ./wheels\n-f wheels\nx\n")
    monkeypatch.chdir("/")
    packages = json.loads(_pip.parse(str(tmp_path / "req.txt"), "test"))["packages"]
    wheels = os.path.realpath(tmp_path / "wheels")
    for option in ("--find-links", "-f"):
        assert any(p.startswith(option + " ") and os.path.realpath(p.split(" ", 1)[1]) == wheels
                   for p in packages), packages
    assert "--find-links https://example.com/wheels" in json.loads(
        _pip.parse(["--find-links https://example.com/wheels", "x"], "test"))["packages"]


def test_a_pip_env_with_path_env_vars_keeps_its_venv_first_for_every_task(tmp_path, monkeypatch):
    # env_vars are set again before each task, as given: from the second
    # task on, PATH and PYTHONPATH lost the venv's entries, and the
    # processes a task started could not import its packages.
    _isolated_cache(tmp_path, monkeypatch)
    (tmp_path / "own").mkdir()
    own_wheel = _wheel(tmp_path / "own", "renv_pip_path", 5)
    troupe.init(num_cpus=1)
    try:
        env = {"pip": {"packages": [own_wheel], "pip_install_options": ["--no-index"]},
               "env_vars": {"PATH": "/opt/renv/bin:${PATH}", "PYTHONPATH": "/opt/renv/lib"}}
        for _ in range(3):  # one executor (one CPU): the same worker each time
            value, _, child = troupe.get(pip_value.options(runtime_env=env).remote("renv_pip_path"), timeout=300)
            assert (value, child) == (5, "5")
    finally:
        troupe.shutdown()


@troupe.remote
class Interpreter:
    def startup(self, entry):
        return entry in sys.path, hash("troupe")


def test_python_startup_variables_reach_an_actor_the_pool_would_have_served(job, tmp_path):
    # PYTHONPATH builds sys.path and PYTHONHASHSEED the hash seed as the
    # interpreter starts: a warm pooled worker took them too late, and a
    # literal PYTHONPATH did nothing there. They make the worker cold.
    first = Interpreter.remote()
    troupe.get(first.startup.remote(""), timeout=60)
    from conftest import wait_until

    wait_until(lambda: any(n.get("IdleWorkers", 0) > 0 for n in troupe.nodes()), what="a warm pooled worker")
    seeded = subprocess.run([sys.executable, "-c", "print(hash('troupe'))"], capture_output=True, text=True,
                            env={**os.environ, "PYTHONHASHSEED": "0"}, timeout=60)
    env = {"env_vars": {"PYTHONPATH": str(tmp_path), "PYTHONHASHSEED": "0"}}
    actor = Interpreter.options(runtime_env=env).remote()
    on_path, hashed = troupe.get(actor.startup.remote(str(tmp_path)), timeout=60)
    assert on_path and hashed == int(seeded.stdout), (on_path, hashed, seeded.stdout)
