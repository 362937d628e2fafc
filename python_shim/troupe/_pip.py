"""runtime_env's pip, as Ray's: the packages a task or actor needs that
the nodes lack, installed on each node the first time a worker needs them
and kept there for the workers that come after.

The driver checks the option and writes it down (the requirement lines,
pip's extra options) as canonical JSON, which travels in the worker's
environment (PYTROUPE_PIP): tasks with other pip packages run on other
executors, and the tasks and actors a worker starts inherit it unless
their runtime_env gives a pip of their own. A worker that is to run with
it runs `pip install --target` with this interpreter's pip into the node's
runtime_env cache (troupe/_packages.py), under a directory named by the
SHA-256 of that JSON, and puts the directory on sys.path before the task or
the actor's constructor runs. One worker installs, the others wait for it
(an exclusive flock on <hash>.install); the install goes to a staging
directory renamed into place, so no worker sees half of one. The installed
directory is a cache entry like an unpacked package: held by the processes
that run with it, evicted past TROUPE_RUNTIME_ENV_CACHE_GB when no one
does.

Unlike Ray, there is no virtualenv: the packages go first on sys.path of
the worker's interpreter (whose own site-packages stay visible, as Ray's
virtualenvs see the system's), and .pth files in them are not run."""
import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

from troupe import _core
from troupe.exceptions import ConfigError

ENV = "PYTROUPE_PIP"
_DICT_KEYS = ("packages", "pip_install_options", "pip_check", "pip_version")
# How much of a failed pip's output the error carries.
_OUTPUT_LINES = 25


def _requirement_lines(value, what):
    """A requirements file's lines (read here, on the driver) or a list's
    entries, checked: strings, one requirement (or pip option) each."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        path = os.path.abspath(value)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"{what}: runtime_env pip {value!r} is read as a requirements file, and it cannot "
                              f"be read: {e.strerror}") from None
        return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{what}: runtime_env pip must be a list of requirements, a requirements file's path "
                          f"or a dict with 'packages', got a {type(value).__name__}")
    lines = []
    for entry in value:
        if not isinstance(entry, str) or not entry.strip():
            raise ConfigError(f"{what}: runtime_env pip: each requirement must be a non-empty str, got {entry!r}")
        if "\n" in entry or "\r" in entry or "\0" in entry:
            raise ConfigError(f"{what}: runtime_env pip: requirement {entry!r} spans lines")
        lines.append(entry.strip())
    return lines


def parse(value, what):
    """runtime_env's pip as the canonical JSON a worker's environment carries
    (None when it names no package). Takes what Ray takes: a list of
    requirements, a requirements file's path, or {"packages": either,
    "pip_install_options": [...], "pip_check": False}. ConfigError names
    what is wrong."""
    options, check = [], False
    if isinstance(value, dict):
        for key in value:
            if key not in _DICT_KEYS:
                raise ConfigError(f"{what}: runtime_env pip key {key!r} is not known (known: "
                                  f"{', '.join(_DICT_KEYS)})")
        if value.get("pip_version"):
            raise ConfigError(f"{what}: runtime_env pip's pip_version {value['pip_version']!r} is not supported: "
                              "troupe installs with the pip of the workers' interpreter")
        check = value.get("pip_check", False)
        if not isinstance(check, bool):
            raise ConfigError(f"{what}: runtime_env pip's pip_check must be True or False, got {check!r}")
        options = value.get("pip_install_options") or []
        if not isinstance(options, (list, tuple)) or not all(isinstance(o, str) and o for o in options):
            raise ConfigError(f"{what}: runtime_env pip's pip_install_options must be a list of str, "
                              f"got {options!r}")
        if "packages" not in value:
            raise ConfigError(f"{what}: runtime_env pip given as a dict needs 'packages'")
        value = value["packages"]
    lines = _requirement_lines(value, what)
    if not lines:
        return None
    return json.dumps({"packages": lines, "options": list(options), "check": check}, sort_keys=True)


def environment(spec):
    """The worker environment entries that carry `spec` (none for None)."""
    return [f"{ENV}={spec}"] if spec else []


def inherited():
    """The pip spec this worker runs with (None: none)."""
    return _core.getenv(ENV) or None


def env_id(spec):
    """The cache directory's name of `spec`'s install (64 hex digits, as a
    package's)."""
    return hashlib.sha256(b"pip\0" + spec.encode()).hexdigest()


def _failure(spec, what, output):
    lines = [line for line in output.splitlines() if line.strip()][-_OUTPUT_LINES:]
    packages = json.loads(spec)["packages"]
    return ConfigError(f"runtime_env pip {packages}: {what} on {socket.gethostname()}:\n" + "\n".join(lines))


def _run_pip(spec, arguments, path=None):
    """Runs this interpreter's pip with `arguments` (and `path` first on its
    sys.path); ConfigError with pip's last lines of output when it fails."""
    command = [sys.executable, "-m", "pip", *arguments]
    # Quiet about running as root (a container's usual user), and never
    # asking anything.
    env = dict(os.environ, PIP_ROOT_USER_ACTION="ignore", PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env, text=True, errors="replace")
    except OSError as e:
        raise _failure(spec, f"{sys.executable} -m pip cannot run", str(e)) from None
    if done.returncode != 0:
        raise _failure(spec, f"`pip {arguments[0]}` failed (exit {done.returncode})", done.stdout)


def _install(spec, root, target):
    """Installs `spec` into `target` (staged beside it, renamed into place)."""
    from troupe import _packages

    parsed = json.loads(spec)
    _packages._sweep_staging(root)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(target)[:16]}.", dir=root)
    try:
        requirements = os.path.join(staging, "requirements.txt")
        with open(requirements, "w", encoding="utf-8") as f:
            f.write("\n".join(parsed["packages"]) + "\n")
        site = os.path.join(staging, "site")
        print(f"troupe: runtime_env pip: installing {parsed['packages']} into {target}", file=sys.stderr,
              flush=True)
        _run_pip(spec, ["install", "--target", site, "-r", requirements, *parsed["options"]])
        if parsed["check"]:
            # What was installed, with the interpreter's own packages: their
            # requirements met (Ray's pip_check).
            _run_pip(spec, ["check"], path=site)
        os.rename(site, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def local_path(spec):
    """Where `spec`'s packages lie installed on this machine: installed by
    the first worker that needs them, while the others wait. This process
    holds the directory from then on (_packages.release_unused lets go)."""
    from troupe import _packages

    _packages._cache_bytes()  # a bad cache size fails every use alike
    root = _packages._cache_root()
    package = env_id(spec)
    target = os.path.join(root, package)
    _packages._hold(root, package)
    if not os.path.isdir(target):
        fd = os.open(os.path.join(root, package + ".install"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # another worker's install first
            if not os.path.isdir(target):
                _install(spec, root, target)
                _packages.evict(root, package)
        finally:
            os.close(fd)
    try:
        os.utime(target)  # used now: the last to be evicted
    except OSError:
        pass
    return target
