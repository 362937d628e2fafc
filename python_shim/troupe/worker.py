"""Entry point of a Python worker: ``python3 -m troupe.worker``, started by a
node agent (through the launcher of troupe._launcher) with TROUPE_ROLE=worker.
It serves the C++ worker loop, which calls troupe._worker_hooks."""
import importlib
import os
import sys

from troupe import _core, _worker_hooks


def preload():
    """Imports the modules TROUPE_PYTHON_PRELOAD names (the launcher sets it
    for actors created with preload_modules): in a pooled worker this runs
    before it is ready, so the actor it is handed finds them loaded. One
    that fails is reported in the worker's log and skipped; the actor's own
    import of it then fails with the real error."""
    for name in os.environ.pop("TROUPE_PYTHON_PRELOAD", "").split(","):
        if not name:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - reported, the actor decides
            print(f"troupe.worker: preloading {name!r} failed: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)


def main():
    # Line by line into its log file, as on a terminal: what the driver
    # shows of it (troupe._driver_logs) comes as it is printed.
    sys.stdout.reconfigure(line_buffering=True)
    preload()
    _core.serve_worker(_worker_hooks)
    sys.exit("troupe.worker: not started by a troupe node agent (TROUPE_ROLE is not 'worker')")


if __name__ == "__main__":
    main()
