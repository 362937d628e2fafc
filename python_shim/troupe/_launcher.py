"""The executable a node agent starts for Python workers.

A worker executable is a single path (ActorOptions::executable), so the
driver writes a small launcher that runs this interpreter on troupe.worker
with this package importable, named by the hash of its content in a
directory of this user's (mode 0700); the node agent's warm pool keeps idle
workers per executable, Python ones included. On a multi-machine cluster the
same path must exist on every node (the same install, e.g. a shared venv).
"""
import hashlib
import os
import shlex
import stat
import sys
import tempfile

_cached = {}


def _private_dir():
    path = os.path.join(tempfile.gettempdir(), f"troupe-python-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} must be a directory of this user's with mode 0700")
    return path


def worker_executable(preload=()):
    """The launcher's path; `preload` (module names) are imported by the
    worker before it serves, so a pooled worker has them loaded already.
    Each preload set is an executable, and so a pool, of its own."""
    preload = tuple(preload)
    if preload in _cached:
        return _cached[preload]
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    imports = f"TROUPE_PYTHON_PRELOAD={shlex.quote(','.join(preload))} " if preload else ""
    text = ("#!/bin/sh\n# troupe Python worker launcher (written by troupe._launcher)\n"
            f"PYTHONPATH={shlex.quote(package_parent)}${{PYTHONPATH:+:$PYTHONPATH}} {imports}"
            f"exec {shlex.quote(sys.executable)} -m troupe.worker \"$@\"\n")
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    directory = _private_dir()
    path = os.path.join(directory, f"worker-{digest}")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    _cached[preload] = path
    return path
