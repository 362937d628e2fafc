"""Entry point of a Python worker: ``python3 -m troupe.worker``, started by a
node agent (through the launcher of troupe._launcher) with TROUPE_ROLE=worker.
It serves the C++ worker loop, which calls troupe._worker_hooks."""
import sys

from troupe import _core, _worker_hooks


def main():
    _core.serve_worker(_worker_hooks)
    sys.exit("troupe.worker: not started by a troupe node agent (TROUPE_ROLE is not 'worker')")


if __name__ == "__main__":
    main()
