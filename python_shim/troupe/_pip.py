"""runtime_env's pip, as Ray's: the packages a task or actor needs that
the nodes lack, installed on each node the first time a worker needs them,
into a virtualenv that sees the interpreter's own packages, and kept there
for the workers that come after.

The driver checks the option and writes it down as canonical JSON (the
requirement lines, with `-r` files inlined and local paths made absolute;
pip's extra options; a fingerprint of each local path, so an edited
project is installed again), which travels in the worker's environment
(PYTROUPE_PIP): tasks with other pip packages run on other executors, and
the tasks and actors a worker starts inherit it unless their runtime_env
gives a pip of their own.

A worker that is to run with it looks in the node's runtime_env cache
(troupe/_packages.py) for the directory named by the SHA-256 of that JSON
and of its interpreter. The first one makes it: `python -m venv
--system-site-packages --without-pip` there, then the venv's interpreter
runs the system's pip to install (so requirements the interpreter's own
packages meet are not installed again: a .pth file puts the worker
interpreter's site directories, a venv's too, on the new venv's path), then a marker file says it is
whole. The others wait on an exclusive flock (<hash>.install) meanwhile.
Each puts the venv's site-packages first on sys.path (after the env's
working_dir and py_modules; its .pth files run) and its bin/ first on PATH
and its site-packages on PYTHONPATH for the processes it starts. An
install is a cache entry like an unpacked package: held by the processes
that run with it, evicted past TROUPE_RUNTIME_ENV_CACHE_GB when no one
does. A failed install is remembered on the node for ten minutes (as
Ray's): the workers that need it fail at once with its error meanwhile."""
import ctypes
import fcntl
import glob
import hashlib
import json
import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import time

from troupe import _core
from troupe.exceptions import ConfigError, RuntimeEnvSetupError

ENV = "PYTROUPE_PIP"
_DICT_KEYS = ("packages", "pip_install_options", "pip_check", "pip_version")
# How much of a failed pip's output the error carries.
_OUTPUT_LINES = 25
# The spec travels in an environment variable (one string of at most
# 128 KiB on Linux, with everything else a worker gets).
_MAX_SPEC_BYTES = 32 << 10
# How long a failed install is remembered on its node (Ray's default).
FAILED_TTL_S = 600
INSTALLED = ".troupe-installed"
# Requirement-file options whose argument is a path (a --find-links URL
# is left as it is: only a path that exists here is made absolute).
_PATH_OPTIONS = ("-c", "--constraint", "-e", "--editable", "-f", "--find-links")
_INCLUDE_OPTIONS = ("-r", "--requirement")


def _split_option(line):
    """(option, argument) of a requirements line such as `-r x.txt`,
    `-rx.txt` or `--requirement=x.txt`; (None, line) for a requirement."""
    if not line.startswith("-"):
        return None, line
    head, _, rest = line.partition(" ")
    if head.startswith("--"):
        option, equals, value = head.partition("=")
        return option, (value + " " + rest).strip() if equals else rest.strip()
    if len(head) > 2:  # -rfile.txt
        return head[:2], (head[2:] + " " + rest).strip()
    return head, rest.strip()


def _local(entry, base):
    """`entry` as an absolute path when it names one that exists on this
    machine (relative to `base`), else None."""
    if "://" in entry or entry.startswith("git+"):
        return None
    path = os.path.expanduser(entry)
    path = path if os.path.isabs(path) else os.path.join(base, path)
    looks_like_a_path = entry.startswith((".", "/", "~")) or os.sep in entry or \
        entry.endswith((".whl", ".tar.gz", ".zip")) or \
        any(os.path.exists(os.path.join(path, f)) for f in ("setup.py", "pyproject.toml"))
    return os.path.abspath(path) if looks_like_a_path and os.path.exists(path) else None


def _fingerprint(path):
    """What changes when the files at `path` do (names, sizes, times)."""
    h = hashlib.sha256()
    if os.path.isfile(path):
        st = os.stat(path)
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
        return h.hexdigest()
    for folder, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", ".git", "build") and not d.endswith(".egg-info"))
        for name in sorted(files):
            try:
                st = os.stat(os.path.join(folder, name))
            except OSError:
                continue
            h.update(f"{os.path.relpath(os.path.join(folder, name), path)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _file_lines(path, what, seen):
    path = os.path.abspath(path)
    if path in seen:
        raise ConfigError(f"{what}: runtime_env pip: requirements file {path!r} includes itself")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{what}: runtime_env pip {path!r} is read as a requirements file, and it cannot be "
                          f"read: {e.strerror}") from None
    lines = [line.split(" #")[0].strip() for line in text.splitlines()]
    return _resolved([line for line in lines if line and not line.startswith("#")], os.path.dirname(path), what,
                     seen | {path})


def _resolved(lines, base, what, seen=frozenset()):
    """`lines` with included requirements files inlined and local paths made
    absolute (relative to `base`): what a worker's pip reads, wherever it
    runs from."""
    out = []
    for line in lines:
        option, argument = _split_option(line)
        if option in _INCLUDE_OPTIONS:
            out.extend(_file_lines(os.path.join(base, os.path.expanduser(argument)), what, seen))
        elif option in _PATH_OPTIONS:
            path = os.path.join(base, os.path.expanduser(argument))
            out.append(f"{option} {os.path.abspath(path)}" if os.path.exists(path) else line)
        elif option is None:
            out.append(_local(line, base) or line)
        else:
            out.append(line)
    return out


def _requirement_lines(value, what):
    """A requirements file's lines (read here, on the driver) or a list's
    entries, checked and resolved (_resolved)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        return _file_lines(value, what, frozenset())
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
    return _resolved(lines, os.getcwd(), what)


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
    local = {}
    for line in lines:
        path = _split_option(line)[1]
        if os.path.isabs(path) and os.path.exists(path):
            local[path] = _fingerprint(path)
    spec = json.dumps({"packages": lines, "options": list(options), "check": check, "local": local},
                      sort_keys=True)
    if len(spec) > _MAX_SPEC_BYTES:
        raise ConfigError(f"{what}: runtime_env pip names {len(spec)} bytes of requirements, more than the "
                          f"{_MAX_SPEC_BYTES} a worker's environment carries: put them in a wheel, or on an "
                          "index the nodes reach")
    return spec


def environment(spec):
    """The worker environment entries that carry `spec` (none for None)."""
    return [f"{ENV}={spec}"] if spec else []


def inherited():
    """The pip spec this worker runs with (None: none)."""
    return _core.getenv(ENV) or None


def env_id(spec):
    """The cache directory's name of `spec`'s install for this interpreter
    (64 hex digits, as a package's)."""
    # sys.prefix too: a venv's python is a link to its base interpreter, so
    # two venvs of one base had one install, whose .pth (the building
    # worker's site directories) put the first venv's packages ahead of
    # the second's (another torch, imported by the second project).
    interpreter = f"{os.path.realpath(sys.executable)}\0{sys.prefix}\0{sys.version}"
    return hashlib.sha256(b"pip\0" + spec.encode() + b"\0" + interpreter.encode()).hexdigest()


def _failure(spec, what, output):
    lines = [line for line in output.splitlines() if line.strip()][-_OUTPUT_LINES:]
    packages = json.loads(spec)["packages"]
    return RuntimeEnvSetupError(f"runtime_env pip {packages}: {what} on {socket.gethostname()}:\n" + "\n".join(lines))


_prctl = None


def _die_with_this_thread():
    # In the child, between fork and exec: pip goes when the worker does
    # (a killed worker must not leave a pip writing into the cache).
    if _prctl is not None:
        _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _run(spec, command, what, env=None):
    """Runs `command`; ConfigError with its last lines of output when it
    fails."""
    global _prctl
    if _prctl is None and sys.platform.startswith("linux"):
        try:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            pass
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env, text=True, errors="replace", preexec_fn=_die_with_this_thread)
    except OSError as e:
        raise _failure(spec, f"{command[0]} cannot run", str(e)) from None
    if done.returncode != 0:
        raise _failure(spec, f"{what} failed (exit {done.returncode})", done.stdout)


_site_packages_of = {}


def site_packages(venv):
    """The venv's site-packages directory (looked up once per venv: every
    task of a pip env asks, see put_first)."""
    found = _site_packages_of.get(venv)
    if found is None:
        matches = glob.glob(os.path.join(venv, "lib", "python*", "site-packages"))
        if not matches:
            raise ConfigError(f"runtime_env pip: {venv} has no lib/python*/site-packages")
        found = _site_packages_of[venv] = matches[0]
    return found


def _site_directories():
    """This interpreter's site directories (its venv's and its base's)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


def _install(spec, venv):
    """Makes the venv at `venv` and installs `spec` into it; the marker
    file last."""
    parsed = json.loads(spec)
    print(f"troupe: runtime_env pip: installing {parsed['packages']} into {venv}", file=sys.stderr, flush=True)
    _run(spec, [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv], "python -m venv")
    python = os.path.join(venv, "bin", "python")
    # A venv sees its base interpreter's packages, not those of a venv the
    # worker's interpreter may itself be: this one's site directories go on
    # its path after its own (a .pth file), so pip counts what they hold as
    # installed, as a clone of the worker's environment would.
    with open(os.path.join(site_packages(venv), "_troupe_base.pth"), "w", encoding="utf-8") as f:
        f.write("".join(f"{d}\n" for d in _site_directories()))
    requirements = os.path.join(venv, "troupe-requirements.txt")
    with open(requirements, "w", encoding="utf-8") as f:
        f.write("\n".join(parsed["packages"]) + "\n")
    # The venv's interpreter runs the system's pip (the venv has none of its
    # own): it installs into the venv what the system's packages lack. Quiet
    # about running as root (a container's usual user), never asking.
    env = dict(os.environ, PIP_ROOT_USER_ACTION="ignore", PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    _run(spec, [python, "-m", "pip", "install", "-r", requirements, *parsed["options"]], "`pip install`", env)
    if parsed["check"]:
        _run(spec, [python, "-m", "pip", "check"], "`pip check`", env)
    with open(os.path.join(venv, INSTALLED), "w") as f:
        f.write(spec)


def _failed_recently(path):
    """The error of an install that failed here within FAILED_TTL_S, else
    None."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        age = time.time() - float(record["time"])
        if 0 <= age < FAILED_TTL_S:
            return f"{record['error']}\n(it failed {age:.0f} s ago on this node; troupe tries again " \
                   f"{FAILED_TTL_S - age:.0f} s from now, or at once for another pip spec)"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def local_path(spec):
    """Where `spec`'s venv lies on this machine: made by the first worker
    that needs it, while the others wait. This process holds the directory
    from then on (_packages.release_unused lets go)."""
    from troupe import _packages

    _packages._cache_bytes()  # a bad cache size fails every use alike
    root = _packages._cache_root()
    package = env_id(spec)
    venv = os.path.join(root, package)
    failed = os.path.join(root, package + ".failed")
    _packages._hold(root, package)
    if not os.path.exists(os.path.join(venv, INSTALLED)):
        fd = os.open(os.path.join(root, package + ".install"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # another worker's install first
            if not os.path.exists(os.path.join(venv, INSTALLED)):
                error = _failed_recently(failed)
                if error:
                    raise RuntimeEnvSetupError(error)
                # What an install cut short (its worker killed) left.
                shutil.rmtree(venv, ignore_errors=True)
                try:
                    _install(spec, venv)
                except ConfigError as e:
                    shutil.rmtree(venv, ignore_errors=True)
                    with open(failed, "w", encoding="utf-8") as f:
                        json.dump({"time": time.time(), "error": str(e)}, f)
                    raise
                try:
                    os.unlink(failed)
                except FileNotFoundError:
                    pass
                _packages.evict(root, package)
        finally:
            os.close(fd)
    try:
        os.utime(venv)  # used now: the last to be evicted
    except OSError:
        pass
    return venv


def activate(venv):
    """The sys.path entries of `venv` (its site-packages, then what its .pth
    files add), for the caller to put first; its .pth files' imports run
    now. Sets PATH and PYTHONPATH for the processes this one starts, undone
    by deactivate()."""
    packages = site_packages(venv)
    before = list(sys.path)
    site.addsitedir(packages)
    added = [p for p in sys.path if p not in before]
    for p in added:
        sys.path.remove(p)
    put_first(venv)
    return added or [packages]


def put_first(venv):
    """`venv`'s bin first on PATH and its site-packages first on
    PYTHONPATH, for the processes this one starts (once each)."""
    for name, entry in (("PATH", os.path.join(venv, "bin")), ("PYTHONPATH", site_packages(venv))):
        rest = [p for p in os.environ.get(name, "").split(os.pathsep) if p and p != entry]
        os.environ[name] = os.pathsep.join([entry] + rest)


def deactivate(venv):
    """Takes `venv`'s entries out of PATH and PYTHONPATH again."""
    for name, entry in (("PATH", os.path.join(venv, "bin")), ("PYTHONPATH", None)):
        entries = [p for p in os.environ.get(name, "").split(os.pathsep) if p]
        if entry is None:
            entries = [p for p in entries if not p.startswith(venv + os.sep)]
        else:
            entries = [p for p in entries if p != entry]
        if entries:
            os.environ[name] = os.pathsep.join(entries)
        else:
            os.environ.pop(name, None)
