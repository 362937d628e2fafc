"""The executable a node agent starts for Python workers.

A worker executable is a single path or a script's text (ActorOptions::
executable): the driver gives the text of a small launcher that runs this
interpreter on troupe.worker with this package importable, and each node
agent writes it into its own session directory under the hash of its
content and runs it (runtime/node/script_executable.h). So no file of the
driver's has to exist on the other nodes; the interpreter and this package
do, at the same paths (the same install, e.g. a shared venv or image). The
node agent's warm pool keeps idle workers per executable, Python ones
included.
"""
import os
import shlex
import sys

_cached = {}


def worker_executable(preload=()):
    """The launcher's text; `preload` (module names) are imported by the
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
    _cached[preload] = text
    return text
