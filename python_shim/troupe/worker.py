"""Entry point of a Python worker: ``python3 -m troupe.worker``, started by a
node agent (through the launcher of troupe._launcher) with TROUPE_ROLE=worker.
It serves the C++ worker loop, which calls troupe._worker_hooks."""
import importlib
import os
import sys

from troupe import _console, _core, _remote, _worker_hooks


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


def _keep_troupe_importable():
    """The exec below runs the interpreter itself, not the launcher that
    put troupe's package directory on PYTHONPATH: an expanded PYTHONPATH
    that did not reference the old one would leave `-m troupe.worker`
    nothing to import. The directory goes first, as the launcher puts it."""
    parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if parent not in entries:
        os.environ["PYTHONPATH"] = os.pathsep.join([parent] + entries)


def expand_env_vars():
    """runtime_env's env_vars that reference variables (a worker started
    for them, as troupe._remote sends them): expanded before anything reads
    them, preload_modules included. One that the loader, libc or the
    interpreter read at start (LD_LIBRARY_PATH, PYTHONPATH, ...) takes
    effect through an exec of this same command, in this same process."""
    if not _remote.apply_env_vars():
        return
    _keep_troupe_importable()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        # sys.orig_argv is Python 3.10's; before, this command's own form.
        argv = getattr(sys, "orig_argv", None) or [sys.executable, "-m", "troupe.worker", *sys.argv[1:]]
        os.execv(sys.executable, argv)
    except OSError as e:
        print(f"troupe.worker: cannot exec itself again with runtime_env's expanded env_vars ({e}); they are "
              "set for what it starts, but the loader and the interpreter of this one did not see them",
              file=sys.stderr, flush=True)


def main():
    expand_env_vars()
    # Line by line into its log file, as on a terminal: what the driver
    # shows of it (troupe._driver_logs) comes as it is printed.
    sys.stdout.reconfigure(line_buffering=True)
    _console.survive_full_disk()
    preload()
    _core.serve_worker(_worker_hooks)
    sys.exit("troupe.worker: not started by a troupe node agent (TROUPE_ROLE is not 'worker')")


if __name__ == "__main__":
    main()
