"""Worker output on the driver's console, marked with its worker.

On a cluster started with `troupe start`, each worker writes to a file of
its own and a driver prints what its work wrote, each line marked
`(Counter pid=4242) ...` (troupe._driver_logs). On an embedded cluster the
workers share the driver's stdout and stderr: there a worker marks its own
lines the same way, so that the output of four ranks or a hundred tasks
still says which process printed what, as Ray's does.

Only what Python writes through sys.stdout and sys.stderr is marked; bytes
written straight to file descriptors 1 and 2 (C extensions) are not."""
import errno
import io
import os
import re
import sys
import threading

_WORKER_FILE = re.compile(r"/worker-[^/]*\.log$")  # runtime/node/worker_pool.cc
_installed = []  # the wrappers, once installed
_install_lock = threading.Lock()
_label = None  # what mark_output was last given


def _shares_drivers_console():
    """Whether this worker's stdout is the driver's (an embedded cluster),
    not a worker file of its node agent's."""
    try:
        return not _WORKER_FILE.search(os.readlink("/proc/self/fd/1"))
    except OSError:
        return False


class _Wrapper(io.TextIOBase):
    """A text stream in front of another, `_stream`, which answers for it
    what a wrapper does not do itself."""

    # TextIOBase defines these (as None): the wrapped stream's, not those.
    @property
    def encoding(self):
        return self._stream.encoding

    @property
    def errors(self):
        return self._stream.errors

    @property
    def newlines(self):
        return self._stream.newlines

    def writable(self):
        return True

    def isatty(self):
        return self._stream.isatty()

    def fileno(self):
        return self._stream.fileno()

    def __getattr__(self, name):  # buffer, reconfigure, ...
        return getattr(self._stream, name)


class _Marked(_Wrapper):
    """A text stream that starts each line it passes on with a mark. It
    passes on whole lines, each line in one write: print() writes a line's
    text and its end apart, and between the two another worker on the same
    console would write its own line into the middle of this one. A part
    line waits for its end, or for a flush (a prompt)."""

    def __init__(self, stream, mark):
        self._stream = stream
        self._mark = mark
        self._line_start = True
        self._partial = ""
        # Reentrant: a signal handler that prints while a write is under
        # way must not wait on itself.
        self._lock = threading.RLock()


    def write(self, text):
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        with self._lock:
            pieces = (self._partial + text).splitlines(keepends=True)
            # A line (or a progress bar's frame, ended by \r) is whole.
            self._partial = pieces.pop() if pieces and not pieces[-1].endswith(("\n", "\r")) else ""
            self._pass_on(pieces)
        return len(text)

    def _pass_on(self, pieces):
        out = []
        for piece in pieces:
            if self._line_start:
                out.append(self._mark)
            out.append(piece)
            self._line_start = piece.endswith(("\n", "\r\n"))
        if out:
            self._stream.write("".join(out))

    def flush(self):
        with self._lock:
            if self._partial:
                self._pass_on([self._partial])
                self._partial = ""
        self._stream.flush()

    def end_line(self):
        """Ends a line left open (a call that printed with end=""): its
        text goes out now, marked and ended, rather than waiting in this
        process or running into the next line on the shared console."""
        with self._lock:
            if not self._partial and self._line_start:
                return
            self._pass_on([self._partial + "\n"])
            self._partial = ""
        self._stream.flush()




# What a write to a full file system fails with: no space, over quota, too big.
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class _Unfailing(_Wrapper):
    """A worker's stdout or stderr whose writes never fail its work when the
    file system of its log is full: what cannot be written is dropped, and
    once writes go through again a line says that some was. Any other
    error is raised as before."""

    def __init__(self, stream):
        self._stream = stream
        self._dropped = False


    def _full(self, e):
        if e.errno not in _FULL:
            raise e
        self._dropped = True

    def write(self, text):
        try:
            if self._dropped:
                self._dropped = False
                self._stream.write("[troupe: output was dropped here while the log's file system was full]\n")
            return self._stream.write(text)
        except OSError as e:
            self._full(e)
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except OSError as e:
            self._full(e)




def survive_full_disk():
    """Makes this worker's print() and logging go on when its log's file
    system is full (a full disk must not fail a training step), dropping
    what cannot be written."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Unfailing):
            setattr(sys, name, _Unfailing(stream))


def _remark():
    mark = f"({_label} pid={os.getpid()}) "
    for w in _installed:
        w._mark = mark


def _after_fork_in_child():
    # A forked child (a DataLoader worker) marks its lines with its own
    # pid, and does not inherit a lock another thread held at the fork.
    for w in _installed:
        w._lock = threading.RLock()
    _remark()


def end_lines():
    """At the end of a task, an actor call or a training loop: the lines its
    work left open go out ended (only where the driver's console is shared)."""
    for w in _installed:
        w.end_line()


def mark_output(label):
    """Marks this worker's lines `(label pid=N) ` from now on, when it shares
    the driver's console; a later call changes the mark."""
    global _label
    with _install_lock:
        _label = label
        if _installed:
            _remark()
            return
        if not _shares_drivers_console():
            return
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if stream is None:
                continue
            w = _Marked(stream, "")
            setattr(sys, name, w)
            _installed.append(w)
        _remark()
        os.register_at_fork(after_in_child=_after_fork_in_child)
