"""runtime_env's working_dir and py_modules, as Ray's: the driver packs a
local directory (or a module's directory or file) into a zip whose name is
the SHA-256 of its bytes, and puts it into the cluster's KV store once
(chunked under the head's frame limit); a worker that is to run with it
fetches it, checks the hash, unpacks it once per machine under
$TMPDIR/troupe-<uid>/runtime_env/<hash>/ and, before the task or the
actor's constructor runs, puts it on sys.path (a working_dir also becomes
the current directory). The package's hash travels in the worker's
environment (PYTROUPE_WORKING_DIR, PYTROUPE_PY_MODULES), so tasks with
another working_dir run on other executors, and the tasks and actors a
worker starts inherit it.

A package lives in the KV store while a process holds it (the same
contents are stored once): the process that uploaded it, with a reference
key of its client's, and a detached actor that runs with it, with one of
its own, which its creator puts right after the spawn. The head erases the
package once the last reference goes (runtime/client/actor_keys.h): its
process ended, or its actor died for good. An actor that is not detached
dies with its owner, whose chain leads to a holder. On each machine the
unpacked packages are a cache, as Ray's: past TROUPE_RUNTIME_ENV_CACHE_GB
(10 by default) the least recently used that no process uses now are
removed when another is unpacked. A process that runs with a package holds
a shared flock on <hash>.lock beside it (the kernel lets go of it when the
process dies); an eviction takes it exclusively, without waiting, or
leaves that package alone."""
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
import zipfile

from troupe import _core
from troupe.exceptions import ConfigError

WORKING_DIR_ENV = "PYTROUPE_WORKING_DIR"
PY_MODULES_ENV = "PYTROUPE_PY_MODULES"
_KEY = "troupe.py.pkg."
# A KV value travels in one head message (16 MiB at most): chunks of 4 MiB.
_CHUNK = 4 << 20
# What one package may pack to: the head keeps it in memory (and in its
# database when it writes its tables through).
MAX_PACKAGE_BYTES = 64 << 20
# Never packed: caches and version-control data.
_ALWAYS_EXCLUDED = ("__pycache__", ".git", ".hg", ".svn")
# As Ray's: the .gitignore and .rayignore of every directory packed leave
# out what their patterns (gitignore's) match below that directory. This
# variable set to 1 where the driver runs (or Ray's own name of it) leaves
# the .gitignore files unread; the .rayignore files still count.
IGNORE_GITIGNORE_ENV = "TROUPE_RUNTIME_ENV_IGNORE_GITIGNORE"
_RAY_IGNORE_GITIGNORE_ENV = "RAY_RUNTIME_ENV_IGNORE_GITIGNORE"
# A fixed time stamp: the same files make the same zip, and the same hash.
_EPOCH = (1980, 1, 1, 0, 0, 0)

_uploaded = {}  # (cluster address, token, client id, kind, path, excludes) -> package id, this process
_PACKAGE_ID = re.compile(r"[0-9a-f]{64}")
_upload_lock = threading.Lock()
# In a worker: as inherited() says; "venv" is the pip spec's, once made.
_applied = {"working_dir": None, "py_modules": (), "pip": None, "venv": None, "paths": []}
# The packages this process uses: package id -> the descriptor of its lock
# file, locked shared (no eviction removes them meanwhile). Under
# _apply_lock, as _applied is (task threads of one worker apply at once).
_held = {}
_apply_lock = threading.RLock()
CACHE_ENV = "TROUPE_RUNTIME_ENV_CACHE_GB"
DEFAULT_CACHE_GB = 10.0


def _size(n):
    return f"{n / 2**20:.1f} MiB" if n >= 1 << 20 else f"{max(1, round(n / 1024))} KiB"


def _always_excluded(relative):
    return any(p in _ALWAYS_EXCLUDED for p in relative.split("/"))


def _exclude_rules(excludes):
    """runtime_env's excludes as Ray reads them: the lines of an ignore file
    at the package's top, in git's syntax ("/data" only at the top, "**/x"
    at any depth including the top, "build/" directories alone, "src/*.py"
    not below src's subdirectories, "!keep" bringing a file back). Matched
    with fnmatch on every part of the path, "/data" left out pkg/data too
    and "**/node_modules" missed the top one."""
    return [r for r in (_ignore_rule(p, "") for p in excludes) if r]


def _ignore_files():
    """The ignore files read in each directory packed, in this order."""
    if "1" in (os.environ.get(IGNORE_GITIGNORE_ENV), os.environ.get(_RAY_IGNORE_GITIGNORE_ENV)):
        return (".rayignore",)
    return (".gitignore", ".rayignore")


class _IgnoreRule:
    """One pattern of an ignore file: `regex` over the path below `base`
    (the file's directory in the package, "" or ending in /), or over the
    name alone when the pattern has no / but perhaps a trailing one (it
    matches at any depth)."""

    __slots__ = ("base", "regex", "negated", "dir_only", "anchored")

    def __init__(self, base, regex, negated, dir_only, anchored):
        self.base, self.regex, self.negated, self.dir_only, self.anchored = base, regex, negated, dir_only, anchored

    def matches(self, relative, is_dir):
        if self.dir_only and not is_dir:
            return False
        target = relative[len(self.base):] if self.anchored else relative.rsplit("/", 1)[-1]
        return self.regex.fullmatch(target) is not None


# POSIX classes of a bracket expression ([[:digit:]]), as git knows them.
_POSIX_CLASSES = {"alnum": "a-zA-Z0-9", "alpha": "a-zA-Z", "blank": r" \t", "digit": "0-9", "lower": "a-z",
                  "upper": "A-Z", "space": r" \t\n\r\f\v", "xdigit": "0-9A-Fa-f",
                  "punct": re.escape("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")}


def _bracket(pattern, i):
    """The regex of the bracket expression at pattern[i] ("[") and the index
    past it, or (None, i) when it does not close. A / never matches one."""
    j = i + 1
    negated = j < len(pattern) and pattern[j] in "!^"
    j += negated
    body, first = [], True
    while j < len(pattern):
        c = pattern[j]
        if c == "]" and not first:
            chars = "".join(body)
            return (f"[^/{chars}]" if negated else f"(?!/)[{chars}]"), j + 1
        first = False
        if c == "[" and pattern.startswith("[:", j):
            end = pattern.find(":]", j + 2)
            if end != -1 and pattern[j + 2:end] in _POSIX_CLASSES:
                body.append(_POSIX_CLASSES[pattern[j + 2:end]])
                j = end + 2
                continue
        if c == "\\" and j + 1 < len(pattern):
            j += 1
            c = pattern[j]
        if pattern.startswith("-", j + 1) and j + 2 < len(pattern) and pattern[j + 2] != "]":
            high = pattern[j + 2]
            if high == "\\" and j + 3 < len(pattern):
                high = pattern[j + 3]
                j += 1
            body.append(f"{re.escape(c)}-{re.escape(high)}")
            j += 3
        else:
            body.append(re.escape(c))
            j += 1
    return None, i


def _wildmatch(pattern):
    """A gitignore pattern (its !, leading / and trailing / taken off) as a
    regex: * and ? never match a /; ** matches across them where it is a
    whole component ("**/x", "x/**", "x/**/y"), and is * elsewhere."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            j = i
            while j < n and pattern[j] == "*":
                j += 1
            whole = (i == 0 or pattern[i - 1] == "/") and (j == n or pattern[j] == "/")
            if j - i >= 2 and whole and j == n:
                out.append(".*")  # everything inside
            elif j - i >= 2 and whole:
                out.append("(?:.*/)?")  # no directory or any, its / included
                j += 1
            else:
                out.append("[^/]*")
            i = j
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            regex, i = _bracket(pattern, i)
            if regex is None:
                out.append(re.escape(c))
                i += 1
            else:
                out.append(regex)
        elif c == "\\" and i + 1 < n:
            out.append(re.escape(pattern[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def _ignore_rule(line, base):
    """The rule of one line of an ignore file in directory `base`, None for
    a blank line or a comment, as git reads it."""
    line = line[:-1] if line.endswith("\r") else line
    if not line or line.startswith("#"):
        return None
    # Trailing spaces go, unless a backslash quotes them (git's
    # trim_trailing_spaces: a line that ends in a lone backslash keeps all).
    last_space, i = None, 0
    while i < len(line):
        if line[i] == " ":
            last_space = i if last_space is None else last_space
        else:
            if line[i] == "\\":
                i += 1
                if i == len(line):
                    last_space = None
                    break
            last_space = None
        i += 1
    if last_space is not None:
        line = line[:last_space]
    negated = line.startswith("!")
    if negated:
        line = line[1:]
    dir_only = line.endswith("/")
    if dir_only:
        line = line[:-1]
    anchored = "/" in line
    if line.startswith("/"):
        line = line[1:]
    if not line:
        return None
    try:
        pattern = re.compile(_wildmatch(line), re.DOTALL)
    except re.error:
        return None  # a range such as [z-a]: git's matches nothing
    return _IgnoreRule(base, pattern, negated, dir_only, anchored)


def _ignore_rules(directory, base, names):
    """The rules of the ignore files `names` in `directory` (`base` in the
    package)."""
    rules = []
    for name in names:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as f:
                text = f.read().decode("utf-8", "surrogateescape")
        except OSError as e:
            raise ConfigError(f"runtime_env: cannot read {path}: {e.strerror}") from None
        rules.extend(r for r in (_ignore_rule(line, base) for line in text.split("\n")) if r)
    return rules


def _ignored(relative, is_dir, rules):
    """Whether `rules` (from the top directory's files down) leave out the
    path: the last that matches decides, as in git."""
    ignored = False
    for rule in rules:
        if rule.matches(relative, is_dir):
            ignored = not rule.negated
    return ignored


def _files(root, prefix, excludes, ignore_files=()):
    """(path on disk, name in the zip) of every file under `root`, sorted,
    but those that `excludes` or the `ignore_files` of their directories
    leave out (a directory left out is not looked into: a pattern cannot
    bring back what is under it, as in git)."""
    out = []
    excluded = _exclude_rules(excludes)
    rules = {}  # directory in the package -> the rules that apply in it: its parents', then its own
    for directory, dirs, files in os.walk(root, followlinks=False):
        relative_dir = os.path.relpath(directory, root)
        relative_dir = "" if relative_dir == "." else relative_dir.replace(os.sep, "/") + "/"
        parent = relative_dir[:-1].rpartition("/")[0]
        inherited = rules.get(parent + "/" if parent else "", []) if relative_dir else []
        here = rules[relative_dir] = inherited + _ignore_rules(directory, relative_dir, ignore_files)
        dirs[:] = sorted(d for d in dirs if not _always_excluded(relative_dir + d)
                         and not _ignored(relative_dir + d, True, excluded)
                         and not os.path.islink(os.path.join(directory, d))
                         and not _ignored(relative_dir + d, True, here))
        for name in sorted(files):
            relative = relative_dir + name
            path = os.path.join(directory, name)
            if (_always_excluded(relative) or _ignored(relative, False, excluded) or not os.path.isfile(path)
                    or _ignored(relative, False, here)):
                continue
            out.append((path, prefix + relative))
    return out


def pack(path, kind, excludes=()):
    """The zip of `path` (bytes): a working_dir's files at its top, a
    py_module's directory under its own name (a single .py file as
    itself). ConfigError naming the path when it is missing or too big."""
    if os.path.isdir(path):
        prefix = "" if kind == "working_dir" else os.path.basename(os.path.normpath(path)) + "/"
        files = _files(path, prefix, excludes, _ignore_files())
    elif kind == "py_modules" and os.path.isfile(path) and path.endswith(".py"):
        files = [(path, os.path.basename(path))]
    else:
        what = "a directory" if kind == "working_dir" else "a directory or a .py file"
        raise ConfigError(f"runtime_env {kind}: {path!r} is not {what} on this machine")
    size = sum(os.path.getsize(p) for p, _ in files)
    if size > 4 * MAX_PACKAGE_BYTES:
        raise ConfigError(f"runtime_env {kind} {path!r} holds {_size(size)} of files; a package packs to "
                          f"at most {_size(MAX_PACKAGE_BYTES)}: leave out what the workers do not need with "
                          "runtime_env's excludes")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        for disk, name in files:
            info = zipfile.ZipInfo(name, _EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = (stat.S_IMODE(os.stat(disk).st_mode) | stat.S_IFREG) << 16
            with open(disk, "rb") as f:
                z.writestr(info, f.read())
    data = buffer.getvalue()
    if len(data) > MAX_PACKAGE_BYTES:
        raise ConfigError(f"runtime_env {kind} {path!r} packs to {_size(len(data))}, over the "
                          f"{_size(MAX_PACKAGE_BYTES)} a package may take: leave out what the workers do not "
                          "need with runtime_env's excludes")
    return data


def upload(client, path, kind, excludes=()):
    """The package id of `path` on `client`'s cluster, packed and stored
    there once per process (and once per cluster for the same bytes)."""
    # By the cluster's address and token, not id(client): a later session's
    # client may be given the id of one that is gone, whose cluster held
    # the package.
    # And by the client: a new session's is a new holder.
    memo = (client.address, client.token, client.client_id, kind, path, tuple(excludes), _ignore_files())
    with _upload_lock:
        if memo in _uploaded:
            return _uploaded[memo]
    data = pack(path, kind, excludes)
    package = hashlib.sha256(data).hexdigest()
    # Held first: a package whose last holder goes meanwhile is then either
    # still there when looked for, or stored again.
    client.kv_put(_reference(f"troupe.client/{client.client_id}/", package), b"")
    if client.kv_get(_KEY + package) is None:
        chunks = [data[i:i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            client.kv_put(f"{_KEY}{package}.{i}", chunk)
        # Last: a reader that finds the manifest finds every chunk.
        client.kv_put(_KEY + package, json.dumps({"chunks": len(chunks), "bytes": len(data)}).encode())
    with _upload_lock:
        _uploaded[memo] = package
    return package


def _reference(scope, package):
    """The key by which the process or actor of `scope` holds `package`."""
    return f"{scope}ref/{_KEY}{package}"


def packages_in(env):
    """The package ids a worker environment (a list of NAME=VALUE) names."""
    ids = []
    for entry in env:
        name, _, value = entry.partition("=")
        if name in (WORKING_DIR_ENV, PY_MODULES_ENV) and value:
            ids.extend(value.split(":"))
    return ids


def hold_for_actor(client, actor_id, env):
    """A detached actor holds the packages its environment names, for as
    long as it lives (restarts included): its creator may end first."""
    for package in packages_in(env):
        client.kv_put(_reference(f"troupe.actor/{actor_id}/", package), b"")


def _cache_root():
    """$TMPDIR/troupe-<uid>/runtime_env, this user's alone: a directory
    that another user could write to could hand a worker other code."""
    root = os.path.join(tempfile.gettempdir(), f"troupe-{os.getuid()}")
    for d in (root, os.path.join(root, "runtime_env")):
        os.makedirs(d, mode=0o700, exist_ok=True)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise ConfigError(f"runtime_env: {d} must be a directory of this user's that no one else can write to")
    return os.path.join(root, "runtime_env")


def _fetch(client, package):
    manifest = client.kv_get(_KEY + package)
    if manifest is None:
        raise ConfigError(f"runtime_env package {package} is not in the cluster's KV store: every process that "
                          "held it ended (the driver that uploaded it, a detached actor that ran with it), or the "
                          "cluster was restarted without its tables")
    chunks = json.loads(manifest)["chunks"]
    parts = []
    for i in range(chunks):
        part = client.kv_get(f"{_KEY}{package}.{i}")
        if part is None:
            raise ConfigError(f"runtime_env package {package}: chunk {i} of {chunks} is missing")
        parts.append(part)
    data = b"".join(parts)
    if hashlib.sha256(data).hexdigest() != package:
        raise ConfigError(f"runtime_env package {package}: its bytes do not match its hash")
    return data


# A staging directory this old was left by a worker killed while it
# unpacked (one that unpacks takes seconds).
_STALE_STAGING_S = 3600


def _sweep_staging(root):
    """Removes the staging directories of unpacks that never finished."""
    now = time.time()
    for entry in os.scandir(root):
        try:
            if entry.name.startswith(".") and entry.is_dir(follow_symlinks=False) and \
                    now - entry.stat(follow_symlinks=False).st_mtime > _STALE_STAGING_S:
                shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            pass  # another worker removed it meanwhile


def _cache_bytes():
    """TROUPE_RUNTIME_ENV_CACHE_GB in bytes (ConfigError naming a bad one)."""
    raw = _core.getenv(CACHE_ENV)
    if not raw:
        return int(DEFAULT_CACHE_GB * 2**30)
    try:
        gb = float(raw)
    except ValueError:
        gb = -1.0
    if not 0 <= gb < 1e9:  # also NaN
        raise ConfigError(f"{CACHE_ENV}={raw!r}: the unpacked runtime_env cache's size must be a number of "
                          "GiB >= 0")
    return int(gb * 2**30)


def _tree_bytes(path):
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def _lock_path(root, package):
    return os.path.join(root, package + ".lock")


def _hold(root, package):
    """Locks `package` shared for this process (waiting while an eviction
    of it is under way); kept until release_unused() lets it go."""
    with _apply_lock:
        if package in _held:
            return
        fd = os.open(_lock_path(root, package), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        _held[package] = fd


def release_unused(packages):
    """Lets go of the packages this process holds other than `packages`."""
    with _apply_lock:
        for package in [p for p in _held if p not in packages]:
            os.close(_held.pop(package))


def _size_path(root, package):
    return os.path.join(root, package + ".size")


def _entry_bytes(root, package):
    """The bytes of cache entry `package`: written beside it once (an
    eviction then reads one small file per entry, not every file of every
    venv and package), measured and written when missing."""
    path = _size_path(root, package)
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        pass
    entry = os.path.join(root, package)
    size = _tree_bytes(entry)
    # Remembered only once whole: a pip venv is whole with its marker (an
    # unpacked package is renamed into place whole).
    from troupe import _pip

    if os.path.exists(os.path.join(entry, "pyvenv.cfg")) and not os.path.exists(
            os.path.join(entry, _pip.INSTALLED)):
        return size
    try:
        staging = f"{path}.{os.getpid()}.{threading.get_ident()}"
        with open(staging, "w", encoding="ascii") as f:
            f.write(str(size))
        os.replace(staging, path)  # whole or not at all
    except OSError:
        pass
    return size


def evict(root, keep):
    """Removes unpacked packages, least recently used first, while the cache
    is over its size; never `keep` (just unpacked) nor one a process holds.
    Returns the package ids removed."""
    cap = _cache_bytes()
    entries, total = [], 0
    for entry in os.scandir(root):
        try:
            if not (_PACKAGE_ID.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
                continue
            size = _entry_bytes(root, entry.name)
            total += size
            if entry.name != keep:
                entries.append((entry.stat(follow_symlinks=False).st_mtime, entry.name, size))
        except OSError:
            pass  # removed meanwhile by another eviction
    removed = []
    for _, package, size in sorted(entries):
        if total <= cap:
            break
        try:
            fd = os.open(_lock_path(root, package), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            continue  # best effort: the unpack that called this succeeded
        gone = None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # in use (this process's shared lock counts too)
            # Out of sight at once; a removal cut short leaves a staging
            # directory, which _sweep_staging removes later.
            gone = tempfile.mkdtemp(prefix=f".{package[:16]}.evicted.", dir=root)
            total -= size  # gone now, by this eviction or another's
            os.rename(os.path.join(root, package), os.path.join(gone, package))
            removed.append(package)
            try:
                os.unlink(_size_path(root, package))  # a new entry of that id is measured again
            except FileNotFoundError:
                pass
        except OSError:
            pass  # another eviction took it, or the disk refused: best effort
        finally:
            # Let go before the removal: a worker that waits for it unpacks
            # the package again meanwhile.
            os.close(fd)
        if gone:
            shutil.rmtree(gone, ignore_errors=True)
    return removed


def local_path(client, package):
    """Where package `package` lies unpacked on this machine: fetched and
    unpacked by the first worker that needs it (into a temporary directory,
    then renamed into place, so that others never see half of it). This
    process holds it from then on (release_unused lets go)."""
    if not _PACKAGE_ID.fullmatch(package):
        raise ConfigError(f"runtime_env: {package!r} is not a package id (64 hex digits)")
    _cache_bytes()  # a bad cache size fails every use alike, not the unpack alone
    root = _cache_root()
    target = os.path.join(root, package)
    _hold(root, package)
    if os.path.isdir(target):
        try:
            os.utime(target)  # used now: the last to be evicted
        except OSError:
            pass
        return target
    data = _fetch(client, package)
    _sweep_staging(root)
    staging = tempfile.mkdtemp(prefix=f".{package[:16]}.", dir=root)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            for info in z.infolist():
                name = info.filename
                if name.startswith("/") or ".." in name.split("/"):
                    raise ConfigError(f"runtime_env package {package}: member {name!r} points outside it")
                z.extract(info, staging)
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    os.chmod(os.path.join(staging, name), mode)
        try:
            os.rename(staging, target)
        except OSError:
            if not os.path.isdir(target):  # another worker's rename won, or something else failed
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    evict(root, package)
    return target


def inherited():
    """(working_dir, py_modules) package ids this worker runs with: what the
    tasks and actors it starts inherit unless their runtime_env says."""
    modules = _core.getenv(PY_MODULES_ENV)
    return _core.getenv(WORKING_DIR_ENV) or None, tuple(modules.split(":")) if modules else ()


def environment(working_dir, py_modules):
    """The worker environment entries that name the packages."""
    env = []
    if working_dir:
        env.append(f"{WORKING_DIR_ENV}={working_dir}")
    if py_modules:
        env.append(f"{PY_MODULES_ENV}={':'.join(py_modules)}")
    return env


def apply(client_of):
    """In a worker, before a task or constructor runs: the packages its
    environment names are on sys.path (its pip venv made, and its
    site-packages after them: troupe/_pip.py), and its working_dir is the
    current directory. Cheap when nothing
    changed (every task calls it). `client_of()` gives the client, asked
    only when a package is fetched."""
    from troupe import _pip

    working_dir, py_modules = inherited()
    pip = _pip.inherited()
    if (working_dir, py_modules, pip) == (_applied["working_dir"], _applied["py_modules"], _applied["pip"]):
        # Unchanged, but the env_vars applied before each task set PATH and
        # PYTHONPATH again as given: the venv's entries go back in front
        # (from the second task on, its scripts and packages were gone for
        # the processes a task started).
        if _applied["venv"]:
            _pip.put_first(_applied["venv"])
        return
    with _apply_lock:
        if (working_dir, py_modules, pip) == (_applied["working_dir"], _applied["py_modules"], _applied["pip"]):
            return
        for path in _applied["paths"]:
            while path in sys.path:
                sys.path.remove(path)
        if _applied["venv"]:
            _pip.deactivate(_applied["venv"])
            _applied["venv"] = None
        wanted = [p for p in (working_dir, *py_modules, pip and _pip.env_id(pip)) if p]
        if wanted:
            # All held before any is unpacked: an unpack's eviction leaves
            # this env's other packages alone.
            root = _cache_root()
            for package in wanted:
                if _PACKAGE_ID.fullmatch(package):
                    _hold(root, package)
        paths = []
        if working_dir:
            path = local_path(client_of(), working_dir)
            os.chdir(path)
            paths.append(path)
        for package in py_modules:
            paths.append(local_path(client_of(), package))
        venv = None
        if pip:
            venv = _pip.local_path(pip)
            paths.extend(_pip.activate(venv))
        release_unused(set(wanted))
        sys.path[0:0] = paths
        _applied.update(working_dir=working_dir, py_modules=py_modules, pip=pip, venv=venv, paths=paths)
